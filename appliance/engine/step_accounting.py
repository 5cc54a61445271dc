"""What the engine core keeps between steps besides the scheduler's state:
the counters behind ``StepStats`` (``StepCounters``) and the prompt
logprobs gathered until a request's first delta carries them
(``PromptLogprobs``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

from appliance.engine.outputs import StepStats, TokenLogprob

if TYPE_CHECKING:
    from appliance.engine.interfaces import SampledLogprob
    from appliance.engine.request import Request
    from appliance.engine.scheduler import Scheduler
    from appliance.engine.scheduler_output import SchedulerOutput


def token_logprobs(lps: Sequence[Optional[SampledLogprob]]) -> list[Optional[TokenLogprob]]:
    """The runner's per-token logprobs as the engine's outputs carry them."""
    return [lp if lp is None or type(lp) is TokenLogprob else TokenLogprob(lp.token_id, lp.logprob, lp.rank, lp.top)
            for lp in lps]


class StepCounters:
    """The core's counters since it was built or ``reset``: speculative
    decoding's drafts and acceptances, and the runner's last expert load
    balancing figures; the scheduler's and KV cache's own counters read
    from where ``reset`` left them."""

    def __init__(self) -> None:
        # (preemptions, prefix queries, prefix hits, corrupt offload tier files) at reset()
        self._counted_from = (0, 0, 0, 0)
        self._spec = [0, 0, 0]  # drafts, draft tokens, accepted tokens
        self._spec_per_pos: list[int] = []
        self._experts: Optional[dict] = None  # the runner's last expert load balancing figures
        self._slot_ratios: list[float] = []

    def count_spec(self, sched_out: SchedulerOutput, sampled: dict[str, list[int]]) -> None:
        """Drafts verified this step, and how many of each were accepted (every
        sampled token but the last: the target's own)."""
        for rid, drafts in sched_out.scheduled_spec_decode_tokens.items():
            if rid not in sampled:
                continue
            accepted = len(sampled[rid]) - 1
            self._spec[0] += 1
            self._spec[1] += len(drafts)
            self._spec[2] += accepted
            if len(self._spec_per_pos) < len(drafts):
                self._spec_per_pos += [0] * (len(drafts) - len(self._spec_per_pos))
            for pos in range(accepted):
                self._spec_per_pos[pos] += 1

    def observe_experts(self, experts: Optional[dict]) -> None:
        """The runner's expert load balancing figures of a step (None: it has no balancer)."""
        if experts is not None:
            self._experts = experts
            self._slot_ratios += experts["slot_load_ratios"]

    def stats(self, scheduler: Scheduler, iteration_tokens: int, token_budget: int,
              compile_seconds: list[float]) -> StepStats:
        """Gauges now; counters since construction or ``reset``. The slot load
        ratios are reported once."""
        s, kv = scheduler, scheduler.kv
        p0, q0, h0, c0 = self._counted_from
        drafts, draft_tokens, accepted = self._spec
        stats = StepStats(len(s.running), len(s.waiting), kv.usage(), s.num_preemptions - p0,
                          kv.stats.queries - q0, kv.stats.hits - h0, iteration_tokens, token_budget,
                          drafts, draft_tokens, accepted, list(self._spec_per_pos), compile_seconds)
        stats.kv_offload_corrupt_blocks = _corrupt_tier_blocks(scheduler) - c0
        if self._experts is not None:
            stats.eplb_balancedness = self._experts["balancedness"]
            stats.eplb_rebalances = self._experts["rebalances"]
            stats.eplb_rebalance_seconds = self._experts["rebalance_seconds"]
            stats.expert_load = list(self._experts["expert_load"])
            stats.eplb_slot_load_ratios, self._slot_ratios = self._slot_ratios, []
        return stats

    def reset(self, scheduler: Scheduler) -> None:
        """Count from zero again."""
        kv = scheduler.kv
        self._counted_from = (scheduler.num_preemptions, kv.stats.queries, kv.stats.hits,
                              _corrupt_tier_blocks(scheduler))
        self._spec, self._spec_per_pos = [0, 0, 0], []


def _corrupt_tier_blocks(scheduler: Scheduler) -> int:
    """Offload tier files that failed their checks on load since the engine was built."""
    c = scheduler.connector
    return c.corrupt_blocks if c is not None else 0


class PromptLogprobs:
    """Prompt logprobs of the requests that asked for them, gathered step by
    step (a prompt runs over several chunks) until the request's first delta
    with tokens carries them all."""

    def __init__(self) -> None:
        self._got: dict[str, list[Optional[TokenLogprob]]] = {}

    def __bool__(self) -> bool:
        return bool(self._got)

    def start(self, request_id: str) -> None:
        self._got[request_id] = [None]  # the first prompt token has nothing before it

    def discard(self, request_id: str) -> None:
        self._got.pop(request_id, None)

    def gather(self, scored: dict[str, tuple[int, Sequence[SampledLogprob]]]) -> None:
        """Append what a step scored of each prompt; positions scored before
        (the prompt runs again after a preemption or a failed step) are skipped."""
        for rid, (first, lps) in scored.items():
            got = self._got.get(rid)
            if got is not None and first <= len(got) < first + len(lps):
                got += token_logprobs(lps[len(got) - first:])

    def take(self, req: Request) -> Optional[list[Optional[TokenLogprob]]]:
        """A request's prompt logprobs, once all are in (for its first delta with tokens)."""
        got = self._got.get(req.request_id)
        if got is None or len(got) < req.num_prompt_tokens:
            return None
        return self._got.pop(req.request_id)

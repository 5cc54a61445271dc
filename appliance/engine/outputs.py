"""What the engine core reports: each step's output per request
(``RequestOutputDelta``, with its tokens' ``TokenLogprob``) and the core's
gauges and counters after a step (``StepStats``). msgspec Structs: they
cross the engine-core process boundary as they are (``server/messages.py``)."""

from __future__ import annotations

from typing import Any, Optional, Union

import msgspec


class TokenLogprob(msgspec.Struct):
    """Log-probability of one sampled token and the top candidates of its step."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]] = []


class BeamSequence(msgspec.Struct):
    """One beam a beam search returns (``engine/beam_search.py``)."""

    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" or "length"
    stop_reason: Optional[int] = None  # the stop token id that ended it (None: EOS, length)
    score: float = 0.0  # summed log-probabilities / length ** length_penalty


class RequestOutputDelta(msgspec.Struct):
    """What one step added to one request. A msgspec Struct: it crosses the
    engine-core process boundary as it is (see ``server/messages.py``)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: Optional[str] = None
    stop_reason: Union[str, int, None] = None  # the stop string matched, the stop token id, or None (EOS, length)
    logprobs: list[Optional[TokenLogprob]] = []
    # with the request's first delta, when it asked for them: one per prompt token (the first None)
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    queue_time: Optional[float] = None  # on the first delta with tokens: seconds waiting before first scheduled
    # on the last delta, when a KV connector holds the request's KV for a peer: what the peer needs to fetch it
    kv_transfer_params: Optional[dict[str, Any]] = None
    # a beam search's one output (finished): its n best beams, best first
    beams: Optional[list[BeamSequence]] = None


class StepStats(msgspec.Struct):
    """Gauges and counters of the core after a step (sent to the front end)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_preemptions: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    iteration_tokens: int = 0  # tokens scheduled by the last step (0: no step ran)
    token_budget: int = 0  # tokens the next step may schedule
    spec_drafts: int = 0  # speculative decoding: drafts verified,
    spec_draft_tokens: int = 0  # the draft tokens in them,
    spec_accepted_tokens: int = 0  # how many of those were accepted,
    spec_accepted_per_pos: list[int] = []  # and accepted at each draft position (0 = first)
    grammar_compile_seconds: list[float] = []  # grammars compiled since the previous stats (each reported once)
    # expert-parallel load balancing (parallel.eplb; balancedness 0: none)
    eplb_balancedness: float = 0.0  # mean over max of the ranks' expert loads in the window
    eplb_rebalances: int = 0
    eplb_rebalance_seconds: float = 0.0  # spent placing experts and moving their weights, all rebalances
    expert_load: list[int] = []  # tokens each logical expert took in the window, all sparse layers
    eplb_slot_load_ratios: list[float] = []  # each rebalance's slot loads over their mean (each reported once)
    kv_offload_corrupt_blocks: int = 0  # offload tier files that failed their checks on load (removed, recomputed)

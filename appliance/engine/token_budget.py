"""The token budget that keeps a step near a latency objective.

Two objectives bound how long a running stream waits for its next token
while prompts prefill, either or both: ``scheduler.target_itl_ms``, a step's
time, and ``scheduler.max_itl_ratio``, a multiple of the running decodes'
own time (a stream's gap within that many of its inter-token latency alone,
whatever the model and the machine: a profile serves both). Every step
decodes one token for each running stream and spends the rest of its budget
on prefill chunks, so the step time, and with it every stream's inter-token
gap, follows what is scheduled: the tokens (weights and MLPs) and the
attention pairs (each new token attends to its whole context, so a long
prompt's later chunks cost more).
``TokenBudget`` fits ``step seconds = a + b * tokens + c * pairs`` by least
squares over the steps it keeps and, before each step, sets the budget to the
largest that fits the objectives given the running decodes and the context
the next prefill chunk starts from, at most ``cap``
(``scheduler.max_num_batched_tokens``). The decodes' own time is the median
of the last decode-only steps of as many tokens where there are some (a
line through chunks hundreds of tokens long misjudges a few tokens' step by
tens of percent, and the ratio multiplies it), else the fit's.
The steps kept are the last few of each shape (tokens and mean context, each
to a power of two), the shapes seen last: a budget that meets its objective
makes every step of a long prompt's prefill take the same time, chunks
shrinking as their context grows, and a window of those steps alone cannot
tell a token's cost from a pair's (it drifts to a free token and a costly
step, then to a budget ten times too large). The decodes and the early
chunks seen before keep both costs pinned.
A waiting prompt always gets at least ``min_prefill_share`` of a step's time
(``scheduler.min_prefill_share``): where the objective leaves it less (the
running decodes take more than 1 - share of it, or alone take longer than it:
a large model on a few cores, or many streams), the step lasts the decodes'
time / (1 - share), at 0.5 twice the decodes alone. Starving the prompts there
would only add their wait to an objective missed either way. At 0 the
objective holds prompts to one token a step beside decodes that overrun it;
the budget never falls below the running decodes plus one (every stream
advances, and so does the prompt).
The ratio must leave a prompt that share: at least 1 / (1 - share).
While the steps kept do not pin a cost down (decode-only steps of one
size) it keeps the last fit they did give. Before any fit it
keeps the plan's first estimate (never below the running decodes plus
one), which rests on the prefill roofline and so errs large: the server's
warm-up runs a prompt of that size first (``calibration_prompt_len``), so a
fit exists before the first request. When every step kept was exactly as
large as the budget, which a budget of 1 after a stalled step makes of
every step, the steps cannot say more, so it doubles the budget to learn.
"""

from __future__ import annotations

import math
import statistics
from collections import OrderedDict, deque
from typing import TYPE_CHECKING, Hashable, Iterable, Optional, TypeVar

if TYPE_CHECKING:
    from appliance.engine.request import Request
    from appliance.engine.scheduler_output import SchedulerOutput


def attention_pairs(num_new: int, context_after: int) -> int:
    """Query-key pairs of ``num_new`` tokens whose context ends at ``context_after``."""
    return num_new * context_after - num_new * (num_new - 1) // 2


K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


def _decoding(req: Request) -> bool:
    """Whether ``req``'s next tokens are a running stream's (its prompt computed), not a prefill chunk."""
    return req.num_computed_tokens >= req.num_tokens - 1


class TokenBudget:
    MIN_SAMPLES = 4

    def __init__(self, target_itl_ms: Optional[float], initial: int, cap: int, shapes: int = 32, per_shape: int = 4,
                 min_prefill_share: float = 0.5, max_itl_ratio: Optional[float] = None):
        if cap < 1:
            raise ValueError(f"the token budget needs a cap of at least 1, got {cap}")
        if not 0.0 <= min_prefill_share < 1.0:
            raise ValueError(f"the prefill's share of a step must be in [0, 1), got {min_prefill_share}")
        if target_itl_ms is None and max_itl_ratio is None:
            raise ValueError("the token budget needs an objective: target_itl_ms, max_itl_ratio or both")
        self.target_s = math.inf if target_itl_ms is None else target_itl_ms / 1e3
        if max_itl_ratio is not None and not max_itl_ratio * (1.0 - min_prefill_share) >= 1.0:
            raise ValueError(f"a step of at most {max_itl_ratio} times the decodes' time leaves a prompt less than "
                             f"its share {min_prefill_share} of it: the ratio must be at least "
                             f"1 / (1 - share) = {1.0 / (1.0 - min_prefill_share):g}")
        self.min_prefill_share = min_prefill_share
        self.max_itl_ratio = max_itl_ratio
        self.cap = cap
        self.budget = self._clamp(initial, 1)
        self.shapes, self.per_shape = shapes, per_shape
        # shape -> its last steps as (order, tokens, pairs, seconds); the shape seen last at the end
        self._kept: OrderedDict[tuple[int, int], deque[tuple[int, int, int, float]]] = OrderedDict()
        self._order = 0
        self.model: Optional[tuple[float, float, float]] = None  # (a, b, c): the last fit the steps gave
        # decode-only steps' seconds by their tokens, the last per_shape of each; the counts seen last at the end
        self._decode_steps: OrderedDict[int, deque[float]] = OrderedDict()

    @property
    def samples(self) -> list[tuple[int, int, float]]:
        """The steps kept, oldest first: (tokens, pairs, seconds)."""
        return [(t, p, s) for _, t, p, s in sorted(x for steps in self._kept.values() for x in steps)]

    def forget(self) -> None:
        """Drop the steps kept (the fit they gave stays until new steps give another)."""
        self._kept.clear()
        self._decode_steps.clear()

    def calibration_prompt_len(self) -> int:
        """The prompt a warm-up prefills alone to give the first fit: the
        first estimate's size (its step, then its decodes, fit the line)."""
        return self.budget

    def _clamp(self, tokens: float, floor: int) -> int:
        return max(min(floor, self.cap), min(self.cap, int(tokens + 1e-6)))  # 79.99999... is 80

    def fit(self) -> Optional[tuple[float, float, float]]:
        """(a, b, c) of ``seconds = a + b * tokens + c * pairs`` over the steps
        kept, or None while they do not pin down a positive per-token cost.
        When tokens and pairs do not vary apart, ``c`` is 0 and ``b`` carries both."""
        samples = self.samples
        if len(samples) < self.MIN_SAMPLES:
            return None
        n = len(samples)
        mt = sum(t for t, _, _ in samples) / n
        mp = sum(p for _, p, _ in samples) / n
        ms = sum(s for _, _, s in samples) / n
        tt = sum((t - mt) ** 2 for t, _, _ in samples)
        if tt == 0:
            return None
        pp = sum((p - mp) ** 2 for _, p, _ in samples)
        tp = sum((t - mt) * (p - mp) for t, p, _ in samples)
        ts = sum((t - mt) * (s - ms) for t, _, s in samples)
        ps = sum((p - mp) * (s - ms) for _, p, s in samples)
        det = tt * pp - tp * tp
        b, c = ((ts * pp - tp * ps) / det, (tt * ps - tp * ts) / det) if det > 1e-9 * tt * pp else (0.0, -1.0)
        if b <= 0 or c < 0:  # pairs and tokens move together here: one cost per token
            b, c = ts / tt, 0.0
        if b <= 0:
            return None
        return max(0.0, ms - b * mt - c * mp), b, c

    def _last_of(self, store: OrderedDict[K, deque[V]], key: K) -> deque[V]:
        """``store``'s steps under ``key`` (the last ``per_shape``), moved to the end as the key seen last; a
        new key past ``shapes`` of them drops the key seen longest ago."""
        steps = store.pop(key, None)
        if steps is None:
            steps = deque(maxlen=self.per_shape)
            if len(store) >= self.shapes:
                store.popitem(last=False)
        store[key] = steps
        return steps

    def observe(self, tokens: int, pairs: int, seconds: float, decodes_only: bool = False) -> None:
        """Record a step of ``tokens`` new tokens and ``pairs`` attention pairs
        (``decodes_only``: every token a running stream's next)."""
        if tokens <= 0 or seconds <= 0:
            return
        if decodes_only:
            self._last_of(self._decode_steps, tokens).append(seconds)
        shape = (tokens.bit_length(), (pairs // tokens).bit_length())
        self._last_of(self._kept, shape).append((self._order, tokens, pairs, seconds))
        self._order += 1
        self.model = self.fit() or self.model

    def next_budget(self, decodes: int, decode_pairs: int, chunk_context: int) -> int:
        """The budget for a step that decodes ``decodes`` streams (``decode_pairs``
        attention pairs) and gives the rest to a prefill chunk starting after
        ``chunk_context`` tokens of its prompt."""
        fitted = self.model
        if fitted is None:
            samples = self.samples
            if len(samples) >= self.MIN_SAMPLES and all(t == self.budget for t, _, _ in samples):
                # every step kept was as large as the budget allowed and no larger: without steps of
                # another size the cost per token stays unknown, so try twice as many
                self.budget *= 2
            self.budget = self._clamp(self.budget, decodes + 1)
            return self.budget
        a, b, c = fitted
        # decodes_s + b x + c (x chunk_context + x (x + 1) / 2) = step, for the chunk x
        measured = self._decode_steps.get(decodes)
        decodes_s = statistics.median(measured) if measured else a + b * decodes + c * decode_pairs
        step_s = max(self.target_s, decodes_s / (1.0 - self.min_prefill_share))
        if self.max_itl_ratio is not None:
            step_s = min(step_s, self.max_itl_ratio * decodes_s)
        rest = step_s - decodes_s
        lin = b + c * (chunk_context + 0.5)
        if rest <= 0:
            x = 0.0
        elif c > 0:
            x = (-lin + math.sqrt(lin * lin + 2 * c * rest)) / c
        else:
            x = rest / lin
        self.budget = self._clamp(decodes + x, decodes + 1)
        return self.budget

    def budget_for(self, running: Iterable[Request]) -> int:
        """The token budget for the next step over the ``running`` requests:
        the decodes (with their drafts) first, the rest for a prefill chunk
        from where the first unfinished prompt stands; with no stream decoding
        nobody waits for a next token, so prompts prefill at the cap."""
        decodes, pairs, chunk_context = 0, 0, 0
        for req in running:
            if _decoding(req):
                n = 1 + len(req.spec_token_ids)
                decodes += n
                pairs += attention_pairs(n, req.num_computed_tokens + n)
            elif not chunk_context:
                chunk_context = req.num_computed_tokens
        return self.cap if not decodes else self.next_budget(decodes, pairs, chunk_context)

    def observe_step(self, sched_out: SchedulerOutput, requests: dict[str, Request], seconds: float) -> None:
        """A step's time with what it ran (``requests``: the scheduler's, computed counts before the step)."""
        pairs, decodes_only = 0, True
        for rid, n in sched_out.num_scheduled_tokens.items():
            req = requests.get(rid)
            if req is not None:
                pairs += attention_pairs(n, req.num_computed_tokens)
                decodes_only = decodes_only and _decoding(req)
        self.observe(sched_out.total_num_scheduled_tokens, pairs, seconds, decodes_only)

    def calibration_prompt_within(self, max_model_len: int, free_tokens: int) -> int:
        """The calibration prompt's length (``calibration_prompt_len``) within what one
        request may hold now: ``max_model_len`` and ``free_tokens`` of KV, with room
        for the decodes that follow."""
        room = min(max_model_len, free_tokens) - self.MIN_SAMPLES - 1
        return max(1, min(self.calibration_prompt_len(), room))

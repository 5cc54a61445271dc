"""The token budget that keeps a step near a latency objective.

``scheduler.target_itl_ms`` declares how long a running stream may wait
for its next token. Every step decodes one token for each running stream
and spends the rest of its budget on prefill chunks, so the step time, and
with it every stream's inter-token gap, follows what is scheduled: the
tokens (weights and MLPs) and the attention pairs (each new token attends
to its whole context, so a long prompt's later chunks cost more).
``TokenBudget`` fits ``step seconds = a + b * tokens + c * pairs`` by least
squares over the last steps and, before each step, sets the budget to the
largest that fits the objective given the running decodes and the context
the next prefill chunk starts from, at most ``cap``
(``scheduler.max_num_batched_tokens``).
A waiting prompt always gets at least ``min_prefill_share`` of a step's time
(``scheduler.min_prefill_share``): where the objective leaves it less (the
running decodes take more than 1 - share of it, or alone take longer than it:
a large model on a few cores, or many streams), the step lasts the decodes'
time / (1 - share), at 0.5 twice the decodes alone. Starving the prompts there
would only add their wait to an objective missed either way. At 0 the
objective holds prompts to one token a step beside decodes that overrun it;
the budget never falls below the running decodes plus one (every stream
advances, and so does the prompt).
While the last steps do not pin a cost down (a stretch of decode-only
steps of one size) it keeps the last fit they did give. Before any fit it
keeps the plan's first estimate (never below the running decodes plus
one), which rests on the prefill roofline and so errs large: the server's
warm-up runs a prompt of that size first (``calibration_prompt_len``), so a
fit exists before the first request. When every recent step was exactly as
large as the budget, which a budget of 1 after a stalled step makes of
every step, the steps cannot say more, so it doubles the budget to learn.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Optional


def attention_pairs(num_new: int, context_after: int) -> int:
    """Query-key pairs of ``num_new`` tokens whose context ends at ``context_after``."""
    return num_new * context_after - num_new * (num_new - 1) // 2


class TokenBudget:
    MIN_SAMPLES = 4

    def __init__(self, target_itl_ms: float, initial: int, cap: int, window: int = 32,
                 min_prefill_share: float = 0.5):
        if cap < 1:
            raise ValueError(f"the token budget needs a cap of at least 1, got {cap}")
        if not 0.0 <= min_prefill_share < 1.0:
            raise ValueError(f"the prefill's share of a step must be in [0, 1), got {min_prefill_share}")
        self.target_s = target_itl_ms / 1e3
        self.min_prefill_share = min_prefill_share
        self.cap = cap
        self.budget = self._clamp(initial, 1)
        self.samples: deque[tuple[int, int, float]] = deque(maxlen=window)  # (tokens, pairs, seconds)
        self.model: Optional[tuple[float, float, float]] = None  # (a, b, c): the last fit the steps gave

    def calibration_prompt_len(self) -> int:
        """The prompt a warm-up prefills alone to give the first fit: the
        first estimate's size (its step, then its decodes, fit the line)."""
        return self.budget

    def _clamp(self, tokens: float, floor: int) -> int:
        return max(min(floor, self.cap), min(self.cap, int(tokens + 1e-6)))  # 79.99999... is 80

    def fit(self) -> Optional[tuple[float, float, float]]:
        """(a, b, c) of ``seconds = a + b * tokens + c * pairs`` over the window,
        or None while the steps seen do not pin down a positive per-token cost.
        When tokens and pairs do not vary apart, ``c`` is 0 and ``b`` carries both."""
        if len(self.samples) < self.MIN_SAMPLES:
            return None
        n = len(self.samples)
        mt = sum(t for t, _, _ in self.samples) / n
        mp = sum(p for _, p, _ in self.samples) / n
        ms = sum(s for _, _, s in self.samples) / n
        tt = sum((t - mt) ** 2 for t, _, _ in self.samples)
        if tt == 0:
            return None
        pp = sum((p - mp) ** 2 for _, p, _ in self.samples)
        tp = sum((t - mt) * (p - mp) for t, p, _ in self.samples)
        ts = sum((t - mt) * (s - ms) for t, _, s in self.samples)
        ps = sum((p - mp) * (s - ms) for _, p, s in self.samples)
        det = tt * pp - tp * tp
        b, c = ((ts * pp - tp * ps) / det, (tt * ps - tp * ts) / det) if det > 1e-9 * tt * pp else (0.0, -1.0)
        if b <= 0 or c < 0:  # pairs and tokens move together here: one cost per token
            b, c = ts / tt, 0.0
        if b <= 0:
            return None
        return max(0.0, ms - b * mt - c * mp), b, c

    def observe(self, tokens: int, pairs: int, seconds: float) -> None:
        """Record a step of ``tokens`` new tokens and ``pairs`` attention pairs."""
        if tokens > 0 and seconds > 0:
            self.samples.append((tokens, pairs, seconds))
            self.model = self.fit() or self.model

    def next_budget(self, decodes: int, decode_pairs: int, chunk_context: int) -> int:
        """The budget for a step that decodes ``decodes`` streams (``decode_pairs``
        attention pairs) and gives the rest to a prefill chunk starting after
        ``chunk_context`` tokens of its prompt."""
        fitted = self.model
        if fitted is None:
            if len(self.samples) >= self.MIN_SAMPLES and all(t == self.budget for t, _, _ in self.samples):
                # every recent step was as large as the budget allowed and no larger: without steps of
                # another size the cost per token stays unknown, so try twice as many
                self.budget *= 2
            self.budget = self._clamp(self.budget, decodes + 1)
            return self.budget
        a, b, c = fitted
        # a + b (decodes + x) + c (decode_pairs + x chunk_context + x (x + 1) / 2) = step, for the chunk x
        decodes_s = a + b * decodes + c * decode_pairs
        step_s = max(self.target_s, decodes_s / (1.0 - self.min_prefill_share))
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

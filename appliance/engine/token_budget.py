"""The token budget that keeps a step near a latency objective.

``scheduler.target_itl_ms`` declares how long a running stream may wait
for its next token. Every step decodes one token for each running stream
and spends the rest of its budget on prefill chunks, so the step time, and
with it every stream's inter-token gap, follows the number of tokens
scheduled. ``TokenBudget`` fits ``step seconds = a + b * tokens`` by least
squares over the last steps (``a``: the fixed cost of a step and its
decodes, ``b``: the cost of one more token) and sets the next budget to
what fits in the objective, between ``floor`` (room for every running
stream's decode) and ``cap`` (``scheduler.max_num_batched_tokens``). Until
the steps say more it keeps the plan's first estimate.
"""

from __future__ import annotations

from collections import deque


class TokenBudget:
    MIN_SAMPLES = 4

    def __init__(self, target_itl_ms: float, initial: int, floor: int, cap: int, window: int = 32):
        if not 1 <= floor <= cap:
            raise ValueError(f"the token budget needs 1 <= floor ({floor}) <= cap ({cap})")
        self.target_s = target_itl_ms / 1e3
        self.floor, self.cap = floor, cap
        self.budget = self._clamp(initial)
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)

    def _clamp(self, tokens: float) -> int:
        return max(self.floor, min(self.cap, int(tokens + 1e-6)))  # 79.99999... is 80

    def fit(self) -> tuple[float, float] | None:
        """(a, b) of ``seconds = a + b * tokens`` over the window, or None
        while the steps seen do not pin down a positive per-token cost."""
        if len(self.samples) < self.MIN_SAMPLES:
            return None
        n = len(self.samples)
        mean_t = sum(t for t, _ in self.samples) / n
        mean_s = sum(s for _, s in self.samples) / n
        var = sum((t - mean_t) ** 2 for t, _ in self.samples)
        if var == 0:
            return None
        b = sum((t - mean_t) * (s - mean_s) for t, s in self.samples) / var
        if b <= 0:
            return None
        return max(0.0, mean_s - b * mean_t), b

    def observe(self, tokens: int, seconds: float) -> int:
        """Record a step of ``tokens`` that took ``seconds``; the next step's budget."""
        if tokens > 0 and seconds > 0:
            self.samples.append((tokens, seconds))
            fitted = self.fit()
            if fitted is not None:
                a, b = fitted
                self.budget = self._clamp((self.target_s - a) / b)
        return self.budget

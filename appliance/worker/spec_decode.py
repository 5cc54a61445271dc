"""Draft proposers for speculative decoding (``speculative.method``).

The n-gram proposer (prompt lookup) drafts from the request's own tokens:
it finds the longest suffix of the context, between ``prompt_lookup_min``
and ``prompt_lookup_max`` tokens long, that occurred earlier in the
context (the earliest such occurrence), and proposes the up to k tokens
that followed it. It needs no weights and costs a scan of the context per
step; the drafts are then verified by the target model in one forward
(``sampler.verify_drafts``).
"""

from __future__ import annotations

from typing import Any

import numpy as np


def ngram_draft(context: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` tokens that followed the earliest earlier occurrence of the
    longest suffix of ``context`` of ``min_n``..``max_n`` tokens; [] when no
    suffix of at least ``min_n`` tokens occurred before.

    >>> ngram_draft(np.array([1, 2, 3, 4, 2, 3]), 4, 2, 3)
    [4, 2, 3]
    """
    n_ctx = len(context)
    if k <= 0 or n_ctx < min_n + 1:
        return []
    last = context[-1]
    # candidate ends: an earlier position holding the last token, with a token after it
    ends = np.flatnonzero(context[: n_ctx - 1] == last)
    if len(ends) == 0:
        return []
    # match[p] = how many tokens back from end p agree with the context's suffix (up to max_n)
    match = np.ones(len(ends), dtype=np.int64)
    alive = np.ones(len(ends), dtype=bool)
    for t in range(1, min(max_n, n_ctx - 1)):
        back = ends - t
        ok = alive & (back >= 0)
        ok[ok] = context[back[ok]] == context[n_ctx - 1 - t]
        alive = ok
        if not alive.any():
            break
        match += alive
    best = int(match.max())
    if best < min_n:
        return []
    end = int(ends[np.argmax(match == best)])  # the earliest occurrence of the longest match
    return context[end + 1 : end + 1 + k].tolist()


class NgramProposer:
    """Drafts for a request from its prompt + output tokens (never drafts)."""

    def __init__(self, k: int, min_n: int, max_n: int, max_model_len: int):
        if k < 1 or not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram drafting needs k >= 1 and 1 <= min <= max; got k={k}, {min_n}..{max_n}")
        self.k, self.min_n, self.max_n, self.max_model_len = k, min_n, max_n, max_model_len

    def propose(self, token_ids: list[int], limit: int | None = None) -> list[int]:
        """Up to k drafts (fewer with ``limit``) to follow ``token_ids``."""
        # The next step verifies 1 + k tokens from position len - 1; the last
        # position a step computes is max_model_len - 2 (the scheduler's cap).
        k = min(self.k if limit is None else min(limit, self.k), self.max_model_len - 1 - len(token_ids))
        if k <= 0:
            return []
        return ngram_draft(np.asarray(token_ids, dtype=np.int64), k, self.min_n, self.max_n)

    def draft_step(self, runner: Any, states: list, ends: list[int], sampled: set[str], enabled: bool
                   ) -> dict[str, tuple[list[int], None]]:
        """The runner's hook after a step: drafts for the requests that sampled."""
        if not enabled:
            return {}
        return {s.req_id: (self.propose(s.token_ids, s.draft_limit), None) for s in states if s.req_id in sampled}

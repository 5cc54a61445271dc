"""The draft-model proposer (``speculative.method=draft_model``): a second,
smaller model of the target's family, run by the same model runner on its
own KV cache.

The draft's cache has the target's block count and shares the runner's
block table and slot mapping, so a request's draft K/V sits at the same
slots as its target K/V: the scheduler, the prefix cache and preemption
manage both at once (a block's bytes hold both models' K/V; the plan
counts them). Each step, after the target's tokens are known:

1. catch-up: the draft runs over each scheduled request's real tokens it
   has not seen (a prompt chunk, or the tokens accepted and emitted this
   step), from ``draft_computed`` on; a request that sampled takes its
   logits at its last token, and draws draft 1 from them;
2. k - 1 single-token steps feed draft j at the next position and draw
   draft j + 1 (the scheduler reserved ``num_lookahead_tokens`` = k slots
   past the step for these positions).

Drafts are the draft's argmax for greedy requests; sampled requests draw
from the draft's distribution q (the request's temperature and top-k/p/
min-p) and keep q for the rejection sampler, which accepts draft d with
min(1, p(d) / q(d)). Draft K/V at positions whose drafts are rejected is
overwritten by the next catch-up; a stale draft K/V (a prefix-cache block
computed while drafting was off) lowers acceptance, never correctness.
Blocks a KV connector filled (an offload tier's, a producer's) hold the
target's K/V only: a request starts with ``draft_computed`` before them,
so the catch-up runs the draft over them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch

from appliance.worker.kv_memory import zeroed_kv_cache
from appliance.worker.model_runner import rope_table_rows
from appliance.worker.sampler import _draw, _probs, position_generator

if TYPE_CHECKING:
    from appliance.worker.model_runner import CachedRequestState, ModelRunner

DRAFT_SALT = 0x5DEECE66D  # seeded requests draw drafts from generators apart from their tokens'


class DraftModelProposer:
    def __init__(self, model: Any, backend: Any, k: int, max_model_len: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype, kv_dtype: torch.dtype, device: Any, max_catch_up: int):
        arch = model.arch
        self.model, self.backend, self.k, self.max_model_len = model, backend, k, max_model_len
        self.max_catch_up = max_catch_up  # tokens one catch-up forward takes at most (the step's token cap)
        shape = backend.kv_cache_shape(num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
        self.kv_caches = [zeroed_kv_cache(shape, dtype=kv_dtype, device=device) for _ in range(arch.num_layers)]
        model.rope_cache(max_model_len, dtype, device)
        self._native: Any = None

    def _forward(self):
        if not self.backend.native_forward:
            return self.model
        if self._native is None:
            self._native = self.backend.build_native_forward(self.model)
        return self._native

    def _run(self, runner: ModelRunner, states: list[CachedRequestState], starts: list[int],
             tokens: list[list[int]], want: list[int]) -> torch.Tensor:
        """One draft forward: request i's ``tokens[i]`` at positions from
        ``starts[i]``; fp32 logits at the last token of the requests ``want``."""
        counts = np.array([len(t) for t in tokens], dtype=np.int64)
        ids, positions, groups, qsl = runner.batch_inputs(
            states, np.array(starts, dtype=np.int64), counts, np.concatenate([np.asarray(t, dtype=np.int64) for t in tokens]))
        metadata = self.backend.build_metadata(groups[0])  # a one-group cache: validation refuses a draft with more
        dev = runner.device
        rows = rope_table_rows(self.model, positions, states, counts)
        return self._forward()(torch.from_numpy(ids).to(dev), torch.from_numpy(rows).to(dev), self.kv_caches,
                               metadata, torch.from_numpy(qsl[1:][want] - 1).to(dev)).float().cpu()

    def _draw(self, runner: ModelRunner, s: CachedRequestState, logits: torch.Tensor, position: int
              ) -> tuple[int, Optional[torch.Tensor]]:
        p = s.params
        if p.greedy:
            return int(logits.argmax()), None
        q = _probs(logits, p)
        seed = p.seed
        gen = runner.generator if seed is None else position_generator(seed ^ DRAFT_SALT, position)
        return _draw(q, gen), q

    def draft_step(self, runner: ModelRunner, states: list[CachedRequestState], ends: list[int], sampled: set[str],
                   enabled: bool) -> dict[str, tuple[list[int], Optional[torch.Tensor]]]:
        """Drafts (and, for sampled requests, their q rows) for the requests
        of ``sampled``; every scheduled request's draft K/V caught up to
        ``ends`` first, at most ``max_catch_up`` tokens in all (a request
        further behind, after drafting was off, catches up over several steps
        and drafts once it has). Disabled, nothing runs."""
        if not enabled:
            return {}
        run, budget = [], self.max_catch_up
        # requests that sampled first: they draft once caught up
        for s, e in sorted(zip(states, ends), key=lambda se: se[0].req_id not in sampled):
            take = min(e - s.draft_computed, budget)
            if take > 0:
                run.append((s, s.draft_computed + take))
                budget -= take
        if not run:
            return {}
        limits = {s.req_id: min(s.draft_limit, self.k, self.max_model_len - 1 - len(s.token_ids))
                  for s, e in run if s.req_id in sampled and e == len(s.token_ids)}
        want = [i for i, (s, _) in enumerate(run) if limits.get(s.req_id, 0) > 0]
        logits = self._run(runner, [s for s, _ in run], [s.draft_computed for s, _ in run],
                           [s.token_ids[s.draft_computed : e] for s, e in run], want)
        for s, e in run:
            s.draft_computed = e
        active = [run[i][0] for i in want]
        drafts: dict[str, list[int]] = {s.req_id: [] for s in active}
        qs: dict[str, list[torch.Tensor]] = {s.req_id: [] for s in active}
        while active:
            for s, row in zip(active, logits):
                position = len(s.token_ids) + len(drafts[s.req_id])
                d, q = self._draw(runner, s, row, position)
                drafts[s.req_id].append(d)
                if q is not None:
                    qs[s.req_id].append(q)
            active = [s for s in active if len(drafts[s.req_id]) < limits[s.req_id]]
            if active:  # feed the newest draft at its position
                logits = self._run(runner, active, [len(s.token_ids) + len(drafts[s.req_id]) - 1 for s in active],
                                   [[drafts[s.req_id][-1]] for s in active], list(range(len(active))))
        for s, _ in run:
            if s.req_id in drafts:
                s.draft_fed = len(drafts[s.req_id]) - 1  # the last draft is never fed
        return {rid: (d, torch.stack(qs[rid]) if qs[rid] else None) for rid, d in drafts.items()}

"""Chunked local attention (Llama 4's) as plain causal attention over a
"virtual batch", for kernels that take no chunks (FlashAttention-3,
FlashInfer), after vLLM's ``make_local_attention_virtual_batches``.

Under chunked local attention a token at position p attends to keys
``p - p % chunk .. p`` only. Each request's query tokens are split at the
chunk boundaries into virtual requests, one per chunk they touch; a
virtual request's keys are those of its chunk from the chunk's start up to
its last query token, so causal attention over it (prefix visible, causal
inside the query) is exactly the chunked attention of its tokens. Its block
table row is the request's from the chunk's first block (``attention_chunk``
is a multiple of the block size), so blocks before the chunk are never
named. The tokens keep their order: ``slot_mapping`` and the query, key,
value and output rows are the original batch's.

Example, chunk 4, one request with 3 computed tokens and 6 new ones
(positions 3..8): virtual requests of queries {3} over keys 0..3, {4..7}
over keys 4..7 and {8} over key 8.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from appliance.kernels.base import CommonAttentionMetadata


def virtual_batches(common: CommonAttentionMetadata) -> CommonAttentionMetadata:
    """``common`` as its virtual batch (no chunks left, causal attention over it is the chunked attention
    of the original), or ``common`` itself where it has no ``attention_chunk``. A request with no query
    tokens this step has no virtual request."""
    chunk, bs = common.attention_chunk, common.block_size
    if not chunk:
        return common
    if chunk % bs:
        raise ValueError(f"attention_chunk {chunk} is not a multiple of the block size {bs}")
    qsl = np.asarray(common.query_start_loc_cpu, dtype=np.int64)
    seq = np.asarray(common.seq_lens_cpu, dtype=np.int64)
    q_lens = qsl[1:] - qsl[:-1]
    computed = seq - q_lens
    first = computed // chunk  # the chunk of each request's first query token
    counts = np.where(q_lens > 0, (seq - 1) // chunk - first + 1, 0)  # virtual requests per request
    req = np.repeat(np.arange(common.num_reqs), counts)
    nth = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    start = (first[req] + nth) * chunk  # each virtual request's chunk start
    q_lo, q_hi = np.maximum(computed[req], start), np.minimum(seq[req], start + chunk)
    v_qsl = np.concatenate([[0], np.cumsum(q_hi - q_lo)])
    v_seq, v_computed = q_hi - start, q_lo - start
    dev = common.block_table.device
    return replace(
        common,
        query_start_loc=torch.from_numpy(v_qsl.astype(np.int32)).to(dev),
        seq_lens=torch.from_numpy(v_seq.astype(np.int32)).to(dev),
        num_computed_tokens=torch.from_numpy(v_computed.astype(np.int32)).to(dev),
        block_table=_shifted_rows(common.block_table, req, start // bs, -(-int(v_seq.max(initial=0)) // bs)),
        num_reqs=len(req),
        max_query_len=int((q_hi - q_lo).max(initial=0)),
        max_seq_len=int(v_seq.max(initial=0)),
        query_start_loc_cpu=v_qsl.tolist(),
        seq_lens_cpu=v_seq.tolist(),
        attention_chunk=None,
    )


def _shifted_rows(block_table: torch.Tensor, rows: np.ndarray, shift: np.ndarray, width: int) -> torch.Tensor:
    """[len(rows), max(width, 1)]: row i is ``block_table[rows[i]]`` from column ``shift[i]`` on, 0 (the null
    block) past its end."""
    dev = block_table.device
    cols = torch.from_numpy(shift).view(-1, 1) + torch.arange(max(width, 1)).view(1, -1)
    inside = cols < block_table.shape[1]
    picked = block_table[torch.from_numpy(rows).to(dev).view(-1, 1), cols.clamp(max=block_table.shape[1] - 1).to(dev)]
    return torch.where(inside.to(dev), picked, torch.zeros((), dtype=block_table.dtype, device=dev)).contiguous()

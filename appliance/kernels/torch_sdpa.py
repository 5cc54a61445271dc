"""torch SDPA over the paged KV cache: the CPU backend and the numerics
reference every other backend is tested against.

Decodes (query length 1) are batched into one SDPA call over their padded
contexts; prefill chunks run one SDPA call each, causal inside the chunk
with the already-computed prefix fully visible. A sliding window or a chunk
of chunked local attention masks the keys further, and the blocks wholly
before the first key a query reads are not gathered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from appliance.kernels.base import AttentionBackend, CommonAttentionMetadata


def first_key(position: int, window: Optional[int], chunk: Optional[int]) -> int:
    """The first key position a query at ``position`` attends: its window's (``window`` positions ending at
    it), its chunk's (the multiple of ``chunk`` at or before it), or 0 (None: neither)."""
    first = max(0, position - window + 1) if window else 0
    return max(first, position // chunk * chunk) if chunk else first


@dataclass
class SDPAMetadata:
    common: CommonAttentionMetadata
    decode_reqs: torch.Tensor  # request indices with query length 1
    decode_tokens: torch.Tensor  # their token indices in the flattened batch
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_ctx] True = attend
    decode_bt: torch.Tensor | None
    prefill_reqs: list[int]


class TorchSDPABackend(AttentionBackend):
    name = "torch_sdpa"
    kv_dtypes = {"bfloat16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}

    def build_metadata(self, common: CommonAttentionMetadata) -> SDPAMetadata:
        qsl = common.query_start_loc_cpu
        seq_lens = common.seq_lens_cpu
        decode: list[int] = []
        prefill: list[int] = []
        for i in range(common.num_reqs):
            (decode if qsl[i + 1] - qsl[i] == 1 else prefill).append(i)
        decode_mask = decode_bt = None
        dev = common.block_table.device
        decode_reqs = torch.tensor(decode, dtype=torch.long).to(dev)
        decode_tokens = torch.tensor([qsl[i] for i in decode], dtype=torch.long).to(dev)
        if decode:
            bs, window, chunk = common.block_size, common.sliding_window, common.attention_chunk
            # each decode's blocks from the first its window or chunk reaches (all: full attention)
            first = [first_key(seq_lens[i] - 1, window, chunk) // bs for i in decode]
            nblocks = max(-(-seq_lens[i] // bs) - f for i, f in zip(decode, first))
            first_t = torch.tensor(first, dtype=torch.long).to(dev).view(-1, 1)
            cols = (first_t + torch.arange(nblocks, device=dev).view(1, -1)).clamp_(max=common.block_table.shape[1] - 1)
            decode_bt = common.block_table[decode_reqs.view(-1, 1), cols].long()
            lens = common.seq_lens[decode_reqs].view(-1, 1).long()
            positions = first_t * bs + torch.arange(nblocks * bs, device=dev).view(1, -1)  # of the gathered keys
            visible = positions < lens
            if window:
                visible &= positions >= lens - window
            if chunk:  # the decode's own chunk: from the start of the chunk of its position lens - 1
                visible &= positions >= (lens - 1) // chunk * chunk
            decode_mask = visible.view(len(decode), 1, 1, -1)
        return SDPAMetadata(common, decode_reqs, decode_tokens, decode_mask, decode_bt, prefill)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Attention of q [..., H, Lq, D] over k, v [..., KVH, Lk, D] where ``mask`` (True: attend) allows:
        SDPA, or, with soft-capped scores or attention sinks (a column of each head's sink logit beside
        the scores, no value), the same by hand (scores and softmax in fp32)."""
        if not self.soft_cap and sinks is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale,
                                                  enable_gqa=self.num_heads != self.num_kv_heads)
        group = self.num_heads // self.num_kv_heads
        if group > 1:
            k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
        s = (q.float() @ k.float().transpose(-1, -2)) * self.scale
        if self.soft_cap:
            s = torch.tanh(s / self.soft_cap) * self.soft_cap
        s = s.masked_fill(~mask, float("-inf"))
        if sinks is None:
            return (torch.softmax(s, dim=-1) @ v.float()).to(q.dtype)
        column = sinks.float().view(-1, 1, 1).expand(*s.shape[:-1], 1)
        p = torch.softmax(torch.cat([s, column], dim=-1), dim=-1)[..., :-1]
        return (p @ v.float()).to(q.dtype)

    def forward(self, q, k, v, kv_cache, md: SDPAMetadata, sinks=None):
        c = md.common
        self.write_kv(k, v, kv_cache, c.slot_mapping)
        out = torch.empty_like(q)
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        bs = c.block_size
        gqa = self.num_heads != self.num_kv_heads
        if md.decode_bt is not None:
            assert md.decode_mask is not None  # made with the block table
            n = md.decode_bt.shape[0]
            kv = kv_cache[:, md.decode_bt]  # one gather for K and V: [2, n, blocks, block_size, kvh, d]
            kk = kv[0].view(n, -1, self.num_kv_heads, self.head_dim).transpose(1, 2)
            vv = kv[1].view(n, -1, self.num_kv_heads, self.head_dim).transpose(1, 2)
            qq = q[md.decode_tokens].unsqueeze(2)  # [n, H, 1, D]
            o = self._attend(qq, self.read_kv(kk, q.dtype, self.k_scale), self.read_kv(vv, q.dtype, self.v_scale),
                             md.decode_mask, sinks)
            out[md.decode_tokens] = o.squeeze(2)
        qsl, seq_lens, window, chunk = c.query_start_loc_cpu, c.seq_lens_cpu, c.sliding_window, c.attention_chunk
        for i in md.prefill_reqs:
            start, end = qsl[i], qsl[i + 1]
            q_len, ctx = end - start, seq_lens[i]
            qq = q[start:end].transpose(0, 1)  # [H, q_len, D]
            prefix = ctx - q_len
            queries = prefix + torch.arange(q_len, device=q.device)
            if prefix == 0:
                # A fresh prompt attends only to its own chunk: use this step's K/V, no cache gather
                # (rounded as the cache stores them, so every step attends the same values).
                kk = self.as_cached(k[start:end], kv_cache.dtype, self.k_scale).transpose(0, 1)
                vv = self.as_cached(v[start:end], kv_cache.dtype, self.v_scale).transpose(0, 1)
                keys = queries
            else:  # from the first block its first query's window or chunk reaches (all: full attention)
                first = first_key(prefix, window, chunk) // bs
                bt = c.block_table[i, first : -(-ctx // bs)].long()
                kk = key_cache[bt].reshape(-1, self.num_kv_heads, self.head_dim)[: ctx - first * bs].transpose(0, 1)
                vv = value_cache[bt].reshape(-1, self.num_kv_heads, self.head_dim)[: ctx - first * bs].transpose(0, 1)
                kk, vv = self.read_kv(kk, q.dtype, self.k_scale), self.read_kv(vv, q.dtype, self.v_scale)
                keys = torch.arange(first * bs, ctx, device=q.device)
            if prefix == 0 and not window and not chunk and not self.soft_cap and sinks is None:
                o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=self.scale, enable_gqa=gqa)
            else:
                mask = keys.view(1, -1) <= queries.view(-1, 1)
                if window:
                    mask &= keys.view(1, -1) > queries.view(-1, 1) - window
                if chunk:  # each query's own chunk
                    mask &= keys.view(1, -1) >= queries.view(-1, 1) // chunk * chunk
                o = self._attend(qq, kk, vv, mask, sinks)
            out[start:end] = o.transpose(0, 1)
        return out

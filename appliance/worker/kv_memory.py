"""The memory a KV cache tensor lives in."""

from __future__ import annotations

import math
import mmap
from typing import Any, Sequence

import torch


def zeroed_kv_cache(shape: tuple[int, ...], dtype: torch.dtype, device: Any) -> torch.Tensor:
    """A zero-filled KV cache tensor. On the host it is private anonymous
    memory, which the kernel zero-fills a page at a time on first touch: start-up
    writes none of the cache budget, and resident memory grows with the blocks
    used. On a GPU, torch.zeros."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)  # the tensor keeps buf mapped


def copy_kv_blocks(caches: Sequence[torch.Tensor], copies: Sequence[tuple[int, int]]) -> None:
    """Copy each (src, dst) block's K and V in every cache tensor (the backends' layout, ``[2, blocks, ...]``;
    a tensor that several layers share is copied once): the forks of beam search, before a step writes."""
    device = caches[0].device  # one rank's caches share it
    src = torch.tensor([s for s, _ in copies], dtype=torch.int64, device=device)
    dst = torch.tensor([d for _, d in copies], dtype=torch.int64, device=device)
    for cache in {id(c): c for c in caches}.values():
        cache[:, dst] = cache[:, src]

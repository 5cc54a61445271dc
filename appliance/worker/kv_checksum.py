"""The checksum KV bytes carry wherever they leave the block pool (an offload
tier's files, a producer's blocks sent to or read by a consumer), checked
before they enter a cache, so flipped, swapped or zeroed KV is a miss
(recomputed), never wrong tokens.

``kv_digest`` is the SHA-256 of some bytes (a tier file's payload). Blocks
moving between engines are checked per layer (``layers_digest``: the
SHA-256 of each layer's K and V bytes, hashed on a pool of threads, then
the SHA-256 of those in layer order), so a producer and a consumer get the
same digest whether the blocks were gathered into one message (p2p) or are
gathered layer by layer where they lie (NIXL), and the hashing and the
check for NaN and infinity (``layers_problem``) run on every core.
``gather_blocks`` lays blocks out as those bytes; ``dtype_name`` is how
the connectors' headers name a cache dtype."""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, Callable, Optional, Sequence, Union, cast

import torch

Buffer = Union[bytes, bytearray, memoryview]
Layer = Callable[[], torch.Tensor]  # makes one layer's K and V bytes (uint8, contiguous), on any device

_pool: Optional[ThreadPoolExecutor] = None


def _threads() -> ThreadPoolExecutor:
    """The digest threads (SHA-256 and torch's reductions release the GIL), made at first use."""
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1)), thread_name_prefix="kv-digest")
    return _pool


def _host_bytes(data: torch.Tensor) -> memoryview:
    if not data.is_contiguous():
        raise ValueError("KV bytes are hashed from a contiguous tensor")
    return memoryview(cast(Any, data.detach().cpu().view(torch.uint8).reshape(-1).numpy()))


def kv_digest(data: Union[torch.Tensor, Buffer]) -> str:
    """The hex SHA-256 of ``data``'s bytes (a tensor's, in memory order: a
    contiguous tensor, on the host or copied there)."""
    if isinstance(data, torch.Tensor):
        data = _host_bytes(data)
    return hashlib.sha256(data).hexdigest()


def has_nonfinite(data: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether KV bytes (``data``, uint8 with the last dim a whole number of
    ``dtype`` elements) hold a NaN or an infinity as ``dtype`` reads them."""
    if dtype == torch.float8_e4m3fn:  # no infinities; NaN is S.1111.111
        return bool(((data & 0x7F) == 0x7F).any())
    if dtype == torch.float8_e5m2:  # an all-ones exponent: infinity or NaN
        return bool(((data & 0x7C) == 0x7C).any())
    if dtype in (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz):  # no infinities; NaN is 0x80
        return bool((data == 0x80).any())
    low, high = torch.aminmax(data.view(dtype))  # one pass; a NaN makes both NaN, an infinity shows at an end
    return not (bool(torch.isfinite(low)) and bool(torch.isfinite(high)))


def _hash_layer(layer: Layer, dtype: Optional[torch.dtype]) -> tuple[bytes, bool]:
    data = layer()
    return hashlib.sha256(_host_bytes(data)).digest(), dtype is not None and has_nonfinite(data, dtype)


def _layers(layers: Sequence[Layer], dtype: Optional[torch.dtype]) -> tuple[str, bool]:
    results = list(_threads().map(lambda layer: _hash_layer(layer, dtype), layers))
    digest = hashlib.sha256(len(results).to_bytes(8, "big") + b"".join(d for d, _ in results)).hexdigest()
    return digest, any(bad for _, bad in results)


def layers_digest(layers: Sequence[Layer]) -> str:
    """The digest of KV blocks given as each layer's K and V bytes, in layer
    order (see the module docstring)."""
    return _layers(layers, None)[0]


def layers_problem(layers: Sequence[Layer], dtype: torch.dtype, checksum: object) -> Optional[str]:
    """Why KV blocks that arrived (``layers`` as ``layers_digest`` takes
    them) may not enter a cache, or None: they must match the ``checksum``
    their sender computed and hold only finite values as ``dtype`` reads them."""
    digest, nonfinite = _layers(layers, dtype)
    if not isinstance(checksum, str) or digest != checksum:
        return "blocks that do not match their checksum"
    if nonfinite:
        return "blocks holding NaN or infinite values"
    return None


def gathered_layers(data: torch.Tensor) -> list[Layer]:
    """The layers of blocks gathered into one tensor, ``[layers, 2, blocks, ...]`` uint8."""
    return [partial(data.__getitem__, layer) for layer in range(data.shape[0])]


def cached_layers(caches: list[torch.Tensor], block_ids: list[int]) -> list[Layer]:
    """The layers of blocks where they lie: each layer's K and V of
    ``block_ids`` (in that order) gathered as bytes when hashed."""
    ids = torch.tensor(block_ids, dtype=torch.long, device=caches[0].device)
    return [partial(_blocks_of, c, ids) for c in caches]


def _blocks_of(cache: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return cache.view(torch.uint8).index_select(1, ids)


def dtype_name(dtype: torch.dtype) -> str:
    """A cache dtype as the connectors' headers name it (``bfloat16``, ``float8_e4m3fn``)."""
    return str(dtype).removeprefix("torch.")


def gather_blocks(caches: list[torch.Tensor], block_ids: list[int]) -> torch.Tensor:
    """The blocks' K and V of every layer as host bytes, ``[layers, 2,
    blocks, ..., last dim x element size]`` uint8, in ``block_ids`` order:
    what a producer sends and what a checksum covers."""
    like = caches[0]
    ids = torch.tensor(block_ids, dtype=torch.long, device=like.device)
    shape = [len(caches), like.shape[0], len(block_ids), *like.shape[2:]]
    data = torch.empty((*shape[:-1], shape[-1] * like.element_size()), dtype=torch.uint8)
    for layer, c in enumerate(caches):  # one copy into the host buffer, as bytes
        raw = c.view(torch.uint8)  # any cache dtype (CPU kernels lack fp8 indexing)
        if c.device.type == "cpu":
            torch.index_select(raw, 1, ids, out=data[layer])
        else:
            data[layer].copy_(raw.index_select(1, ids))
    return data

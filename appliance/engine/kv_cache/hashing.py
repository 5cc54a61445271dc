"""Chained prefix hashes of full KV blocks (torch-free).

A block's hash covers (parent block hash, the block's token ids, extra keys),
so equal hashes mean equal whole prefixes. Extra keys carry what makes equal
tokens produce different KV: the request's ``cache_salt`` (first block only,
which isolates the whole chain; so does a LongRoPE sequence past the model's
original context, whose every position takes the long frequencies), its
LoRA id, and the content hashes of multimodal inputs overlapping the block.
Only full blocks are hashed; the trailing partial block never is.

Algorithms (``cache.prefix_caching_hash_algo``), as vLLM's:
- ``sha256``: pickle of the tuple, SHA-256 (collision resistant; pickle
  bytes may change across Python versions);
- ``sha256_cbor``: canonical CBOR of the tuple, SHA-256 (reproducible across
  processes, versions and languages);
- ``builtin``: Python ``hash()`` (fast; randomized per process).
"""

from __future__ import annotations

import hashlib
import pickle
import struct
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

if TYPE_CHECKING:
    from appliance.engine.request import Request

BlockHash = Any  # bytes for sha256*, int for builtin

HashFn = Callable[[tuple], BlockHash]


def _cbor(obj: object, out: bytearray) -> None:
    """Canonical CBOR (RFC 8949 §4.2.1) of ints, bytes, str, None, bools, tuples/lists."""

    def head(major: int, n: int) -> None:
        if n < 24:
            out.append((major << 5) | n)
        elif n < 1 << 8:
            out.extend((major << 5 | 24, n))
        elif n < 1 << 16:
            out.append(major << 5 | 25)
            out.extend(struct.pack(">H", n))
        elif n < 1 << 32:
            out.append(major << 5 | 26)
            out.extend(struct.pack(">I", n))
        else:
            out.append(major << 5 | 27)
            out.extend(struct.pack(">Q", n))

    if obj is None:
        out.append(0xF6)
    elif obj is True:
        out.append(0xF5)
    elif obj is False:
        out.append(0xF4)
    elif isinstance(obj, int):
        if obj >= 0:
            if obj >= 1 << 64:
                raise ValueError("integer too large for canonical CBOR")
            head(0, obj)
        else:
            head(1, -1 - obj)
    elif isinstance(obj, (bytes, bytearray)):
        head(2, len(obj))
        out.extend(obj)
    elif isinstance(obj, str):
        data = obj.encode()
        head(3, len(data))
        out.extend(data)
    elif isinstance(obj, (tuple, list)):
        head(4, len(obj))
        for item in obj:
            _cbor(item, out)
    else:
        raise TypeError(f"cannot CBOR-encode {type(obj).__name__}")


def cbor_dumps(obj: object) -> bytes:
    out = bytearray()
    _cbor(obj, out)
    return bytes(out)


def sha256_pickle(obj: tuple) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def sha256_cbor(obj: tuple) -> bytes:
    return hashlib.sha256(cbor_dumps(obj)).digest()


HASH_FUNCTIONS: dict[str, HashFn] = {"sha256": sha256_pickle, "sha256_cbor": sha256_cbor, "builtin": hash}


def get_hash_fn(algo: str) -> HashFn:
    try:
        return HASH_FUNCTIONS[algo]
    except KeyError:
        raise ValueError(f"unknown prefix hash algorithm {algo!r}; use one of {sorted(HASH_FUNCTIONS)}") from None


def hash_block_tokens(
    hash_fn: HashFn, parent: Optional[BlockHash], token_ids: Sequence[int], extra_keys: Optional[tuple] = None
) -> BlockHash:
    return hash_fn((parent, tuple(token_ids), extra_keys))


def block_extra_keys(request: Request, block_index: int, block_size: int) -> Optional[tuple]:
    """Extra keys of one block of ``request``, or None when it has none."""
    keys: list[Any] = []
    start, end = block_index * block_size, (block_index + 1) * block_size
    for offset, length, mm_hash in request.mm_hashes:
        if offset < end and offset + length > start:
            keys.append(mm_hash)
    if request.lora_id is not None:
        keys.append(("lora", request.lora_id))
    if block_index == 0 and request.cache_salt is not None:
        keys.append(("salt", request.cache_salt))
    if block_index == 0 and request.long_rope:
        keys.append(("rope", "long"))
    return tuple(keys) if keys else None


def update_block_hashes(request: Request, block_size: int, hash_fn: HashFn) -> list[BlockHash]:
    """Extend ``request.block_hashes`` to cover every full block of its tokens."""
    hashes = request.block_hashes
    tokens = request.all_token_ids
    num_full = len(tokens) // block_size
    parent = hashes[-1] if hashes else None
    for i in range(len(hashes), num_full):
        block = tokens[i * block_size : (i + 1) * block_size]
        parent = hash_block_tokens(hash_fn, parent, block, block_extra_keys(request, i, block_size))
        hashes.append(parent)
    return hashes

"""A GGUF file's header, read without touching its tensors: the metadata,
each tensor's type, shape and offset (``read_gguf_layout``, cached by
file identity in ``gguf_header``), and what its quantized projections and
LM head load as (bits per weight; whether the embedding doubles as the
head). Torch-free."""

from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Optional


_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    ggml_type: int
    dims: tuple[int, ...]  # ggml's order: the fastest-varying dimension first
    offset: int  # from the start of the file's data section


def read_gguf_layout(path: Path) -> tuple[dict[str, Any], list[GGUFTensorInfo], int]:
    """A GGUF file's metadata (an array is given as its length), its tensors'
    infos in file order, and where its data section starts."""

    def unpack(f: BinaryIO, fmt: str) -> Any:
        s = struct.Struct(fmt)
        return s.unpack(f.read(s.size))[0]

    def string(f: BinaryIO) -> str:
        n = unpack(f, "<Q")
        if n > 1 << 24:
            raise ValueError(f"a string of {n} bytes: the file is damaged")
        return f.read(n).decode("utf-8", "replace")

    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError("not a GGUF file")
        version = unpack(f, "<I")
        if version < 2:
            raise ValueError(f"GGUF version {version} is not supported")
        n_tensors, n_kv = unpack(f, "<Q"), unpack(f, "<Q")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key, vtype = string(f), unpack(f, "<I")
            if vtype == _GGUF_ARRAY:
                etype, count = unpack(f, "<I"), unpack(f, "<Q")
                if etype == _GGUF_STRING:
                    for _ in range(count):
                        f.seek(unpack(f, "<Q"), 1)
                elif etype in _GGUF_SCALARS:
                    f.seek(count * struct.calcsize(_GGUF_SCALARS[etype]), 1)
                else:
                    raise ValueError(f"{key}: arrays of GGUF type {etype} are not supported")
                meta[key] = count
            elif vtype == _GGUF_STRING:
                meta[key] = string(f)
            elif vtype in _GGUF_SCALARS:
                meta[key] = unpack(f, _GGUF_SCALARS[vtype])
            else:
                raise ValueError(f"{key}: unknown GGUF value type {vtype}")
        tensors = []
        for _ in range(n_tensors):
            name = string(f)
            dims = tuple(unpack(f, "<Q") for _ in range(unpack(f, "<I")))
            ggml_type = unpack(f, "<I")
            tensors.append(GGUFTensorInfo(name, ggml_type, dims, unpack(f, "<Q")))
        align = int(meta.get("general.alignment", 32))
        if align <= 0 or align & (align - 1):
            raise ValueError(f"general.alignment={align} must be a power of two")
        start = -(-f.tell() // align) * align
    return meta, tensors, start


def read_gguf_header(path: Path) -> tuple[dict[str, Any], dict[str, tuple[int, int]]]:
    """Metadata (an array is given as its length) and, by tensor name, each
    tensor's ggml type id and element count, of a GGUF file."""
    meta, tensors, _ = read_gguf_layout(path)
    return meta, {t.name: (t.ggml_type, math.prod(t.dims)) for t in tensors}


def gguf_header(path: Path) -> tuple[dict[str, Any], dict[str, tuple[int, int]]]:
    """``read_gguf_header``, read once per file version: resolving a GGUF
    deployment needs it twice (architecture facts, then the loaded widths)."""
    st = path.stat()
    return _cached_header(str(path.resolve()), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=8)
def _cached_header(path: str, mtime_ns: int, size: int) -> tuple[dict[str, Any], dict[str, tuple[int, int]]]:
    return read_gguf_header(Path(path))


# The GGUF block types quantization=gguf keeps, by ggml type id: int4 with fp16 parameters per 32 (Q4_0,
# Q4_1) or fp32 ones (Q4_K), grouped int8 with fp32 parameters per 32 (Q8_0, Q5_K) or per 16 (Q6_K).
GGUF_INT4_TYPES = {2: "fp16", 3: "fp16", 12: "fp32"}
GGUF_INT8_GROUP = {8: 32, 13: 32, 14: 16}
GGUF_FUSED = (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"), ("attn_output",), ("ffn_down",),
              ("ffn_gate_exps", "ffn_up_exps"), ("ffn_down_exps",))


def _loaded_bits(kinds: list[int]) -> Optional[float]:
    """Bits a weight of one fused projection takes once loaded (parameters
    included): int4 at 5 (fp16 scale and min per 32) or 6 (fp32); where any
    part is 8-bit, every part as int8 with fp32 parameters at the finest
    group (``quant.install_int4``). None for a type not kept."""
    if any(k not in GGUF_INT4_TYPES and k not in GGUF_INT8_GROUP for k in kinds):
        return None
    if any(k in GGUF_INT8_GROUP for k in kinds):
        return 8 + 64 / min(GGUF_INT8_GROUP.get(k, 32) for k in kinds)
    return 6.0 if any(GGUF_INT4_TYPES[k] == "fp32" for k in kinds) else 5.0


def gguf_projection_bits(tensors: dict[str, tuple[int, int]]) -> Optional[float]:
    """Loaded bits per projection weight over a GGUF file's decoder
    projections, each fused projection (q|k|v, gate|up) as the loader builds
    it; None when one has a type quantization=gguf does not keep (loading
    then names it)."""
    layers: dict[str, dict[str, tuple[int, int]]] = {}
    for name, value in tensors.items():
        parts = name.split(".")
        if parts[0] == "blk" and len(parts) == 4 and parts[3] == "weight":
            layers.setdefault(parts[1], {})[parts[2]] = value
    total = bits = 0.0
    for layer in layers.values():
        for fused in GGUF_FUSED:
            present = [layer[p] for p in fused if p in layer]
            if not present:
                continue
            b = _loaded_bits([kind for kind, _ in present])
            if b is None:
                return None
            count = sum(c for _, c in present)
            total, bits = total + count, bits + count * b
    return round(bits / total, 3) if total else None


def gguf_head_bits(tensors: dict[str, tuple[int, int]]) -> Optional[float]:
    """Loaded bits per weight of a GGUF file's LM head under quantization=gguf
    (``output.weight``, or a tied model's ``token_embd.weight``, whose
    blocks the head runs while lookups read it dequantized); None when its
    type is not kept (it runs in the model dtype)."""
    head = tensors.get("output.weight") or tensors.get("token_embd.weight")
    return _loaded_bits([head[0]]) if head is not None else None


def gguf_embedding_in_head(tensors: dict[str, tuple[int, int]]) -> bool:
    """Whether a GGUF file's embedding is tied to its head as grouped int8 blocks (Q8_0, Q5_K, Q6_K), which
    quantization=gguf holds once: the head runs them and lookups read them (``gguf_blocks.TiedBlockEmbedding``;
    on one rank, the layout the loader does it for)."""
    embed = tensors.get("token_embd.weight")
    return "output.weight" not in tensors and embed is not None and embed[0] in GGUF_INT8_GROUP

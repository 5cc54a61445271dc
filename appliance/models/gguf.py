"""GGUF checkpoints: dequantize llama.cpp block quants and convert a GGUF
file into a Hugging Face style folder (config.json, safetensors, tokenizer).

Block layouts (32 weights a block, little endian):
    Q4_0: f16 d, 16 bytes of nibbles          x = d * (q - 8)
    Q4_1: f16 d, f16 m, 16 bytes of nibbles   x = d * q + m
    Q8_0: f16 d, 32 x int8                    x = d * q
Nibbles: byte j holds weight j (low 4 bits) and weight j + 16 (high 4 bits).
K-quants (super-blocks of 256; see dequant_q4_k, _q5_k, _q6_k):
    Q4_K: f16 d, f16 dmin, 8 x 6-bit (sc, m), nibbles   x = d sc q - dmin m per 32
    Q5_K: as Q4_K plus a fifth bit per weight
    Q6_K: 6-bit q in nibbles + bit pairs, 16 x int8 sc, f16 d   x = d sc (q - 32) per 16
llama.cpp stores a llama-architecture file's Q and K projections with
their rotary halves interleaved (its converter permutes them; Qwen's it
does not); ``unpermute`` restores Hugging Face's order. A Qwen3-MoE file
(``qwen3moe``) stacks each layer's experts in one tensor per projection
(``ffn_gate_exps`` [experts, moe_ff, hidden], ``ffn_up_exps``,
``ffn_down_exps`` [experts, hidden, moe_ff]) beside its router
(``ffn_gate_inp``); the converter writes them per expert, as Hugging Face
names them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from appliance.config.architectures import ARCHITECTURES, by_gguf, gguf_names
from appliance.config.gguf_header import read_gguf_layout

QK = 32
# in the converted folders' cache key: 2 keeps a Qwen file's Q and K rows as stored, and converts qwen3moe
CONVERTER_VERSION = 2


def _blocks(raw: np.ndarray, block_bytes: int) -> np.ndarray:
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    if raw.size % block_bytes:
        raise ValueError(f"tensor of {raw.size} bytes is not a whole number of {block_bytes}-byte blocks")
    return raw.reshape(-1, block_bytes)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)


def dequant_q4_0(raw: np.ndarray) -> np.ndarray:
    b = _blocks(raw, 2 + QK // 2)
    d = b[:, :2].copy().view(np.float16).astype(np.float32)
    return (d * (_nibbles(b[:, 2:]) - 8.0)).reshape(-1)


def dequant_q4_1(raw: np.ndarray) -> np.ndarray:
    b = _blocks(raw, 4 + QK // 2)
    d = b[:, :2].copy().view(np.float16).astype(np.float32)
    m = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    return (d * _nibbles(b[:, 4:]) + m).reshape(-1)


def dequant_q8_0(raw: np.ndarray) -> np.ndarray:
    b = _blocks(raw, 2 + QK)
    d = b[:, :2].copy().view(np.float16).astype(np.float32)
    q = b[:, 2:].copy().view(np.int8).astype(np.float32)
    return (d * q).reshape(-1)


QK_K = 256  # weights per K-quant super-block


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of 6-bit sub-block scales and mins -> two
    [blocks, 8] arrays. Sub-blocks 0-3 keep six bits in bytes 0-3 (scales)
    and 4-7 (mins); sub-blocks 4-7 take their low four bits from bytes 8-11
    (scale low nibble, min high nibble) and their top two from the top two
    bits of bytes 0-3 (scales) and 4-7 (mins)."""
    lo, hi, mix = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([lo & 0x3F, (mix & 0x0F) | ((lo >> 6) << 4)], axis=1)
    mn = np.concatenate([hi & 0x3F, (mix >> 4) | ((hi >> 6) << 4)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_low_high(qs: np.ndarray) -> np.ndarray:
    """K-quant nibbles: each 32 bytes hold 64 weights, the low nibbles first
    and then the high ones -> [blocks, QK_K] values 0..15."""
    q = qs.reshape(qs.shape[0], -1, 1, 32)
    return np.concatenate([q & 0x0F, q >> 4], axis=2).reshape(qs.shape[0], QK_K)


def _q4_k_parts(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K super-blocks (fp16 d, fp16 dmin, 12 bytes of scales, 128 bytes of
    nibbles) -> (q [blocks, 256], sub-block scale d * sc and min -dmin * m,
    fp32 [blocks, 8]): weight = scale * q + min, each product exact in fp32."""
    b = _blocks(raw, 4 + 12 + QK_K // 2)
    d = b[:, :2].copy().view(np.float16).astype(np.float32)
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = _k_scales(b[:, 4:16])
    return _k_low_high(b[:, 16:]), d * sc, -(dmin * mn)


def _q5_k_parts(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q5_K: Q4_K's layout plus 32 bytes of fifth bits (bit i of byte l: weight
    l of sub-block i) -> (q 0..31 [blocks, 256], scale, min [blocks, 8])."""
    b = _blocks(raw, 4 + 12 + QK_K // 8 + QK_K // 2)
    d = b[:, :2].copy().view(np.float16).astype(np.float32)
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = _k_scales(b[:, 4:16])
    fifth = (b[:, 16:48][:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # [blocks, 8, 32]
    q = _k_low_high(b[:, 48:]).reshape(-1, 8, 32) + (fifth << 4)
    return q.reshape(-1, QK_K), d * sc, -(dmin * mn)


def _q6_k_parts(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q6_K: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales
    (one per 16 weights), fp16 d -> (q - 32 [blocks, 256], d * scale, zero
    mins [blocks, 16]). Weight l of 32-chunk j of half h takes the low or
    high nibble of byte l (+32 for j odd) and bit pair j of qh byte l."""
    b = _blocks(raw, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2)
    ql, qh = b[:, :128].reshape(-1, 2, 64), b[:, 128:192].reshape(-1, 2, 32)
    scales = b[:, 192:208].copy().view(np.int8).astype(np.float32)
    d = b[:, 208:210].copy().view(np.float16).astype(np.float32)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2)  # [blocks, 2 halves, 128]: l, l + 32, then l + 64, l + 96
    high = (qh[:, :, None, :] >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]) & 3  # [.., 4, 32]
    q = (low.reshape(-1, 2, 4, 32) | (high << 4)).astype(np.int16) - 32
    return q.reshape(-1, QK_K), d * scales, np.zeros_like(scales)


def _q8_0_parts(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    b = _blocks(raw, 2 + QK)
    d = b[:, :2].copy().view(np.float16).astype(np.float32)
    return b[:, 2:].copy().view(np.int8), d, np.zeros_like(d)


def _from_parts(parts: tuple[np.ndarray, np.ndarray, np.ndarray]) -> np.ndarray:
    """scale * q + min per sub-block, flattened."""
    q, scale, mn = parts
    sub = q.reshape(q.shape[0], scale.shape[1], -1).astype(np.float32)
    return (scale[..., None] * sub + mn[..., None]).reshape(-1)


def dequant_q4_k(raw: np.ndarray) -> np.ndarray:
    return _from_parts(_q4_k_parts(raw))


def dequant_q5_k(raw: np.ndarray) -> np.ndarray:
    return _from_parts(_q5_k_parts(raw))


def dequant_q6_k(raw: np.ndarray) -> np.ndarray:
    return _from_parts(_q6_k_parts(raw))


def _plain(dtype) -> Callable[[np.ndarray], np.ndarray]:
    return lambda raw: np.ascontiguousarray(raw).view(dtype).astype(np.float32).reshape(-1)


def _bf16(raw: np.ndarray) -> np.ndarray:
    u16 = np.ascontiguousarray(raw).view(np.uint16).reshape(-1)
    return (u16.astype(np.uint32) << 16).view(np.float32)


DEQUANT: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "F32": _plain(np.float32),
    "F16": _plain(np.float16),
    "BF16": _bf16,
    "Q4_0": dequant_q4_0,
    "Q4_1": dequant_q4_1,
    "Q8_0": dequant_q8_0,
    "Q4_K": dequant_q4_k,
    "Q5_K": dequant_q5_k,
    "Q6_K": dequant_q6_k,
}


def dequantize(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Dequantize one tensor to float32 in Hugging Face (row-major) shape."""
    fn = DEQUANT.get(type_name)
    if fn is None:
        raise ValueError(f"GGUF tensor type {type_name} is not supported; supported: {sorted(DEQUANT)}")
    return fn(raw).reshape(shape)


INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")  # block types that are int4 panels as they are (quantization=gguf)


def int4_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_0, Q4_1 or Q4_K tensor as (q uint8 [n, k] in 0..15, d [n, k / 32],
    m [n, k / 32]) with weight = d * q + m, exactly the block formula:
    Q4_1 stores d and m (fp16); Q4_0's d * (q - 8) is m = -8 d (a power of
    two times an fp16, exact in fp16); Q4_K's sub-blocks of 32 have scale
    d * sc and min -dmin * m (fp32, where those products are exact)."""
    n, k = shape
    if type_name == "Q4_K":
        q, scale, mn = _q4_k_parts(raw)
        return q.reshape(n, k).astype(np.uint8), scale.reshape(n, k // QK), mn.reshape(n, k // QK)
    if type_name == "Q4_1":
        b = _blocks(raw, 4 + QK // 2)
        d = b[:, :2].copy().view(np.float16)
        m = b[:, 2:4].copy().view(np.float16)
        qs = b[:, 4:]
    elif type_name == "Q4_0":
        b = _blocks(raw, 2 + QK // 2)
        d = b[:, :2].copy().view(np.float16)
        with np.errstate(over="raise"):
            m = d * np.float16(-8)
        qs = b[:, 2:]
    else:
        raise ValueError(f"GGUF tensor type {type_name} is not a 4-bit block type ({', '.join(INT4_TYPES)})")
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1)
    return q.reshape(n, k), d.reshape(n, k // QK), m.reshape(n, k // QK)


INT8_TYPES = ("Q8_0", "Q5_K", "Q6_K")  # block types kept as grouped int8 (quantization=gguf)
KEPT_TYPES = INT4_TYPES + INT8_TYPES


def int8_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q8_0, Q5_K or Q6_K tensor as (q int8 [n, k], d fp32, m fp32 [n, k / group])
    with weight = d * q + m exactly as the block formula computes it: Q8_0
    d * q (groups of 32, m = 0); Q5_K (d sc) q - dmin m (32); Q6_K
    (d sc) (q - 32) with q - 32 stored (groups of 16, m = 0)."""
    parts = {"Q8_0": _q8_0_parts, "Q5_K": _q5_k_parts, "Q6_K": _q6_k_parts}.get(type_name)
    if parts is None:
        raise ValueError(f"GGUF tensor type {type_name} is not an 8-bit-or-narrower block type ({', '.join(INT8_TYPES)})")
    q, scale, mn = parts(raw)
    n, k = shape
    groups = scale.size // n
    return q.reshape(n, k).astype(np.int8), scale.reshape(n, groups), mn.reshape(n, groups)


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


NAME_MAP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_MAP = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate_inp": "mlp.gate",  # a sparse layer's router
}
EXPERT_MAP = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}


def expert_tensor(gguf_name: str) -> Optional[tuple[int, str]]:
    """(layer, projection) of a stacked experts tensor (``blk.N.ffn_gate_exps.weight``), else None."""
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in EXPERT_MAP and parts[3] == "weight":
        return int(parts[1]), EXPERT_MAP[parts[2]]
    return None


def hf_name(gguf_name: str) -> str:
    if gguf_name in NAME_MAP:
        return NAME_MAP[gguf_name]
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in LAYER_MAP:
        return f"model.layers.{parts[1]}.{LAYER_MAP[parts[2]]}.{parts[3]}"
    raise ValueError(f"GGUF tensor {gguf_name} has no mapping to this model")


# ggml types whose tensors read as values; the others as their blocks' bytes
PLAIN_TYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
               "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: ``kind`` its ggml type's name, ``shape``
    in Hugging Face's order (slowest dimension first), ``data`` mapped from
    the file: values for PLAIN_TYPES, else the blocks' bytes, one row per
    row of weights (as gguf's reader shapes them)."""

    name: str
    kind: str
    shape: tuple[int, ...]
    data: np.ndarray


def read_gguf(path: Path) -> tuple[dict[str, Any], list[GGUFTensor]]:
    """A GGUF file's metadata (an array is given as its length) and its
    tensors, mapped, in file order. The file's header is parsed once, in
    ``read_gguf_layout``: gguf's own reader also builds every metadata array
    element (a tokenizer's vocabulary), which takes seconds."""
    import gguf

    meta, infos, start = read_gguf_layout(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = []
    for t in infos:
        qtype = gguf.GGMLQuantizationType(t.ggml_type)
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        shape = tuple(reversed(t.dims))
        nbytes = math.prod(t.dims) * type_size // block
        raw = mapped[start + t.offset: start + t.offset + nbytes]
        if raw.size != nbytes:
            raise ValueError(f"{path}: tensor {t.name} runs past the end of the file")
        data = (raw.view(PLAIN_TYPES[qtype.name]).reshape(shape) if qtype.name in PLAIN_TYPES
                else raw.reshape(gguf.quant_shape_to_byte_shape(shape, qtype)))
        tensors.append(GGUFTensor(t.name, qtype.name, shape, data))
    return meta, tensors


def gguf_config(meta: dict[str, Any], tensors: list[GGUFTensor]) -> dict:
    """config.json contents from GGUF metadata (``read_gguf``'s)."""

    def field(key: str, default=None):
        return meta.get(key, default)

    arch = field("general.architecture")
    row = by_gguf(arch, bool(field(f"{arch}.expert_count")))
    if row is None:
        raise ValueError(f"GGUF architecture {arch!r} {'with' if field(f'{arch}.expert_count') else 'without'} "
                         f"experts is not supported; GGUF architectures: {gguf_names()}")
    heads = int(field(f"{arch}.attention.head_count"))
    hidden = int(field(f"{arch}.embedding_length"))
    names = {t.name for t in tensors}
    vocab = field(f"{arch}.vocab_size") or field("tokenizer.ggml.tokens")  # the array's length
    layers = int(field(f"{arch}.block_count"))
    moe: dict[str, Any] = {}
    if row.experts == "every":  # Mixtral: every layer sparse, experts ffn-wide
        moe = {"num_local_experts": int(field(f"{arch}.expert_count")),
               "num_experts_per_tok": int(field(f"{arch}.expert_used_count"))}
    elif row.moe:  # qwen3moe: a router in every sparse layer, top-k weights renormalized
        moe = {"num_experts": int(field(f"{arch}.expert_count")),
               "num_experts_per_tok": int(field(f"{arch}.expert_used_count")),
               "moe_intermediate_size": int(field(f"{arch}.expert_feed_forward_length")),
               "norm_topk_prob": bool(field(f"{arch}.expert_weights_norm", True)), "decoder_sparse_step": 1,
               "mlp_only_layers": [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in names]}
    return {
        "architectures": [row.name],
        "model_type": row.model_type,
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "intermediate_size": int(field(f"{arch}.feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(field(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(field(f"{arch}.attention.key_length", hidden // heads)),
        "vocab_size": int(vocab),
        "max_position_embeddings": int(field(f"{arch}.context_length")),
        "rope_theta": float(field(f"{arch}.rope.freq_base", 10000.0)),
        "rms_norm_eps": float(field(f"{arch}.attention.layer_norm_rms_epsilon")),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": field("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
        "attention_bias": arch == "qwen2",
        **moe,
    }


def kept_at_width(name: str, kind: str) -> bool:
    """Whether ``quantization=gguf`` keeps this tensor (Hugging Face name, GGUF
    type) as blocks: a projection (or untied LM head) of a kept block type;
    a quantized embedding is dequantized for lookups."""
    projection = name == "lm_head.weight" or (".layers." in name and name.endswith("_proj.weight"))
    return projection and kind in KEPT_TYPES


def read_block_tensors(gguf_path: Path) -> tuple[dict[str, tuple], dict[str, str]]:
    """The file's projections and LM head (an untied one, or a tied one's
    embedding) of a kept block type as (q, d, m) numpy arrays by Hugging
    Face name (``int4_blocks`` or ``int8_blocks``; q and k projections
    unpermuted like their dequantized weights; stacked experts one entry
    per expert, ``...mlp.experts.E.gate_proj.weight``), and the block type
    of every other tensor (a tied embedding too: lookups read it
    dequantized)."""
    meta, tensors = read_gguf(gguf_path)
    config = gguf_config(meta, tensors)
    permuted = ARCHITECTURES[config["architectures"][0]].gguf_permuted_qk  # Q and K rows interleaved by llama.cpp
    heads = ({"self_attn.q_proj.weight": config["num_attention_heads"],
              "self_attn.k_proj.weight": config["num_key_value_heads"]} if permuted else {})
    blocks, others = {}, {}
    for t in tensors:
        kind, shape = t.kind, t.shape
        experts = expert_tensor(t.name)
        if experts is not None:
            layer, projection = experts
            names = [f"model.layers.{layer}.mlp.experts.{e}.{projection}.weight" for e in range(shape[0])]
            if kind not in KEPT_TYPES:
                others.update(dict.fromkeys(names, kind))
                continue
            rows = (shape[0] * shape[1], shape[2])  # every expert's rows, in expert order
            parts = (int4_blocks if kind in INT4_TYPES else int8_blocks)(t.data, kind, rows)
            for e, name in enumerate(names):
                blocks[name] = tuple(x.reshape(shape[0], shape[1], -1)[e] for x in parts)
            continue
        name = hf_name(t.name)
        if name == "model.embed_tokens.weight" and config["tie_word_embeddings"] and kind in KEPT_TYPES:
            # a tied LM head runs the embedding's blocks at their width (lookups stay dequantized)
            blocks["lm_head.weight"] = (int4_blocks if kind in INT4_TYPES else int8_blocks)(t.data, kind, shape)
        if not kept_at_width(name, kind):
            others[name] = kind
            continue
        parts = (int4_blocks if kind in INT4_TYPES else int8_blocks)(t.data, kind, shape)
        n_head = next((h for suffix, h in heads.items() if name.endswith(suffix)), None)
        if n_head is not None:
            parts = (unpermute(parts[0], n_head), unpermute(parts[1], n_head), unpermute(parts[2], n_head))
        blocks[name] = parts
    return blocks, others


def convert_gguf(gguf_path: Path, out_dir: Path, progress: Optional[Callable[[int, int], None]] = None,
                 without_kept: bool = False) -> Path:
    """Write ``out_dir`` with config.json, model.safetensors (every tensor
    dequantized to fp32; ``without_kept``: all but those ``quantization=gguf``
    keeps as blocks, which it reads from the file itself) and the tokenizer."""
    import torch
    from safetensors.torch import save_file

    meta, stored = read_gguf(gguf_path)
    config = gguf_config(meta, stored)
    tensors = {}
    total = len(stored)
    permuted = ARCHITECTURES[config["architectures"][0]].gguf_permuted_qk
    for i, t in enumerate(stored):
        shape = t.shape
        experts = expert_tensor(t.name)
        if experts is not None:  # one tensor per expert, as Hugging Face names them
            if without_kept and t.kind in KEPT_TYPES:
                continue
            layer, projection = experts
            w = dequantize(t.data, t.kind, shape)
            for e in range(shape[0]):
                tensors[f"model.layers.{layer}.mlp.experts.{e}.{projection}.weight"] = torch.from_numpy(
                    np.ascontiguousarray(w[e]))
            continue
        name = hf_name(t.name)
        if without_kept and kept_at_width(name, t.kind):
            continue
        w = dequantize(t.data, t.kind, shape)
        if permuted and name.endswith("self_attn.q_proj.weight"):
            w = unpermute(w, config["num_attention_heads"])
        elif permuted and name.endswith("self_attn.k_proj.weight"):
            w = unpermute(w, config["num_key_value_heads"])
        tensors[name] = torch.from_numpy(np.ascontiguousarray(w))
        if progress:
            progress(i + 1, total)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt", "source": gguf_path.name})
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.save_pretrained(str(tmp))
    tmp.rename(out_dir)
    return out_dir

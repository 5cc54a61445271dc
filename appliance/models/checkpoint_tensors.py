"""A checkpoint's tensors read into a model built on the meta device
(``loader.load_model``): each tensor materialized in the target dtype
straight from its safetensors file (a tensor-parallel rank reads only its
rows or columns), fused projections filled row block by row block, experts
into their layer's stacked weights, quantized projections (AWQ/GPTQ,
fp8, a GGUF file's blocks) gathered and installed as their modules, and
fp8 KV cache scales set on their layers."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from accelerate.utils import set_module_tensor_to_device

from appliance.config.checkpoint import quantization_facts
from appliance.errors import ModelLoadError
from appliance.models.fp8 import CHECKPOINT_TENSORS as FP8_TENSORS
from appliance.models.int4_checkpoints import UNPACK
from appliance.models.mxfp4 import check_mxfp4, expert_weight_from_mxfp4, rank_mxfp4
from appliance.models.layers.linear import Projections
from appliance.models.layers.moe import expert_range
from appliance.models.layers.parallel import fused_shard_rows, tensor_shard
from appliance.models.llama import canonical_name, text_model_name


class CheckpointTensors:
    """One pass over a checkpoint's tensors into ``model`` (``read``), then
    the quantized projections installed (``install``). ``expected`` are the
    model's parameters, ``loaded`` those filled; ``method`` the checkpoint's
    quantization (``checkpoint.checkpoint_quant_method``)."""

    def __init__(self, model: Any, full_arch: Any, tp: Any, ep: Any, dtype: Any, device: Any, method: str):
        self.model, self.arch, self.full_arch = model, model.arch, full_arch  # arch: this rank's dimensions
        self.tp, self.ep, self.dtype, self.device, self.method = tp, ep, dtype, device, method
        self.expected = dict(model.named_parameters())
        self.projections = Projections(model)  # which linear (and rows) each checkpoint projection fills
        self.loaded: set[str] = set()
        self.packed_rows: dict[str, int] = {}  # packed (or stacked expert) parameter -> rows filled so far
        # a quantized checkpoint's projections (QUANTIZED_TENSORS[method]): projection -> part name -> tensor
        self.quantized = QUANTIZED_TENSORS.get(method)
        self.quantized_parts: dict[str, dict[str, torch.Tensor]] = {}
        self.kv_scales: dict[int, dict[str, torch.Tensor]] = {}  # layer -> "k" / "v" -> its fp8 KV cache scale
        self.prediction_layers = 0  # the checkpoint's multi-token-prediction layers, not read (num_nextn_predict_layers)

    def read(self, folder: Path) -> None:
        from safetensors import safe_open

        for f in _safetensors_files(folder):
            with safe_open(str(f), framework="pt") as sf:
                for stored in sf.keys():
                    self._take(sf, stored, f.name)

    def _take(self, sf: Any, stored: str, file_name: str) -> None:
        """One stored tensor: set aside (KV scales, quantized parts), into an
        expert's slots, into its rows of a fused projection, or materialized."""
        model, arch, tp = self.model, self.arch, self.tp
        text = text_model_name(stored)
        if text is None:
            return  # an image-text checkpoint's image encoder
        name = model.local_name(canonical_name(text))
        if name is None or (name == "lm_head.weight" and arch.tie_word_embeddings) or self._prediction_layer(text):
            return  # another pipeline stage's, tied to the embedding, or a multi-token-prediction layer
        kv_scale = _kv_scale_target(name)
        if kv_scale is not None:
            t = sf.get_tensor(stored)
            for which in kv_scale[1]:
                self.kv_scales.setdefault(kv_scale[0], {})[which] = t
            return
        part = self.quantized.part(name, sf, stored) if self.quantized is not None else None
        if part is not None:
            self.quantized_parts.setdefault(part[0], {})[part[1]] = sf.get_tensor(stored)
            return
        if ".mlp.experts." in name and not getattr(model, "stacked_experts", False):
            self.loaded |= _load_expert(model, sf, stored, name, self._shard(name) if self.ep is None else None,
                                        self.expected, self.dtype, self.device, self.packed_rows)
            return
        fill = self.projections.find(name)
        packed = fill if fill is not None and fill.packed else None  # it fills some rows of a linear
        target = fill.target if fill is not None else name
        if target not in self.expected:
            if "rotary_emb" in name:
                return
            raise ModelLoadError(f"{file_name}: unexpected tensor {name} for {arch.architecture}")
        fused = fused_shard_rows(self.full_arch, tp.rank, tp.size, name, self.projections) if tp else None
        if fused is not None:  # a fused projection (Phi-3's): the rank's rows of each part, in order
            whole = sf.get_slice(stored)
            t = torch.cat([whole[start:stop] for start, stop in fused])
        else:
            t = _read_shard(sf, stored, self._shard(name))
        want = tuple(self.expected[target].shape)
        if packed is not None:
            want = (packed.rows[1],) + want[1:]
        if tuple(t.shape) != want:
            raise ModelLoadError(f"{file_name}: tensor {name} has shape {tuple(t.shape)}, the model expects {want}")
        if packed is not None:
            self._fill_rows(target, *packed.rows, t)
            return
        # routers and their score corrections stay fp32 (gpt-oss's runs in the model's dtype)
        router = name.endswith((".mlp.gate.weight", ".mlp.gate.e_score_correction_bias"))
        set_module_tensor_to_device(model, name, self.device, value=t,
                                    dtype=torch.float32 if router else self.dtype)
        self.loaded.add(name)

    def _prediction_layer(self, name: str) -> bool:
        """A checkpoint's multi-token-prediction layer (``num_nextn_predict_layers`` of them after the model's:
        GLM-4.5's, DeepSeek-V3's): a draft's, not the model's."""
        head, sep, rest = name.partition("model.layers.")
        index = rest.partition(".")[0]
        return bool(sep) and not head and index.isdigit() and \
            self.full_arch.num_layers <= int(index) < self.full_arch.num_layers + self.prediction_layers

    def _shard(self, name: str) -> tuple[int, int, int] | None:
        """(dim, start, stop) of checkpoint tensor ``name`` that this rank holds; None: all of it. Under expert
        parallelism a stacked expert tensor's (gpt-oss's) are its experts, whole."""
        tp, ep = self.tp, self.ep
        if ep is not None and ".mlp.experts." in name:
            return (0, *expert_range(self.full_arch.num_experts, ep.rank, ep.size))
        return None if tp is None else tensor_shard(self.full_arch, tp.rank, tp.size, name, self.projections)

    def _fill_rows(self, target: str, first: int, rows: int, t: Any) -> None:
        """Rows ``first:first + rows`` of the fused parameter ``target``,
        materialized once, then filled in place."""
        shape = self.expected[target].shape
        if target not in self.packed_rows:
            set_module_tensor_to_device(self.model, target, self.device, dtype=self.dtype,
                                        value=torch.empty(shape, dtype=self.dtype))
            self.packed_rows[target] = 0
        with torch.no_grad():
            self.model.get_parameter(target)[first : first + rows].copy_(t.to(self.dtype))
        self.packed_rows[target] += rows
        if self.packed_rows[target] == shape[0]:
            self.loaded.add(target)

    def install(self, folder: Path, hf: dict, gguf_blocks: Any, model_path: str) -> None:
        """The quantized projections read aside as their modules (a GGUF
        file's blocks; a quantized checkpoint's parts, as its
        ``QUANTIZED_TENSORS`` entry installs them), and the layers' KV cache
        scales."""
        model, full_arch, tp, ep = self.model, self.full_arch, self.tp, self.ep
        if gguf_blocks is not None:
            from appliance.models.gguf_blocks import keep_gguf_blocks

            # a pipeline stage's tensors by its own names; a tensor-parallel rank's part of each
            blocks, others = ({local: v for name, v in d.items() if (local := model.local_name(name)) is not None}
                              for d in gguf_blocks)
            try:
                self.loaded |= keep_gguf_blocks(model, _rank_blocks(blocks, full_arch, tp, ep, self.projections),
                                                others)
            except ValueError as e:
                raise ModelLoadError(f"model.path={model_path}: {e}") from None
        if self.quantized is not None and self.quantized_parts:
            self.loaded |= self.quantized.install(self, folder, hf)
        _set_kv_scales(model, self.kv_scales, folder)

    def set_mxfp4(self, target: str, parts: dict[str, torch.Tensor], folder: Path) -> None:
        """An expert projection of gpt-oss's MXFP4 checkpoint, kept at 4 bits (``hold_mxfp4``), or dequantized
        into its parameter where this rank's inputs are not whole groups."""
        if target not in self.expected:
            raise ModelLoadError(f"{folder}: MXFP4 tensors of {target}, a projection this model does not have")
        if set(parts) != {"blocks", "scales"}:
            raise ModelLoadError(f"{folder}: {target} has MXFP4 {' and '.join(sorted(parts))} but not both blocks "
                                 f"and scales")
        blocks, scales = parts["blocks"], parts["scales"]
        try:
            check_mxfp4(blocks, scales)
        except ValueError as e:
            raise ModelLoadError(f"{folder}: {target}: {e}") from None
        shard = self._shard(target)
        kept = rank_mxfp4(blocks, scales, shard)
        if kept is not None:
            b, s = kept
            experts, k, n = self.expected[target].shape
            if tuple(b.shape) != (experts, n, k // 32, 16) or k % 32:
                raise ModelLoadError(f"{folder}: MXFP4 {target} holds {tuple(b.shape)} blocks, the model expects "
                                     f"{(experts, n, k // 32, 16)} ({experts} experts, {n} outputs of {k} inputs)")
            if int(s.min()) < 0 or int(s.max()) > 255:
                raise ModelLoadError(f"{folder}: MXFP4 {target} has scales outside e8m0's 0..255")
            module, _, name = target.rpartition(".")
            self.model.get_submodule(module).hold_mxfp4(name, b.contiguous().to(self.device),
                                                        s.to(torch.uint8).contiguous().to(self.device))
            return
        t = expert_weight_from_mxfp4(blocks, scales)
        if shard is not None:  # this rank's channels of the whole projection
            dim, start, stop = shard
            t = t.narrow(dim, start, stop - start)
        want = tuple(self.expected[target].shape)
        if tuple(t.shape) != want:
            raise ModelLoadError(f"{folder}: MXFP4 {target} dequantizes to {tuple(t.shape)}, the model expects {want}")
        set_module_tensor_to_device(self.model, target, self.device, value=t, dtype=self.dtype)


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
                             full_arch: Any, tp: Any, ep: Any, projections: Projections) -> set[str]:
    """The AWQ/GPTQ projections as int4 (or, 8-bit, grouped int8) linears
    (with ``tp``, this rank's part of each); the module weights they fill."""
    from appliance.models.int4_checkpoints import checkpoint_blocks
    from appliance.models.quant import install_int4

    try:
        blocks = {name: checkpoint_blocks(method, p, bits) for name, p in parts.items()}
        return install_int4(model, _rank_blocks(blocks, full_arch, tp, ep, projections), method)
    except ValueError as e:
        raise ModelLoadError(f"{folder}: {e}") from None


def _rank_blocks(blocks: dict[str, tuple], full_arch: Any, tp: Any, ep: Any,
                 projections: Projections) -> dict[str, tuple]:
    """Whole projections' blocks cut to a tensor-parallel rank's part (as is
    without ``tp``); with expert parallelism (``ep``) the experts stay whole
    (a rank takes its own experts' blocks, ``quant.install_expert_blocks``)."""
    from appliance.models.layers.parallel import shard_blocks

    if tp is None:
        return blocks
    whole = {name: b for name, b in blocks.items() if ep is not None and ".mlp.experts." in name}
    mine = shard_blocks(full_arch, tp.rank, tp.size, {n: b for n, b in blocks.items() if n not in whole}, projections)
    return {**mine, **whole}


def _read_shard(sf: Any, name: str, shard: tuple[int, int, int] | None) -> torch.Tensor:
    """The tensor ``name``, or only its rows / columns ``shard`` (dim, start,
    stop) read from the file; rows past the tensor's (a padded vocabulary)
    are zeros."""
    if shard is None:
        return sf.get_tensor(name)
    dim, start, stop = shard
    sl = sf.get_slice(name)
    size = sl.get_shape()[dim]
    t = sl[(slice(None),) * dim + (slice(start, min(stop, size)),)]
    if stop > size:
        pad = list(t.shape)
        pad[dim] = stop - max(start, size)
        t = torch.cat([t, torch.zeros(pad, dtype=t.dtype)], dim=dim)
    return t


def _load_expert(model: Any, sf: Any, stored: str, name: str, shard: tuple[int, int, int] | None,
                 expected: dict, dtype: Any, device: Any, filled: dict[str, int]) -> set[str]:
    """Copy one expert projection into every slot of its layer's stacked
    weight that holds the expert (this rank's slice of it under tensor
    parallelism, ``shard``; nothing for an expert other ranks hold); the
    stacked weights this completed."""
    targets = model.expert_targets(name)
    if not targets:
        return set()
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


@dataclass(frozen=True)
class QuantizedTensors:
    """How a quantized checkpoint's projections load, by the method its
    quantization_config names (``checkpoint.checkpoint_quant_method``):
    ``part(name, file, stored)``, which stored tensors are parts of a
    projection (the projection's key and the part's name; None: a tensor
    of its own), and ``install(tensors, folder, hf)``, the parts set aside
    made into modules (the module weights they fill). ``named``: serving
    the checkpoint needs ``quantization=`` its method (gpt-oss's MXFP4
    experts dequantize at load, so they need not)."""

    part: Callable[[str, Any, str], Optional[tuple[str, str]]]
    install: Callable[[CheckpointTensors, Path, dict], set[str]]
    named: bool = True


def _int4_part(method: str) -> Callable[[str, Any, str], Optional[tuple[str, str]]]:
    def part(name: str, sf: Any, stored: str) -> Optional[tuple[str, str]]:
        prefix, _, suffix = name.rpartition(".")
        return (prefix + ".weight", suffix) if suffix in UNPACK[method][1] else None
    return part


def _install_int4(t: CheckpointTensors, folder: Path, hf: dict) -> set[str]:
    qc = hf.get("quantization_config") or {}
    return _install_int4_checkpoint(t.model, t.method, t.quantized_parts, folder, qc.get("bits", qc.get("w_bit", 4)),
                                    t.full_arch, t.tp, t.ep, t.projections)


def _fp8_part(name: str, sf: Any, stored: str) -> Optional[tuple[str, str]]:
    prefix, _, suffix = name.rpartition(".")  # an fp8 weight (not a float one beside them) and its scales
    if suffix in FP8_TENSORS and (suffix != "weight" or sf.get_slice(stored).get_dtype() == "F8_E4M3"):
        return prefix + ".weight", suffix
    return None


def _install_fp8(t: CheckpointTensors, folder: Path, hf: dict) -> set[str]:
    from appliance.models.fp8 import install_fp8

    block = (hf.get("quantization_config") or {}).get("weight_block_size")
    try:
        return install_fp8(t.model, t.quantized_parts, _checkpoint_activations(hf), block, t.full_arch, t.tp, t.ep,
                           t.projections)
    except ValueError as e:
        raise ModelLoadError(f"{folder}: {e}") from None


def _mxfp4_part(name: str, sf: Any, stored: str) -> Optional[tuple[str, str]]:
    prefix, _, suffix = name.rpartition(".")  # gpt-oss's experts: gate_up_proj_blocks, ..._scales
    if not suffix.endswith(("_blocks", "_scales")):
        return None
    stem, _, part = suffix.rpartition("_")
    return f"{prefix}.{stem}", part


def _install_mxfp4(t: CheckpointTensors, folder: Path, hf: dict) -> set[str]:
    for target, parts in t.quantized_parts.items():
        t.set_mxfp4(target, parts, folder)
    return set(t.quantized_parts)


QUANTIZED_TENSORS: dict[str, QuantizedTensors] = {
    "awq": QuantizedTensors(_int4_part("awq"), _install_int4),
    "gptq": QuantizedTensors(_int4_part("gptq"), _install_int4),
    "fp8": QuantizedTensors(_fp8_part, _install_fp8),
    "mxfp4": QuantizedTensors(_mxfp4_part, _install_mxfp4, named=False),
}

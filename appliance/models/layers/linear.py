"""Packed projections: the checkpoint's q/k/v and gate/up tensors fill row
ranges of one ``qkv_proj`` and one ``gate_up_proj`` (one GEMM each), and the
hook that swaps a projection module for another (a quantized linear)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable, Optional

from torch import nn

if TYPE_CHECKING:
    from appliance.models.arch import ModelArch


# checkpoint projection -> (packed parameter, shard index)
PACKED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def packed_target(arch: "ModelArch", name: str) -> Optional[tuple[str, int, int]]:
    """(packed parameter name, row offset, rows) for a checkpoint tensor of a
    packed projection, or None."""
    for src, (dst, shard) in PACKED.items():
        if f".{src}." in name:
            q, kv, inter = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, arch.intermediate_size
            offsets = {"self_attn.qkv_proj": [(0, q), (q, kv), (q + kv, kv)],
                       "mlp.gate_up_proj": [(0, inter), (inter, inter)]}[dst]
            start, rows = offsets[shard]
            return name.replace(src, dst), start, rows
    return None


def fused_parts(arch: "ModelArch", names: Iterable[str]) -> dict[str, list[str]]:
    """Checkpoint weight names of projections grouped by the module weight
    they fill (q/k/v into qkv_proj, gate/up into gate_up_proj), each group in
    row order."""
    groups: dict[str, list[tuple[int, str]]] = {}
    for name in names:
        packed = packed_target(arch, name)
        target, start = (packed[0], packed[1]) if packed else (name, 0)
        groups.setdefault(target, []).append((start, name))
    return {target: [n for _, n in sorted(g)] for target, g in groups.items()}


def replace_linear(model: nn.Module, weight_name: str, make: Callable[[nn.Module], nn.Module]) -> None:
    """Swap the linear that owns ``weight_name`` for ``make(old_linear)``."""
    parent_path, attr = weight_name[: -len(".weight")].rsplit(".", 1)
    parent = model.get_submodule(parent_path)
    setattr(parent, attr, make(getattr(parent, attr)))

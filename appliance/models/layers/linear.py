"""The projections of the layer library: column- and row-parallel linears,
the merged gate|up and the q|k|v ones, each declaring which checkpoint
tensors fill which of its rows and how tensor-parallel ranks split it;
``Projections``, a model's linears found by the checkpoint tensors that fill
them (what the loaders and ``layers.parallel`` read); and the hook that
swaps a projection for another module (a quantized linear).

A column-parallel linear's rows are parts stacked in order (q | k | v,
gate | up, or one part), each the rows of one model dimension: ``"q"`` (q
heads x head_dim), ``"kv"`` (KV heads x head_dim) or ``"inter"`` (the MLP's
intermediate rows); a tensor-parallel rank holds its share of each part's
rows. A checkpoint fills a part from its own tensor (``q_proj`` into
``qkv_proj``'s first rows) or the whole linear from one fused tensor named
as the linear (Phi-3's ``qkv_proj``). A row-parallel linear's inputs are one
such dimension (o_proj's the q heads, down_proj's the MLP rows): a rank holds
its columns, and the layer all-reduces the partial sums
(``parallel.row_parallel_output``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ClassVar, Iterable, Optional, Sequence

from torch import nn

if TYPE_CHECKING:
    from appliance.models.arch import ModelArch

SPANS = ("q", "kv", "inter", "shared")  # the model dimensions a projection's rows (or inputs) can be ("shared": a
# sparse layer's shared experts' rows)


@dataclass(frozen=True)
class Part:
    """Rows of a projection filled by one checkpoint tensor: the checkpoint
    projection's name (its last component, e.g. ``q_proj``), the model
    dimension the rows are (``SPANS``), and how many this module holds."""

    name: str
    span: str
    rows: int

    def __post_init__(self) -> None:
        if self.span not in SPANS:
            raise ValueError(f"Part {self.name}: span {self.span!r} is not one of {', '.join(SPANS)}")


class ParallelLinear(nn.Linear):
    """A projection that declares its checkpoint parts and its tensor-parallel split."""

    split: ClassVar[str]  # "column": a rank holds its output rows; "row": its input columns
    parts: tuple[Part, ...]


class ColumnParallelLinear(ParallelLinear):
    """Output rows split over the ranks, part by part; no communication."""

    split = "column"

    def __init__(self, in_features: int, parts: Sequence[Part], bias: bool = False):
        super().__init__(in_features, sum(p.rows for p in parts), bias=bias)
        self.parts = tuple(parts)

    def part_rows(self, index: int) -> tuple[int, int]:
        """(first row, rows) of part ``index`` in this module."""
        first = sum(p.rows for p in self.parts[:index])
        return first, self.parts[index].rows


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several projections of one dimension packed into one GEMM (gate | up)."""

    def __init__(self, in_features: int, names: Sequence[str], span: str, rows: int, bias: bool = False):
        super().__init__(in_features, [Part(n, span, rows) for n in names], bias=bias)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v packed into one GEMM (rows q | k | v) for ``arch``'s heads (this rank's)."""

    def __init__(self, arch: ModelArch, bias: bool = False):
        q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        super().__init__(arch.hidden_size, [Part("q_proj", "q", q), Part("k_proj", "kv", kv),
                                            Part("v_proj", "kv", kv)], bias=bias)


class RowParallelLinear(ParallelLinear):
    """Inputs split over the ranks (``name``'s inputs are the dimension ``span``); the partial sums all-reduced."""

    split = "row"

    def __init__(self, in_features: int, out_features: int, name: str, span: str, bias: bool = False):
        super().__init__(in_features, out_features, bias=bias)
        self.parts = (Part(name, span, in_features),)


@dataclass(frozen=True)
class Fill:
    """What a checkpoint tensor fills: ``target``, the module tensor's name,
    its ``linear``, and the parts (indices into ``linear.parts``) it holds:
    one part, or every part (a fused checkpoint tensor, or a linear of one
    part)."""

    target: str
    linear: ParallelLinear
    parts: tuple[int, ...]

    @property
    def packed(self) -> bool:
        """It fills some rows of the module's tensor, not all of it."""
        return len(self.parts) < len(self.linear.parts)

    @property
    def rows(self) -> tuple[int, int]:
        """(first row, rows) it fills in the module's tensor."""
        if not isinstance(self.linear, ColumnParallelLinear):
            return 0, self.linear.out_features
        first = self.linear.part_rows(self.parts[0])[0]
        return first, sum(self.linear.parts[i].rows for i in self.parts)


class Projections:
    """A model's parallel linears by the checkpoint tensors that fill them
    (names as the model holds them: a pipeline stage's local ones)."""

    def __init__(self, model: nn.Module):
        self._sources: dict[str, tuple[str, ParallelLinear, tuple[int, ...]]] = {}
        for path, module in model.named_modules():
            if not isinstance(module, ParallelLinear):
                continue
            self._sources[path] = (path, module, tuple(range(len(module.parts))))
            if len(module.parts) > 1:
                parent = path.rpartition(".")[0]
                for i, part in enumerate(module.parts):
                    self._sources[f"{parent}.{part.name}" if parent else part.name] = (path, module, (i,))

    def find(self, name: str) -> Optional[Fill]:
        """What the checkpoint tensor ``name`` (``....q_proj.weight`` or
        ``.bias``) fills; None for a tensor of no parallel linear."""
        module, _, suffix = name.rpartition(".")
        source = self._sources.get(module)
        if source is None:
            return None
        path, linear, parts = source
        return Fill(f"{path}.{suffix}", linear, parts)

    def fused_parts(self, names: Iterable[str]) -> dict[str, list[str]]:
        """Checkpoint weight names grouped by the module weight they fill
        (q/k/v into qkv_proj, gate/up into gate_up_proj; any other name
        alone), each group in row order."""
        groups: dict[str, list[tuple[int, str]]] = {}
        for name in names:
            fill = self.find(name)
            target, start = (fill.target, fill.rows[0]) if fill is not None and fill.packed else (name, 0)
            groups.setdefault(target, []).append((start, name))
        return {target: [n for _, n in sorted(g)] for target, g in groups.items()}


def replace_linear(model: nn.Module, weight_name: str, make: Callable[[nn.Linear], nn.Module]) -> None:
    """The quantization hook: swap the linear that owns ``weight_name`` for
    ``make(old_linear)``."""
    parent_path, attr = weight_name[: -len(".weight")].rsplit(".", 1)
    parent = model.get_submodule(parent_path)
    setattr(parent, attr, make(getattr(parent, attr)))

"""The Llama family in one implementation: Llama 2/3 (llama3 rope scaling),
SmolLM2, Mistral, Qwen2/2.5 (qkv bias), Qwen3 (q/k norm), and the
mixture-of-experts Qwen3-MoE and Mixtral, whose sparse layers hold a
``layers.moe.SparseMoe`` in place of the dense MLP; declared from the layer
library (``models/layers``).

The forward runs over a flattened token batch (prefill chunks and decodes
mixed), writes K/V through the attention backend into the paged cache, and
projects only the rows in ``logits_indices`` (the last scheduled position
of each sampling request) through the LM head. Parameter names follow
Hugging Face's so checkpoints load by name, except the packed projections
(``qkv_proj`` = q|k|v, ``gate_up_proj`` = gate|up), which the loader fills
from the checkpoint's separate tensors as the linears declare
(``layers.linear``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, cast

import torch
from torch import nn
import torch.nn.functional as F

from appliance.config.architectures import support
from appliance.models.arch import ModelArch
from appliance.models.layers.decoder import DEFAULT_SPEC, DecoderLayer, LayerSpec
from appliance.models.layers.moe import ExpertParallel, FusedExperts, SparseMoe
from appliance.models.layers.norm import RMSNorm
from appliance.models.layers.parallel import PipelineParallel, TensorParallel, shard_arch
from appliance.models.layers.rotary import rope_long_rows, rope_tables
from appliance.models.layers.vocab import VocabParallelEmbedding, vocab_parallel_logits
from appliance.models.weights_view import ModelWeights, weights_view

if TYPE_CHECKING:  # the backend is handed in; the model never picks one
    from appliance.kernels.base import AttentionBackend

# Mixtral's names for its sparse block and experts -> the names used here (Qwen3-MoE's)
_MIXTRAL_NAMES = ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."),
                  (".w2.", ".down_proj."))


# an image-text checkpoint's text model tensors (transformers 5's names and the older ones) -> a text checkpoint's
_TEXT_MODEL_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                        ("language_model.lm_head.", "lm_head."))
# and its image encoder's tensors, not read (images are not built yet)
_IMAGE_PREFIXES = ("vision_tower.", "vision_model.", "multi_modal_projector.", "model.vision_tower.",
                   "model.vision_model.", "model.multi_modal_projector.")


def text_model_name(name: str) -> Optional[str]:
    """A checkpoint tensor's name as a text model's checkpoint names it: an image-text checkpoint's text model
    tensors (``model.language_model.*``, ``language_model.model.*``, ``language_model.lm_head.*``) as the text
    model's own, its image encoder's and projector's None (not read); other names unchanged."""
    if name.startswith(_IMAGE_PREFIXES):
        return None
    for old, new in _TEXT_MODEL_PREFIXES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def canonical_name(name: str) -> str:
    """A checkpoint tensor's name as this model names it: Mixtral's
    ``block_sparse_moe.experts.E.w1`` (gate), ``w3`` (up) and ``w2`` (down)
    become ``mlp.experts.E.gate_proj`` / ``up_proj`` / ``down_proj``, its
    router ``mlp.gate``; Llama 4's ``feed_forward`` becomes ``mlp``, Qwen2-MoE's
    ``mlp.shared_expert`` ``mlp.shared_experts``; other names are unchanged."""
    if ".feed_forward." in name:
        return name.replace(".feed_forward.", ".mlp.")
    if ".mlp.shared_expert." in name:
        return name.replace(".mlp.shared_expert.", ".mlp.shared_experts.")
    if ".block_sparse_moe." not in name:
        return name
    for old, new in _MIXTRAL_NAMES:
        name = name.replace(old, new)
    return name


class Backbone(nn.Module):
    """The decoder layers a rank holds (all, or a pipeline stage's), with the
    embedding and the final norm where the stage needs them."""

    layers: nn.ModuleList
    embed_tokens: nn.Module  # an nn.Embedding, or lookups from the head's blocks (gguf_blocks.TiedBlockEmbedding)
    norm: RMSNorm

    def __init__(self, arch: ModelArch, backend: AttentionBackend, tp: Optional[TensorParallel] = None,
                 layers: Optional[range] = None, embed: bool = True, norm: bool = True,
                 ep: Optional[ExpertParallel] = None, spec: LayerSpec = DEFAULT_SPEC, vocab_size: int = 0):
        super().__init__()
        if embed:  # ``arch.vocab_size``: this rank's rows of the ``vocab_size`` vocabulary (tensor parallelism)
            self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size,
                                                       vocab_size or arch.vocab_size, tp)
        held = range(arch.num_layers) if layers is None else layers
        self.layers = nn.ModuleList(DecoderLayer(spec, arch, backend, tp, i, ep) for i in held)
        if norm:
            self.norm = spec.norm(arch.hidden_size, arch.rms_norm_eps)

    def decoder_layers(self) -> list[DecoderLayer]:
        return cast(list[DecoderLayer], list(self.layers))

    def sparse_mlps(self) -> list[tuple[int, SparseMoe]]:
        """(index among the layers held, its router and experts) of each sparse layer."""
        return [(i, cast(SparseMoe, layer.mlp)) for i, layer in enumerate(self.decoder_layers()) if layer.sparse]


class LlamaForCausalLM(nn.Module):
    """``arch`` is the whole model's; with ``tp`` the module holds rank
    ``tp.rank``'s part of it (``self.arch``: the dimensions it holds,
    ``shard_arch``) and its forward runs the collectives; with ``pp`` only
    its stage's layers (``model.layers`` holds them from 0; ``local_name``
    maps a checkpoint's names)."""

    family = "llama"  # the architecture rows (config/architectures.py) this class builds
    model: Backbone
    lm_head: nn.Linear
    layer_spec = DEFAULT_SPEC  # its decoder layers (``layers.decoder``); the final norm is ``layer_spec.norm``
    llama_layers = True  # its layers are the Llama family's, as ``weights_view`` describes them

    def __init__(self, arch: ModelArch, backend: AttentionBackend, tp: Optional[TensorParallel] = None,
                 pp: Optional[PipelineParallel] = None, ep: Optional[ExpertParallel] = None):
        super().__init__()
        row, why = support(arch.architecture)
        if row is None:
            raise ValueError(why)
        if row.family != self.family:
            raise ValueError(f"{arch.architecture} is built by the {row.family} implementation, not this one")
        self.tp, self.pp, self.ep = tp, pp, ep
        self.vocab_size = arch.vocab_size  # the logits' width
        if tp is not None:
            arch = shard_arch(arch, tp.size, expert_parallel=ep is not None)
        self.arch = arch
        first, last = pp is None or pp.first, pp is None or pp.last
        self.holds_embedding = first or (last and arch.tie_word_embeddings)
        self.holds_head = last
        self.model = Backbone(arch, backend, tp, None if pp is None else range(pp.start, pp.end),
                              embed=self.holds_embedding, norm=last, ep=ep, spec=self.layer_spec,
                              vocab_size=self.vocab_size)
        if not arch.tie_word_embeddings and last:
            self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        # (cos, sin) [positions, head_dim] in the model dtype, set by rope_cache(); a
        # new tuple on every call, so a holder of derived tables can tell they changed.
        self.rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self.rope_positions = 0  # the positions the tables cover
        # LongRoPE's (original context, row offset of the long rows): the rows a step's tokens take
        # (worker/model_runner.rope_table_rows); None: a token's row is its position
        self.rope_long: Optional[tuple[int, int]] = None
        self.lm_head_q: Optional[nn.Module] = None  # set by quantize_int8_weight_only
        self.eplb: Any = None  # set by enable_eplb
        # a KV connector's worker side (worker/kv_connector.py), called around each layer on this path
        self.kv_layer_hooks: Any = None

    def local_name(self, name: str) -> Optional[str]:
        """The parameter a checkpoint tensor fills here, or None when another
        pipeline stage holds it (its layer, the embedding, the norm, the head)."""
        if self.pp is None:
            return name
        head, sep, rest = name.partition("model.layers.")
        if sep and not head:
            index, _, tail = rest.partition(".")
            if index.isdigit():
                i = int(index)
                return f"model.layers.{i - self.pp.start}.{tail}" if self.pp.start <= i < self.pp.end else None
        if name.startswith("model.embed_tokens."):
            return name if self.holds_embedding else None
        if name.startswith(("model.norm.", "lm_head.")):
            return name if self.holds_head else None
        return name

    def expert_targets(self, name: str) -> list[tuple[str, int, int, int]]:
        """For a checkpoint's expert tensor (``canonical_name``, local layer
        index): (stacked parameter, local slot, first row, rows) of every
        slot here holding that expert (none when other ranks hold it)."""
        head, _, rest = name.partition(".mlp.experts.")
        index, _, tail = rest.partition(".")
        experts = cast(FusedExperts, self.get_submodule(head + ".mlp.experts"))
        part = tail.partition(".")[0]
        if part not in ("gate_proj", "up_proj", "down_proj"):
            raise ValueError(f"{name}: not an expert projection (gate_proj, up_proj or down_proj)")
        out = []
        for slot, e in enumerate(experts.slot_experts):
            if e != int(index):
                continue
            if part == "down_proj":
                out.append((f"{head}.mlp.experts.w2", slot, 0, experts.hidden))
            else:
                out.append((f"{head}.mlp.experts.w13", slot, 0 if part == "gate_proj" else experts.inter,
                            experts.inter))
        return out

    def enable_eplb(self, window_size: int, step_interval: int) -> None:
        """Balance the experts over the expert-parallel ranks (``models/eplb.py``)."""
        from appliance.models.eplb import Eplb

        arch, ep = self.arch, self.ep
        assert ep is not None, "EPLB balances experts over expert-parallel ranks"
        sparse = [mlp for _, mlp in self.model.sparse_mlps()]
        self.eplb = Eplb(sparse, arch.num_experts, arch.num_physical_experts or arch.num_experts, ep.rank, ep.size,
                         ep.group, window_size, step_interval, share=ep.comm if ep.dispatches else None)

    def lm_head_weight(self) -> torch.Tensor:
        if self.arch.tie_word_embeddings:
            return cast(nn.Embedding, self.model.embed_tokens).weight
        return self.lm_head.weight

    def rope_cache(self, max_positions: int, dtype: torch.dtype, device: torch.device) -> None:
        cos, sin = rope_tables(self.arch, max_positions, device)
        self.rope = (cos.to(dtype), sin.to(dtype))
        self.rope_positions, self.rope_long = max_positions, rope_long_rows(self.arch, max_positions)

    def rope_rows(self, positions: torch.Tensor) -> tuple[Any, Any]:
        """The rope rows of a step's positions as every layer takes them: cos and sin [T, 1, head_dim]."""
        assert self.rope is not None
        return self.rope[0][positions].unsqueeze(1), self.rope[1][positions].unsqueeze(1)

    def weights_view(self) -> ModelWeights:
        """The model's tensors and projections as they are now (after any
        quantization), for an executor that runs the whole step itself."""
        return weights_view(self)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: Any,
        logits_indices: torch.Tensor,
    ) -> Optional[torch.Tensor]:
        """fp32 logits at ``logits_indices``; None on a pipeline stage before
        the last (its rows went on to the next stage)."""
        assert self.rope is not None, "call rope_cache() once before forward"
        cos, sin = self.rope_rows(positions)

        hooks = self.kv_layer_hooks

        def layers(x: torch.Tensor) -> torch.Tensor:
            for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches)):
                if hooks is not None:
                    hooks.wait_for_layer_load(i)
                # one metadata for every layer, or (several KV-cache groups) a list of each layer's group's
                x = layer(x, cos, sin, kv_cache, attn_metadata[i] if isinstance(attn_metadata, list) else attn_metadata)
                if hooks is not None:
                    hooks.save_kv_layer(i, kv_cache)
            return x

        pp = self.pp
        if pp is None:
            logits = self._logits(layers(self._embed(input_ids)), logits_indices)
            if self.eplb is not None:
                self.eplb.after_forward()
            return logits

        def stage(x: Optional[torch.Tensor], last: bool) -> torch.Tensor:
            rows = layers(self._embed(input_ids) if x is None else x)
            return self._logits(rows, logits_indices) if last else rows

        stage_logits = pp.run(stage, (input_ids.shape[0], self.arch.hidden_size), self.rope[0].dtype,
                              input_ids.device)
        if self.eplb is not None:  # this stage's sparse layers, balanced over its ranks
            self.eplb.after_forward()
        return stage_logits

    def idle_forward(self) -> None:
        """An engine core with nothing to run, while its data-parallel peers
        step: each sparse layer's exchange with no rows of its own, in layer
        order, so the peers' collectives line up (expert parallelism across
        engine cores)."""
        assert self.rope is not None, "call rope_cache() once before idle_forward"
        empty = torch.empty((0, self.arch.hidden_size), dtype=self.rope[0].dtype, device=self.rope[0].device)
        for _, mlp in self.model.sparse_mlps():
            mlp.exchange(empty)
        if self.eplb is not None:
            self.eplb.after_forward()

    def _logits(self, x: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        x = self.model.norm(x[logits_indices])
        if self.lm_head_q is not None:
            logits = self.lm_head_q(x).float()
        else:
            logits = F.linear(x, self.lm_head_weight()).float()
        return vocab_parallel_logits(logits, self.tp, self.vocab_size)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

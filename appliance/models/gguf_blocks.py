"""A GGUF file's block tensors kept at their width (``quantization=gguf``):
the projections and the LM head installed as grouped linears
(``quant.install_int4``), and an embedding tied to a grouped-int8 head
looked up from the head's blocks instead of a dequantized table."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from appliance.models.quant import GroupedInt8Linear, install_int4

if TYPE_CHECKING:
    from appliance.models.llama import LlamaForCausalLM


class TiedBlockEmbedding(nn.Module):
    """The lookups of an embedding tied to a grouped-int8 LM head (a GGUF's
    Q8_0 ``token_embd`` kept at its width): each token's row read from the
    head's blocks and cast to the model dtype, so the table is held once, as
    the file stores it, instead of a dequantized copy beside the head's
    blocks. The head is not a submodule (it is the model's ``lm_head_q``)."""

    def __init__(self, head: GroupedInt8Linear, dtype: torch.dtype):
        super().__init__()
        self._head = (head,)  # a tuple: not registered twice
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self._head[0].rows(ids).to(self.dtype).reshape(*ids.shape, self.embedding_dim)


def keep_gguf_blocks(model: LlamaForCausalLM, blocks: dict[str, tuple], others: dict[str, str]) -> set[str]:
    """``install_int4`` for a GGUF file's block tensors
    (``appliance.models.gguf.read_block_tensors``), returning the module
    weights they fill; raises ValueError naming the projections of another
    type (they would run dequantized, at a width the plan does not count)."""
    from appliance.models.gguf import KEPT_TYPES

    arch = model.arch
    wide = sorted(f"{name} ({kind})" for name, kind in others.items()
                  if ".layers." in name and name.endswith("_proj.weight"))
    if not arch.tie_word_embeddings and "lm_head.weight" in others:
        wide.append(f"lm_head.weight ({others['lm_head.weight']})")
    if wide:
        raise ValueError(f"quantization=gguf keeps block-quantized projections ({', '.join(KEPT_TYPES)}); this file's "
                         f"{', '.join(wide[:4])}{' ...' if len(wide) > 4 else ''} are not built at their width yet: "
                         f"serve it with quantization=none (dequantized at load)")
    filled = install_int4(model, blocks, "gguf")
    embed = getattr(model.model, "embed_tokens", None)
    if arch.tie_word_embeddings and isinstance(model.lm_head_q, GroupedInt8Linear) and isinstance(embed, nn.Embedding) \
            and model.tp is None and model.pp is None:
        # the table once, at the file's width: lookups read the head's blocks (the loaded dense copy is dropped)
        model.model.embed_tokens = TiedBlockEmbedding(model.lm_head_q, embed.weight.dtype)
    return filled

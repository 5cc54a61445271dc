"""The vocabulary-parallel embedding and LM head. Under tensor parallelism
each rank holds a block of vocabulary rows (the vocabulary padded to a
multiple of 64 x size, ``parallel.padded_vocab``; the padding rows are
zeros): an id outside a rank's rows gives a zero row there and the
all-reduce sums every rank's, and every rank's logits are gathered so each
samples from the whole row."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from appliance.models.layers.parallel import TensorParallel


class VocabParallelEmbedding(nn.Embedding):
    """``rows`` vocabulary rows of ``hidden`` (this rank's, under ``tp``) of a
    ``vocab_size`` vocabulary."""

    def __init__(self, rows: int, hidden: int, vocab_size: int, tp: Optional[TensorParallel] = None):
        # filled by the loader: no random init (nn.Embedding's normal_ on the loader's meta tensors would import
        # torch._dynamo, 1.5 s in every process)
        super().__init__(rows, hidden, _weight=torch.empty(rows, hidden))
        self.tp, self.vocab_size = tp, vocab_size

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        tp = self.tp
        if tp is None:
            return super().forward(input)
        if input.numel() and not (0 <= int(input.min()) and int(input.max()) < self.vocab_size):
            raise ValueError(f"a token id is outside the vocabulary (0..{self.vocab_size - 1})")
        rows = self.num_embeddings
        local = input - tp.rank * rows
        outside = (local < 0) | (local >= rows)
        x = super().forward(local.clamp(0, rows - 1))
        x[outside] = 0
        tp.comm.all_reduce(x)
        return x


def vocab_parallel_logits(logits: torch.Tensor, tp: Optional[TensorParallel], vocab_size: int) -> torch.Tensor:
    """The logits of this rank's vocabulary rows made whole: every rank's
    gathered in rank order, the padding rows dropped."""
    if tp is None:
        return logits
    return torch.cat(tp.comm.all_gather(logits), dim=-1)[:, :vocab_size]

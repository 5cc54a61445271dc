"""The layer library's declarations: a decoder layer's norms where its spec
puts them, under Hugging Face's names; the linears' parts as the loaders find
them; a row-parallel output's bias counted once. (The architectures built
from them are checked token for token against transformers in
test_generation.py.)"""

import dataclasses

import pytest
import torch

from appliance.models.arch import ModelArch
from appliance.models.layers.decoder import DecoderLayer, LayerSpec, dense
from appliance.models.layers.linear import Projections, QKVParallelLinear, RowParallelLinear
from appliance.models.layers.moe import SparseMoe
from appliance.models.layers.parallel import TensorParallel, row_parallel_output
from appliance.models.llama import LlamaForCausalLM

ARCH = ModelArch("LlamaForCausalLM", 2, 64, 128, 4, 2, 16, 500, 1024, 1e4, 1e-5, True)


def _params(layer):
    return {name for name, _ in layer.named_parameters()}


@pytest.mark.parametrize("norms, names", [
    ("pre", {"input_layernorm", "post_attention_layernorm"}),
    ("post", {"post_attention_layernorm", "post_feedforward_layernorm"}),
    ("sandwich", {"input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm"}),
])
def test_a_layer_holds_the_norms_its_spec_places(norms, names):
    with torch.device("meta"):
        layer = DecoderLayer(LayerSpec(norms=norms), ARCH, backend=None)
    held = {n.partition(".")[0] for n in _params(layer) if n.endswith("layernorm.weight")}
    assert held == names
    assert {"self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "mlp.gate_up_proj.weight",
            "mlp.down_proj.weight"} <= _params(layer)


class _Affine(torch.nn.Module):
    def __init__(self, a, b):
        super().__init__()
        self.a, self.b = a, b

    def forward(self, x, *_):
        return x * self.a + self.b


def test_a_layer_runs_its_branches_in_the_spec_order():
    """x += n2(attn(n1(x))); x += n4(mlp(n3(x))) with stand-in branches, each norm a distinct scale."""
    torch.manual_seed(0)
    spec = LayerSpec(norms="sandwich", residual_multiplier=True, attention=lambda arch, backend, tp, index: _Affine(3, 1),
                     mlp=lambda arch, tp, index, ep: _Affine(5, -2))
    layer = DecoderLayer(spec, dataclasses.replace(ARCH, residual_multiplier=0.5), backend=None)
    for i, name in enumerate(layer.norm_names):
        getattr(layer, name).weight.data.fill_(i + 2.0)

    def rms(x, w):
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + ARCH.rms_norm_eps)

    x = torch.randn(3, ARCH.hidden_size)
    h = x + 0.5 * rms(rms(x, 2.0) * 3 + 1, 3.0)
    want = h + 0.5 * rms(rms(h, 4.0) * 5 - 2, 5.0)
    torch.testing.assert_close(layer(x, None, None, None, None), want)


def test_the_spec_picks_the_mlp_and_the_rope_rows():
    arch = dataclasses.replace(ARCH, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                               sparse_layers=(1,), sliding_layers=(0,))
    with torch.device("meta"):
        sparse = DecoderLayer(LayerSpec(), arch, backend=None, index=1)
        dense_layer = DecoderLayer(LayerSpec(mlp=dense), arch, backend=None, index=1)
        kind = LayerSpec(rope_kind=lambda a, i: int(i in a.sliding_layers))
        local = DecoderLayer(kind, arch, backend=None, index=0)
        glob = DecoderLayer(kind, arch, backend=None, index=1)
    assert sparse.sparse and isinstance(sparse.mlp, SparseMoe)
    assert not dense_layer.sparse
    assert (local.rope_kind, glob.rope_kind) == (1, 0)
    with pytest.raises(ValueError, match="LayerSpec.norms='after'"):
        LayerSpec(norms="after")


def test_projections_find_what_each_checkpoint_tensor_fills():
    with torch.device("meta"):
        projections = Projections(LlamaForCausalLM(ARCH, backend=None))
    layer = "model.layers.1."
    k = projections.find(layer + "self_attn.k_proj.weight")
    assert k.target == layer + "self_attn.qkv_proj.weight" and k.packed and k.rows == (64, 32)
    assert isinstance(k.linear, QKVParallelLinear)
    up = projections.find(layer + "mlp.up_proj.bias")
    assert up.target == layer + "mlp.gate_up_proj.bias" and up.rows == (128, 128)
    fused = projections.find(layer + "self_attn.qkv_proj.weight")  # one tensor for every part (Phi-3's)
    assert not fused.packed and fused.parts == (0, 1, 2) and fused.rows == (0, 128)
    o = projections.find(layer + "self_attn.o_proj.weight")
    assert isinstance(o.linear, RowParallelLinear) and not o.packed and o.linear.parts[0].span == "q"
    assert projections.find(layer + "input_layernorm.weight") is None
    assert projections.find("model.embed_tokens.weight") is None
    names = [layer + "mlp.up_proj.weight", layer + "self_attn.v_proj.weight", layer + "self_attn.q_proj.weight",
             layer + "mlp.gate_proj.weight", layer + "self_attn.o_proj.weight", "lm_head.weight"]
    assert projections.fused_parts(names) == {
        layer + "mlp.gate_up_proj.weight": [layer + "mlp.gate_proj.weight", layer + "mlp.up_proj.weight"],
        layer + "self_attn.qkv_proj.weight": [layer + "self_attn.q_proj.weight", layer + "self_attn.v_proj.weight"],
        layer + "self_attn.o_proj.weight": [layer + "self_attn.o_proj.weight"],
        "lm_head.weight": ["lm_head.weight"]}


class _SumOfRanks:
    """all_reduce over two ranks whose partial sums are ``self.other`` and the caller's."""

    def __init__(self, other):
        self.other = other

    def all_reduce(self, t):
        t += self.other


def test_a_row_parallel_output_counts_its_bias_once():
    torch.manual_seed(0)
    proj = RowParallelLinear(8, 4, "o_proj", "q", bias=True)
    x = torch.randn(2, 8)
    whole = proj(x)
    halves = [x[:, :4], x[:, 4:]]
    parts = []
    for rank in (0, 1):
        part = RowParallelLinear(4, 4, "o_proj", "q", bias=True)
        part.weight.data = proj.weight.data[:, 4 * rank: 4 * rank + 4].clone()
        part.bias.data = proj.bias.data.clone()
        parts.append(part)
    other = torch.nn.functional.linear(halves[1], parts[1].weight)  # rank 1's partial sum: no bias
    out = row_parallel_output(parts[0], halves[0], TensorParallel(0, 2, _SumOfRanks(other)))
    torch.testing.assert_close(out, whole)
    rank1 = row_parallel_output(parts[1], halves[1], TensorParallel(1, 2, _SumOfRanks(parts[0](halves[0]))))
    torch.testing.assert_close(rank1, whole)
    assert torch.equal(row_parallel_output(proj, x, None), whole)


class _Alone:
    """A rank's collectives with the others left out: its own partial sum, its own logits."""

    def all_reduce(self, t):
        pass


class _Gathered:
    def __init__(self, parts):
        self.parts = parts

    def all_gather(self, t):
        return self.parts


def test_the_vocabulary_split_over_ranks_embeds_and_projects_as_the_whole():
    from appliance.models.layers.vocab import VocabParallelEmbedding, vocab_parallel_logits

    torch.manual_seed(0)
    whole = torch.randn(10, 4)
    padded = torch.cat([whole, torch.zeros(2, 4)])  # a vocabulary of 10 padded to 12: 6 rows a rank
    ranks = []
    for rank in (0, 1):
        emb = VocabParallelEmbedding(6, 4, 10, TensorParallel(rank, 2, _Alone()))
        emb.weight.data = padded[6 * rank: 6 * rank + 6].clone()
        ranks.append(emb)
    ids = torch.tensor([0, 5, 6, 9, 3])
    other = ranks[1](ids)  # rank 1's rows: zeros for ids it does not hold
    assert torch.equal(other[0], torch.zeros(4)) and torch.equal(other[2], whole[6])
    ranks[0].tp = TensorParallel(0, 2, _SumOfRanks(other))
    assert torch.equal(ranks[0](ids), whole[ids])
    with pytest.raises(ValueError, match=r"a token id is outside the vocabulary \(0..9\)"):
        ranks[0](torch.tensor([10]))
    x = torch.randn(3, 4)
    parts = [x @ padded[:6].T, x @ padded[6:].T]
    logits = vocab_parallel_logits(parts[0], TensorParallel(0, 2, _Gathered(parts)), 10)
    torch.testing.assert_close(logits, x @ whole.T)
    assert vocab_parallel_logits(parts[0], None, 10) is parts[0]

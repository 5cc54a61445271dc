"""Random rows' draws: the inverse of the cumulative distribution, one uniform a row."""

import torch

from appliance.sampling_params import SamplingParams
from appliance.worker.sampler import SampleRequest, inverse_cdf, sample, uniforms


def test_inverse_cdf_gives_each_token_its_share_and_never_one_without_mass():
    """Uniforms on an even grid land on each token in proportion to its mass (rows unnormalized), tokens of zero
    mass (first, inside, last) are never drawn, u = 0 takes the first token with mass, and a product u x total that
    rounds up to the total (u = 1, which no draw gives) the last token with mass."""
    probs = torch.tensor([[0.0, 2.0, 0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0, 3.0, 0.0]])
    grid = (torch.arange(1000, dtype=torch.float64) + 0.5) / 1000
    counts = [torch.bincount(inverse_cdf(row.expand(1000, -1), grid), minlength=6).tolist() for row in probs]
    assert counts == [[0, 500, 0, 250, 250, 0], [0, 0, 0, 0, 1000, 0]]
    edges = inverse_cdf(probs[[0, 0, 1]], torch.tensor([0.0, 1.0, 1.0], dtype=torch.float64))
    assert edges.tolist() == [1, 4, 4]


def test_a_random_row_draws_with_its_own_generator():
    """A seeded row's token is the inverse CDF of its tempered distribution at the first uniform of its own
    generator, whatever rows (unseeded, greedy) share the call."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    seeded = SamplingParams(temperature=0.7, seed=1)
    reqs = [SampleRequest(SamplingParams(temperature=1.0), [1], [], None, ()),
            SampleRequest(seeded, [1], [], torch.Generator().manual_seed(5), ()),
            SampleRequest(SamplingParams(temperature=0.0), [1], [], None, ())]
    tokens, _ = sample(logits, reqs, torch.Generator().manual_seed(9))
    expected = inverse_cdf(torch.softmax(logits[1:2] / 0.7, dim=-1), uniforms(1, torch.Generator().manual_seed(5)))
    assert tokens[1] == int(expected[0])
    assert tokens[2] == int(logits[2].argmax())

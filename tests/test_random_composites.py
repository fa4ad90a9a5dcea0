"""torch's sampling functions on dtorch's random stream (dtorch/torch_api/random_draws.py): the
distributions are torch's (checked on large samples from a fixed seed, with bounds of several
standard errors), the values are the same on every layout for one dtorch.manual_seed, a
compiled call draws what the eager call draws, and the errors are torch's."""
from __future__ import annotations

import pytest
import torch

import dtorch
from dtorch import Replicate, Shard

PROBS = torch.tensor([0.1, 0.0, 0.6, 0.3])


def _layouts(mesh1, mesh4, mesh22):
    return [(mesh1, [Replicate()]), (mesh4, [Shard(0)]), (mesh4, [Shard(1)]), (mesh22, [Shard(0), Shard(1)])]


def _draw(mesh, placements, seed, sample):
    dtorch.manual_seed(seed)
    rows = dtorch.tensor(PROBS.expand(4000, 4).contiguous(), device_mesh=mesh, placements=placements)
    return sample(rows).to_torch()


@pytest.mark.parametrize("replacement", [True, False])
def test_multinomial_draws_torchs_distribution_the_same_on_every_layout(replacement, mesh1, mesh4, mesh22):
    sample = lambda rows: torch.multinomial(rows, 3, replacement=replacement)  # noqa: E731
    draws = [_draw(mesh, placements, 5, sample) for mesh, placements in _layouts(mesh1, mesh4, mesh22)]
    assert all(torch.equal(d, draws[0]) for d in draws), "the layout changed the draws"
    picks = draws[0]
    assert picks.shape == (4000, 3) and picks.dtype == torch.int64
    assert not (picks == 1).any(), "a category of probability 0 was drawn"
    first = torch.bincount(picks[:, 0], minlength=4) / 4000   # the first draw: the probabilities themselves
    assert (first - PROBS).abs().max() < 0.035, first
    if replacement:
        every = torch.bincount(picks.flatten(), minlength=4) / picks.numel()
        assert (every - PROBS).abs().max() < 0.025, every
    else:
        assert all(len(set(row)) == 3 for row in picks.tolist()), "a category drawn twice without replacement"
        # the third draw without replacement is what the first two left: category 0 most often
        third = torch.bincount(picks[:, 2], minlength=4) / 4000
        expected_third = torch.tensor([0.6 * 0.3 / 0.4 + 0.3 * 0.6 / 0.7, 0.0, 0.1 * 0.3 / 0.9 + 0.3 * 0.1 / 0.7,
                                       0.1 * 0.6 / 0.9 + 0.6 * 0.1 / 0.4])
        assert (third - expected_third).abs().max() < 0.035, (third, expected_third)


def test_multinomial_of_one_distribution_and_its_errors(mesh4):
    dtorch.manual_seed(0)
    probs = dtorch.tensor(torch.tensor([0.0, 0.0, 5.0, 0.0]), device_mesh=mesh4, placements=[Shard(0)])
    assert torch.equal(torch.multinomial(probs, 4, replacement=True).to_torch(), torch.full((4,), 2))
    assert probs.multinomial(1).shape == (1,)
    cases = [(lambda t: torch.multinomial(t.reshape(1, 2, 2), 1), "prob_dist must be 1 or 2 dim"),
             (lambda t: torch.multinomial(t.long(), 1), "only supports floating-point dtypes"),
             (lambda t: torch.multinomial(t, 0), "cannot sample n_sample <= 0 samples"),
             (lambda t: torch.multinomial(t, 5), "cannot sample n_sample > prob_dist.size")]
    for call, message in cases:
        for tensor in (probs.to_torch(), probs):
            with pytest.raises(RuntimeError, match=message):
                call(tensor)


def test_bernoulli_and_the_refills_draw_torchs_distributions(mesh1, mesh4, mesh22):
    n = 200_000
    means = []
    for mesh, placements in ((mesh1, [Replicate()]), (mesh4, [Shard(0)]), (mesh22, [Shard(0), Replicate()])):
        dtorch.manual_seed(11)
        x = dtorch.zeros(n, device_mesh=mesh, placements=placements[:mesh.ndim])
        values = [x.bernoulli_(0.3).to_torch(), x.exponential_(2.0).to_torch(), x.geometric_(0.25).to_torch(),
                  x.cauchy_(1.0, 2.0).to_torch(), x.log_normal_(1.0, 0.5).to_torch(),
                  torch.bernoulli(dtorch.full((n,), 0.7, device_mesh=mesh)).to_torch()]
        means.append(values)
    assert all(torch.equal(a, b) for other in means[1:] for a, b in zip(means[0], other)), "layout changed a draw"
    coin, exponential, geometric, cauchy, log_normal, bern = means[0]
    assert set(coin.unique().tolist()) == {0.0, 1.0} and abs(coin.mean() - 0.3) < 0.005
    assert abs(exponential.mean() - 0.5) < 0.005 and exponential.min() >= 0
    assert geometric.min() >= 1 and torch.equal(geometric, geometric.round()) and abs(geometric.mean() - 4) < 0.05
    assert abs(cauchy.median() - 1.0) < 0.03 and abs((cauchy - 1).abs().median() - 2.0) < 0.05   # its scale
    assert abs(log_normal.log().mean() - 1.0) < 0.005 and abs(log_normal.log().std() - 0.5) < 0.005
    assert abs(bern.mean() - 0.7) < 0.005


def test_bernoulli_keeps_the_dtype_and_takes_tensor_probabilities(mesh4):
    dtorch.manual_seed(2)
    counts = dtorch.tensor(torch.arange(8), device_mesh=mesh4, placements=[Shard(0)])
    assert counts.bernoulli_(1.0) is counts and counts.dtype == torch.int64
    assert torch.equal(counts.to_torch(), torch.ones(8, dtype=torch.int64))
    p = dtorch.tensor(torch.tensor([0.0, 1.0] * 4), device_mesh=mesh4, placements=[Replicate()])
    assert torch.equal(counts.float().bernoulli_(p).to_torch(), torch.tensor([0.0, 1.0] * 4))
    assert torch.equal(dtorch.ones(8, device_mesh=mesh4).bernoulli(0.0).to_torch(), torch.zeros(8))


def test_a_compiled_call_draws_what_the_eager_call_draws(mesh4):
    def sample(probs):
        return torch.multinomial(probs, 2), torch.bernoulli(probs)

    compiled = dtorch.compile(sample)
    probs = dtorch.tensor(torch.rand(6, 5, generator=torch.Generator().manual_seed(0)), device_mesh=mesh4,
                          placements=[Shard(0)])
    for seed in (1, 2, 3):
        dtorch.manual_seed(seed)
        eager = [t.to_torch() for t in sample(probs)]
        dtorch.manual_seed(seed)
        replayed = [t.to_torch() for t in compiled(probs)]
        assert all(torch.equal(a, b) for a, b in zip(eager, replayed)), seed
    assert compiled.captures == 1

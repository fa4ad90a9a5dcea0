"""generate(do_sample=True)'s warpers (dtorch/models/sampling.py) against transformers' own
TemperatureLogitsWarper, TopKLogitsWarper and TopPLogitsWarper on the same scores, with the
vocabulary sharded, the batch sharded and both; the draws themselves: tests/test_random_composites.py
(multinomial) and tests/test_llama.py (generate)."""
from __future__ import annotations

import pytest
import torch

import dtorch
from dtorch import Replicate, Shard
from dtorch.models.sampling import sample_next, sampling_scores

logits_process = pytest.importorskip("transformers.generation.logits_process")

SETTINGS = [dict(temperature=1.0, top_k=50, top_p=1.0), dict(temperature=0.7, top_k=5, top_p=1.0),
            dict(temperature=1.3, top_k=None, top_p=0.8), dict(temperature=0.9, top_k=20, top_p=0.5),
            dict(temperature=1.0, top_k=1, top_p=0.95), dict(temperature=2.0, top_k=0, top_p=0.01)]


def _transformers(scores: torch.Tensor, temperature, top_k, top_p) -> torch.Tensor:
    warpers = logits_process.LogitsProcessorList()
    if temperature != 1.0:
        warpers.append(logits_process.TemperatureLogitsWarper(temperature))
    if top_k:
        warpers.append(logits_process.TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(logits_process.TopPLogitsWarper(top_p))
    return warpers(None, scores.clone())


@pytest.mark.parametrize("setting", SETTINGS, ids=str)
def test_the_warpers_equal_transformers(setting, mesh4, mesh22):
    scores = torch.randn(6, 37, generator=torch.Generator().manual_seed(len(str(setting))))
    expected = _transformers(scores, **setting)
    for mesh, placements in ((mesh4, [Shard(1)]), (mesh4, [Shard(0)]), (mesh4, [Replicate()]),
                             (mesh22, [Shard(0), Shard(1)])):
        got = sampling_scores(dtorch.tensor(scores, device_mesh=mesh, placements=placements), **setting).to_torch()
        assert torch.equal(got.isinf(), expected.isinf()), (setting, placements)
        torch.testing.assert_close(got[~got.isinf()], expected[~expected.isinf()])


def test_draws_come_from_what_the_warpers_keep(mesh4):
    scores = torch.randn(400, 30, generator=torch.Generator().manual_seed(9))
    kept = ~_transformers(scores, 0.8, 4, 0.9).isinf()
    dtorch.manual_seed(1)
    tokens = sample_next(dtorch.tensor(scores, device_mesh=mesh4, placements=[Shard(1)]), 0.8, 4, 0.9).to_torch()
    assert tokens.shape == (400,) and kept[torch.arange(400), tokens].all()
    greedy = sample_next(dtorch.tensor(scores, device_mesh=mesh4, placements=[Shard(0)]), top_k=1).to_torch()
    assert torch.equal(greedy, scores.argmax(-1))


def test_refusals_are_transformers(mesh4):
    scores = dtorch.randn(2, 8, device_mesh=mesh4, placements=[Shard(1)])
    for setting, message in ((dict(temperature=0.0), "strictly positive float"), (dict(top_k=-1), "top_k"),
                             (dict(top_p=1.5), "top_p")):
        with pytest.raises(ValueError, match=message):
            sampling_scores(scores, **setting)

"""Random factories: values depend on the seed, the call order, the global shape and the dtype,
never on the mesh or the placements; no worker materializes the whole tensor."""
import itertools

import pytest
import torch

import dtorch
from dtorch.spec.placements import Partial, Replicate, Shard
from support import assert_same

R = Replicate()


def layouts(mesh):
    options = [R, Shard(0), Shard(1)]
    return [list(p) for p in itertools.product(options, repeat=mesh.ndim)]


@pytest.mark.parametrize("factory", ["randn", "rand"])
def test_values_do_not_depend_on_layout(mesh1, mesh4, mesh22, factory):
    reference = None
    for mesh in (mesh1, mesh4, mesh22):
        for placements in layouts(mesh):
            dtorch.manual_seed(1234)
            value = getattr(dtorch, factory)(37, 19, device_mesh=mesh, placements=placements).to_torch()
            if reference is None:
                reference = value
            assert_same(value, reference, exact=True)


def test_replicas_are_identical(mesh4):
    dtorch.manual_seed(7)
    x = dtorch.randn(5, 3, device_mesh=mesh4, placements=[R])
    # subtracting a rank's replica from the Shard(0) view of the same values: all zeros
    dtorch.manual_seed(7)
    y = dtorch.randn(5, 3, device_mesh=mesh4, placements=[Shard(0)])
    assert_same((x - y).to_torch(), torch.zeros(5, 3), exact=True)


def test_sequence_and_statistics(mesh4):
    dtorch.manual_seed(0)
    a = dtorch.randn(256, 256, device_mesh=mesh4, placements=[Shard(0)]).to_torch()
    b = dtorch.randn(256, 256, device_mesh=mesh4, placements=[Shard(0)]).to_torch()
    assert not torch.equal(a, b)
    assert abs(a.mean().item()) < 0.02 and abs(a.std().item() - 1) < 0.02
    u = dtorch.rand(256, 256, device_mesh=mesh4, placements=[Shard(1)]).to_torch()
    assert 0 <= u.min().item() and u.max().item() < 1 and abs(u.mean().item() - 0.5) < 0.01
    dtorch.manual_seed(0)
    assert torch.equal(dtorch.randn(256, 256, device_mesh=mesh4, placements=[R]).to_torch(), a)


def test_randint_and_dtypes(mesh22):
    dtorch.manual_seed(3)
    r = dtorch.randint(-5, 5, (40, 3), device_mesh=mesh22, placements=[Shard(0), R]).to_torch()
    assert r.dtype == torch.int64 and r.min() >= -5 and r.max() < 5 and len(r.unique()) == 10
    for dtype in (torch.float64, torch.bfloat16, torch.float16):
        dtorch.manual_seed(3)
        x = dtorch.randn(9, 4, dtype=dtype, device_mesh=mesh22, placements=[Shard(1), Shard(0)]).to_torch()
        dtorch.manual_seed(3)
        y = dtorch.randn(9, 4, dtype=dtype, device_mesh=mesh22, placements=[R, R]).to_torch()
        assert x.dtype == dtype and torch.equal(x, y)


def test_partial_random_reads_back_the_same_value(mesh4):
    dtorch.manual_seed(11)
    p = dtorch.randn(6, 2, device_mesh=mesh4, placements=[Partial()]).to_torch()
    dtorch.manual_seed(11)
    assert torch.equal(p, dtorch.randn(6, 2, device_mesh=mesh4, placements=[R]).to_torch())


def _draws(mesh, generator=None):
    """Three random calls of different kinds, read back."""
    x = dtorch.randn(6, 5, device_mesh=mesh, placements=[Shard(0)], generator=generator)
    y = dtorch.rand(7, device_mesh=mesh, placements=[R], generator=generator)
    kept = dtorch.nn.functional.dropout(dtorch.ones(9, 4, device_mesh=mesh, placements=[Shard(1)]), 0.5)
    return [t.to_torch() for t in (x, y, kept)]


def test_rng_state_resumes_the_global_stream(mesh4):
    """As torch.get_rng_state / set_rng_state: a checkpoint keeps the tensor, a resume sets it, and
    the random calls after it draw exactly what they drew after the get."""
    dtorch.manual_seed(77)
    _draws(mesh4)
    state = dtorch.get_rng_state()
    assert state.dtype == torch.int64 and state.tolist() == [77, 3] and dtorch.initial_seed() == 77
    first = _draws(mesh4)
    dtorch.manual_seed(5)
    _draws(mesh4)
    dtorch.set_rng_state(state)
    for again, before in zip(_draws(mesh4), first):
        assert_same(again, before, exact=True)


def test_rng_state_rewinds_a_compiled_functions_draws(mesh4):
    noisy = dtorch.compile(lambda t: t + dtorch.randn(4, 3, device_mesh=mesh4, placements=[Shard(0)]))
    x = dtorch.zeros(4, 3, device_mesh=mesh4, placements=[Shard(0)])
    noisy(x), noisy(x)   # captured, then replayed
    state = dtorch.get_rng_state()
    first = noisy(x).to_torch()
    dtorch.set_rng_state(state)
    assert_same(noisy(x).to_torch(), first, exact=True)


def test_a_generators_state_resumes_it_alone(mesh4):
    generator = dtorch.Generator().manual_seed(11)
    _draws(mesh4, generator)
    state, global_state = generator.get_state(), dtorch.get_rng_state()
    first = _draws(mesh4, generator)[:2]
    generator.manual_seed(12)
    assert generator.set_state(state) is generator
    for again, before in zip(_draws(mesh4, generator)[:2], first):
        assert_same(again, before, exact=True)
    assert dtorch.get_rng_state()[0] == global_state[0]   # the global stream's seed is untouched


@pytest.mark.parametrize("state", [torch.get_rng_state(), torch.tensor([1.0, 2.0]), (1, 2, 3), [3, -1]])
def test_a_state_that_is_not_dtorchs_is_refused(state):
    with pytest.raises(TypeError, match=r"dtorch.set_rng_state takes what dtorch.get_rng_state\(\).*not "):
        dtorch.set_rng_state(state)
    with pytest.raises(TypeError, match=r"Generator.set_state takes"):
        dtorch.Generator().set_state(state)

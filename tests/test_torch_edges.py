"""torch's behaviour on edges (issue 43, item 4 and part of 8): what torch refuses is refused at
the user's line, with torch's own words, never a value made up on the workers."""
import pytest
import torch

import dtorch
from dtorch import Replicate, Shard
from dtorch.errors import MeshError, ShapeError

HERE = "test_torch_edges.py:"
EMPTY_REDUCTIONS = {
    "x.max()": (lambda x: x.max(), lambda t: t.max()),
    "x.min()": (lambda x: x.min(), lambda t: t.min()),
    "x.max(0)": (lambda x: x.max(0), lambda t: t.max(0)),
    "torch.amax(x)": (lambda x: torch.amax(x), lambda t: torch.amax(t)),
    "torch.amin(x, 0)": (lambda x: torch.amin(x, 0), lambda t: torch.amin(t, 0)),
    "x.argmax()": (lambda x: x.argmax(), lambda t: t.argmax()),
    "x.argmin(0)": (lambda x: x.argmin(0), lambda t: t.argmin(0)),
}


@pytest.mark.parametrize("name", EMPTY_REDUCTIONS)
@pytest.mark.parametrize("placements", [[Replicate()], [Shard(1)]], ids=["R", "S(1)"])
def test_a_reduction_over_an_empty_dim_is_refused_at_the_call(mesh4, name, placements):
    """The defect: x.max() of a (0, 5) DTensor gave -inf, and x.max(0) failed only at a later read."""
    ours, theirs = EMPTY_REDUCTIONS[name]
    with pytest.raises((RuntimeError, IndexError)) as torch_error:
        theirs(torch.zeros(0, 5))
    x = dtorch.zeros(0, 5, device_mesh=mesh4, placements=placements)
    with pytest.raises(ShapeError) as info:
        ours(x)
    assert str(torch_error.value) in str(info.value) and HERE in str(info.value)


def test_a_reduction_over_a_non_empty_dim_of_an_empty_tensor_works(mesh4):
    x = dtorch.zeros(0, 5, device_mesh=mesh4, placements=[Replicate()])
    values, indices = x.max(1)
    expected = torch.zeros(0, 5).max(1)
    assert torch.equal(values.to_torch(), expected.values) and torch.equal(indices.to_torch(), expected.indices)
    assert x.sum().item() == 0.0   # sum of nothing is 0, as torch's


@pytest.mark.parametrize("factory", ["rand", "randn"])
@pytest.mark.parametrize("dtype", [torch.int8, torch.int64, torch.bool])
def test_random_floats_in_an_integer_dtype_are_refused_as_torch_refuses_them(mesh4, factory, dtype):
    with pytest.raises(RuntimeError, match="not implemented for"):
        getattr(torch, factory)(3, dtype=dtype)
    with pytest.raises(ShapeError, match=rf"{factory}\(dtype=.*{HERE}.*not implemented for.*dtorch.randint"):
        getattr(dtorch, factory)(3, dtype=dtype, device_mesh=mesh4)


@pytest.mark.parametrize("shape", [(2.7,), 2.0, (2, 1.5), (True,), ("2",)])
def test_a_mesh_size_that_is_not_an_integer_is_refused(shape):
    """The defect: a mesh size of 2.7 silently became 2. Refused before any worker starts."""
    with pytest.raises(MeshError, match="mesh_shape must be positive integers"):
        dtorch.init_device_mesh("cpu", shape)


def test_a_local_pool_past_the_limit_needs_an_explicit_setting(monkeypatch):
    """The defect: init_device_mesh("cpu", (1000,)) started 1,063 processes and took 15.6 GB,
    with no guard. Refused before anything starts, saying how many fit, why, and the setting."""
    from dtorch.runtime.controller.cluster import LocalSpawner, local_worker_limit
    monkeypatch.delenv("DTORCH_MAX_LOCAL_WORKERS", raising=False)
    limit, why = local_worker_limit()
    assert limit >= 1 and why
    with pytest.raises(MeshError, match=rf"a pool of {limit + 1} local worker processes: this machine fits "
                                        rf"{limit} by default .*DTORCH_MAX_LOCAL_WORKERS={limit + 1}"):
        LocalSpawner.check_pool_size(None, limit + 1)
    LocalSpawner.check_pool_size(None, limit)
    monkeypatch.setenv("DTORCH_MAX_LOCAL_WORKERS", str(limit + 1))
    LocalSpawner.check_pool_size(None, limit + 1)


def test_a_mesh_past_the_local_limit_is_refused_before_any_start(session):
    import dtorch.runtime.controller.session as sessions
    before = len(sessions.controller().workers)
    with pytest.raises(MeshError, match="DTORCH_MAX_LOCAL_WORKERS=100000"):
        dtorch.init_device_mesh("cpu", (100_000,))
    assert len(sessions.controller().workers) == before

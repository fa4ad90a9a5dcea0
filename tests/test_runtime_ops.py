"""Ops on real workers against plain torch on the same inputs: meshes (1,), (4,), (2,2), even
and uneven shapes, every placement the op accepts."""
import itertools

import pytest
import torch

import dtorch
from dtorch.spec.placements import Partial, Replicate, Shard
from dtorch.errors import PlacementError
from support import assert_same

SHAPES = [(8, 12), (7, 5)]  # even, uneven on a 4-way split


def placement_choices(mesh, ndim, partial=False):
    options = [Replicate()] + [Shard(d) for d in range(ndim)] + ([Partial()] if partial else [])
    return list(itertools.product(options, repeat=mesh.ndim))


def upload(value, mesh, placements):
    return dtorch.tensor(value, device_mesh=mesh, placements=placements)


@pytest.mark.parametrize("shape", SHAPES)
def test_upload_round_trips_every_placement(mesh, shape):
    value = torch.randn(shape)
    for placements in placement_choices(mesh, len(shape), partial=True):
        assert_same(upload(value, mesh, placements).to_torch(), value)


@pytest.mark.parametrize("shape", SHAPES)
def test_elementwise_with_python_operators_and_scalars(mesh, shape):
    a, b = torch.randn(shape), torch.rand(shape) + 0.5
    for placements in placement_choices(mesh, len(shape)):
        x, y = upload(a, mesh, placements), upload(b, mesh, placements)
        assert_same(((x + y) * 2.5 - x / y).to_torch(), (a + b) * 2.5 - a / b)
        assert_same((1 - x).to_torch(), 1 - a)
        assert_same((2.0 / y).to_torch(), 2.0 / b)
        assert_same((-x).to_torch(), -a)
        assert_same((x ** 2).to_torch(), a ** 2)
        assert_same((x > y).to_torch(), a > b)
        assert_same(x.relu().to_torch(), a.relu())
        assert_same((x // y).to_torch(), a // b)
        assert_same((x % y).to_torch(), a % b)
        assert_same((7 // y).to_torch(), 7 // b)
        assert_same((7 % y).to_torch(), 7 % b)
        assert_same((x // 0.3).to_torch(), a // 0.3)
        z, c = x * 1, a.clone()
        z //= 0.5
        c //= 0.5
        assert_same(z.to_torch(), c)


def test_shard_with_replicate_operand_and_broadcast(mesh4):
    a, row = torch.randn(9, 6), torch.randn(6)
    x, r = upload(a, mesh4, [Shard(0)]), upload(row, mesh4, [Replicate()])
    full = upload(a, mesh4, [Replicate()])
    assert_same((x * r).to_torch(), a * row)
    assert_same((x + full).to_torch(), a + a)
    assert (x + full).placements == (Shard(0),)


def test_partial_arithmetic(mesh4, automatic):
    a, b = torch.randn(6, 5), torch.randn(6, 5)
    p, q = upload(a, mesh4, [Partial()]), upload(b, mesh4, [Partial()])
    r = upload(b, mesh4, [Replicate()])
    assert_same((p + q).to_torch(), a + b)
    assert_same((p * r).to_torch(), a * b)
    assert_same((p * 3).to_torch(), a * 3)
    assert_same((p + r).to_torch(), a + b)   # r becomes P(sum) first: a local move
    dtorch.set_strict(True)
    try:
        with pytest.raises(PlacementError, match=r"P\(sum\)"):
            p + r
    finally:
        dtorch.set_strict(False)


@pytest.mark.parametrize("m,k,n", [(8, 12, 4), (7, 5, 3)])
def test_matmul_every_legal_placement_pair(mesh, m, k, n):
    a, b = torch.randn(m, k), torch.randn(k, n)
    checked = 0
    for pa, pb in itertools.product(placement_choices(mesh, 2), repeat=2):
        x, w = upload(a, mesh, pa), upload(b, mesh, pb)
        try:
            z = x @ w
        except PlacementError:
            continue
        assert_same(z.to_torch(), a @ b)
        checked += 1
    assert checked >= 3 ** mesh.ndim


def test_matmul_rank_cases(mesh4):
    cases = [((5,), (5,)), ((5,), (5, 3)), ((4, 5), (5,)), ((2, 4, 5), (5, 3)), ((2, 4, 5), (2, 5, 3))]
    for sa, sb in cases:
        a, b = torch.randn(sa), torch.randn(sb)
        x = upload(a, mesh4, [Shard(0)] if len(sa) > 1 else [Replicate()])
        assert_same(dtorch.matmul(x, upload(b, mesh4, [Replicate()])).to_torch(), torch.matmul(a, b))


@pytest.mark.parametrize("shape", SHAPES)
def test_sum_and_mean(mesh, shape):
    a = torch.randn(shape)
    for placements in placement_choices(mesh, len(shape)):
        x = upload(a, mesh, placements)
        assert_same(x.sum().to_torch(), a.sum())
        assert_same(x.mean().to_torch(), a.mean())
        for dim in (0, 1, -1):
            assert_same(x.sum(dim).to_torch(), a.sum(dim))
            assert_same(x.mean(dim, keepdim=True).to_torch(), a.mean(dim, keepdim=True))
        assert_same(x.amax(0).to_torch(), a.amax(0))


def test_sum_of_partial_stays_partial_until_read(mesh4):
    a = torch.randn(10, 3)
    s = upload(a, mesh4, [Shard(0)]).sum(0)
    assert s.placements == (Partial(),)
    assert_same(s.to_torch(), a.sum(0))


def test_integer_dtypes_are_exact(mesh4):
    a = torch.randint(-50, 50, (9, 4))
    x = upload(a, mesh4, [Shard(0)])
    assert_same((x * 3 + x).sum(0).to_torch(), (a * 3 + a).sum(0), exact=True)


def test_factories(mesh):
    shape = (7, 5)
    for placements in placement_choices(mesh, 2, partial=True):
        kw = dict(device_mesh=mesh, placements=placements)
        assert_same(dtorch.zeros(*shape, **kw).to_torch(), torch.zeros(shape))
        assert_same(dtorch.ones(shape, **kw).to_torch(), torch.ones(shape))
        assert_same(dtorch.full(shape, 2.5, **kw).to_torch(), torch.full(shape, 2.5))
        assert dtorch.empty(shape, **kw).to_torch().shape == torch.Size(shape)
        assert_same(dtorch.eye(7, 5, **kw).to_torch(), torch.eye(7, 5), exact=True)
        assert_same(dtorch.zeros_like(dtorch.ones(shape, **kw)).to_torch(), torch.zeros(shape))
    for placements in placement_choices(mesh, 1):
        kw = dict(device_mesh=mesh, placements=placements)
        assert_same(dtorch.arange(11, **kw).to_torch(), torch.arange(11))
        assert_same(dtorch.arange(1.0, 4.0, 0.25, **kw).to_torch(), torch.arange(1.0, 4.0, 0.25))
        assert_same(dtorch.linspace(-3.3, 7.1, 33, **kw).to_torch(), torch.linspace(-3.3, 7.1, 33), exact=True)


def test_item_tolist_and_repr_do_not_fetch(mesh4):
    x = upload(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), mesh4, [Shard(0)])
    assert "S(0)" in repr(x) and "(2, 2)" in repr(x)
    assert x.sum().item() == 10.0
    assert x.tolist() == [[1.0, 2.0], [3.0, 4.0]]


def test_torch_functions_dispatch_to_dtorch(mesh4):
    a = torch.randn(8, 4)
    x = upload(a, mesh4, [Shard(0)])
    assert_same(torch.add(x, x).to_torch(), a + a)
    assert_same(torch.sum(x, 1).to_torch(), a.sum(1))


def test_results_keep_torch_result_types(mesh4):
    a = torch.randn(6, 5)
    x = dtorch.tensor(a, device_mesh=mesh4, placements=[Shard(0)])
    top = x.max(1)
    assert type(top) is type(a.max(1))
    assert_same(top.values.to_torch(), a.max(1).values)
    assert_same(top.indices.to_torch(), a.max(1).indices)
    (whole,) = x.chunk(1, 1)          # one piece is still a 1-tuple, as in torch
    assert_same(whole.to_torch(), a)

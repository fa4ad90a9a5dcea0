"""Ops whose result's shape depends on the values, as documented blocking reads
(dtorch/torch_api/data_dependent.py, dtorch/dtensor/indexing.py): nonzero, argwhere,
nonzero_static, x[mask] with a DTensor bool mask, masked_select, unique, unique_consecutive and
bincount, against torch on meshes (1,), (4,) and (2, 2), with Shard, Replicate and Partial inputs,
even and uneven shapes, gradients where torch has them; set_sync_debug_mode("error") refuses each
at the caller's line. Also tuple indices (x[(0, 1), (2, 3)]), which torch reads as lists.

Known gaps: unique's and bincount's results carry no gradient (torch's have a grad_fn whose
backward raises "derivative ... is not implemented").
"""
from __future__ import annotations

import pytest
import torch

import dtorch
from dtorch.spec.placements import Partial, Replicate, Shard
from support import assert_same, placed

R, P = Replicate(), Partial()
SHAPES = [(8, 4), (7, 5)]   # even, and uneven over every mesh here


def layouts(mesh):
    return {(1,): [[R]], (4,): [[Shard(0)], [Shard(1)], [R], [P]],
            (2, 2): [[Shard(0), Shard(1)], [Shard(1), R], [P, Shard(0)]]}[tuple(mesh.shape)]


def _sparse(shape, seed):
    g = torch.Generator().manual_seed(seed)
    value = torch.randn(shape, generator=g)
    return value.masked_fill(value.abs() < 0.6, 0), g


def _cases(mesh, exact=False):
    """(torch value, its DTensor, placements); `exact`: P(max) for P(sum), whose random float
    contributions need not add up to exactly 0 where the value is 0."""
    for shape in SHAPES:
        for placements in layouts(mesh):
            placements = [Partial("max") if exact and p == P else p for p in placements]
            value, g = _sparse(shape, hash((shape, str(placements))) % 1000)
            yield value, placed(value, mesh, placements, g), placements


def _replicated(result, mesh):
    return result.placements == tuple([R] * mesh.ndim)


# --- nonzero -----------------------------------------------------------------------------------------
def test_nonzero_and_argwhere_match_torch(mesh):
    for value, x, _ in _cases(mesh, exact=True):
        for got, want in [(torch.nonzero(x), torch.nonzero(value)), (x.nonzero(), value.nonzero()),
                          (torch.argwhere(x), torch.argwhere(value)), (x.argwhere(), value.argwhere()),
                          (torch.nonzero(x.reduce_partials() > 0), torch.nonzero(value > 0))]:
            assert isinstance(got, dtorch.DTensor) and _replicated(got, mesh) and got.device_mesh == mesh
            assert_same(got.to_torch(), want)
        got, want = x.nonzero(as_tuple=True), value.nonzero(as_tuple=True)
        assert len(got) == len(want)
        for one, expected in zip(got, want):
            assert_same(one.to_torch(), expected)
        assert_same(torch.nonzero_static(x, size=5).to_torch(), torch.nonzero_static(value, size=5))


def test_nonzero_of_a_0d_and_an_empty_tensor(mesh1):
    for value in (torch.tensor(3.0), torch.tensor(0.0), torch.zeros(0, 3), torch.zeros(4, 3)):
        x = dtorch.tensor(value, device_mesh=mesh1)
        assert_same(torch.nonzero(x).to_torch(), torch.nonzero(value))
        for one, expected in zip(x.nonzero(as_tuple=True), value.nonzero(as_tuple=True)):
            assert_same(one.to_torch(), expected)


def test_nonzero_positions_index_back_on_the_workers(mesh4):
    value, g = _sparse((7, 5), 3)
    x = placed(value, mesh4, [Shard(0)], g)
    rows, cols = torch.nonzero(x, as_tuple=True)
    assert_same(x[rows, cols].to_torch(), value[value != 0])


# --- x[mask] with a DTensor mask ------------------------------------------------------------------------
def test_dtensor_mask_read_matches_torch_with_gradients(mesh):
    for value, x, placements in _cases(mesh):
        leaf = x.detach().requires_grad_()
        reference = value.clone().requires_grad_()
        mask_value = value > 0
        weights = torch.randn(int(mask_value.sum()))
        mask = dtorch.tensor(mask_value, device_mesh=mesh, placements=placements if P not in placements else None)
        got = leaf[mask]
        assert got.device_mesh == mesh
        assert_same(got.to_torch(), value[mask_value])
        (got * dtorch.tensor(weights, device_mesh=mesh)).sum().backward()
        (reference[mask_value] * weights).sum().backward()
        assert_same(leaf.grad.to_torch(), reference.grad)


def test_dtensor_masks_over_some_dims_beside_other_indices(mesh, automatic):   # 1:3 on a sharded dim
    for value, x, _ in _cases(mesh):
        rows, cols = value[:, 0] > 0, value[0] != 0
        row_mask = dtorch.tensor(rows, device_mesh=mesh)
        col_mask = dtorch.tensor(cols, device_mesh=mesh)
        assert_same(x[row_mask].to_torch(), value[rows])
        assert_same(x[:, col_mask].to_torch(), value[:, cols])
        assert_same(x[row_mask, 1:3].to_torch(), value[rows, 1:3])
        assert_same(x[..., col_mask, None].to_torch(), value[..., cols, None])
        assert_same(x[dtorch.tensor(torch.tensor(True), device_mesh=mesh)].to_torch(), value[torch.tensor(True)])


def test_dtensor_mask_writes_read_nothing(mesh4):
    value, g = _sparse((7, 5), 5)
    x = placed(value, mesh4, [Shard(0)], g)
    mask = x > 0
    before = dtorch.stats()["blocking_reads"]
    dtorch.set_sync_debug_mode("error")
    try:
        x[mask] = 0.0                        # a where on the workers
    finally:
        dtorch.set_sync_debug_mode("default")
    assert dtorch.stats()["blocking_reads"] == before
    assert_same(x.to_torch(), value.masked_fill(value > 0, 0.0))
    y = placed(value, mesh4, [Shard(0)], g)
    y[:, dtorch.tensor(value[0] != 0, device_mesh=mesh4)] = -1.0   # beside a slice: reads the mask
    want = value.clone()
    want[:, value[0] != 0] = -1.0
    assert_same(y.to_torch(), want)


# --- masked_select --------------------------------------------------------------------------------------
def test_masked_select_matches_torch_with_broadcasting_and_gradients(mesh):
    for value, x, _ in _cases(mesh):
        for mask_value in (value > 0, value[:1] > 0, value[:, :1] != 0, torch.tensor(True)):
            leaf = x.detach().requires_grad_()
            reference = value.clone().requires_grad_()
            mask = dtorch.tensor(mask_value, device_mesh=mesh)
            got = torch.masked_select(leaf, mask)
            assert got.device_mesh == mesh
            assert_same(got.to_torch(), torch.masked_select(value, mask_value))
            assert_same(leaf.masked_select(mask).to_torch(), value.masked_select(mask_value))
            got.sum().backward()
            torch.masked_select(reference, mask_value).sum().backward()
            assert_same(leaf.grad.to_torch(), reference.grad)


def test_masked_select_with_a_torch_mask_or_a_torch_input(mesh4):
    value, g = _sparse((7, 5), 7)
    x = placed(value, mesh4, [Shard(1)], g)
    assert_same(torch.masked_select(x, value > 0).to_torch(), value[value > 0])
    mask = dtorch.tensor(value > 0, device_mesh=mesh4, placements=[Shard(0)])
    assert_same(torch.masked_select(value, mask).to_torch(), value[value > 0])
    with pytest.raises(RuntimeError, match="BoolTensor"):
        torch.masked_select(x, x)


# --- unique ----------------------------------------------------------------------------------------------
UNIQUE_CALLS = [dict(), dict(sorted=True, return_inverse=True), dict(return_counts=True),
                dict(return_inverse=True, return_counts=True), dict(dim=0, return_inverse=True),
                dict(dim=1, return_counts=True)]


def _same_results(got, want):
    if isinstance(want, torch.Tensor):
        got, want = (got,), (want,)
    assert len(got) == len(want)
    for one, expected in zip(got, want):
        assert isinstance(one, dtorch.DTensor)
        assert_same(one.to_torch(), expected)


def test_unique_matches_torch(mesh):
    for shape in SHAPES:
        g = torch.Generator().manual_seed(sum(shape))
        value = torch.randint(0, 4, shape, generator=g)
        for placements in layouts(mesh):   # P(max): a P(sum)'s random contributions would round
            placements = [Partial("max") if p == P else p for p in placements]
            reference = value.float() if Partial("max") in placements else value
            x = placed(reference, mesh, placements, g)
            for kwargs in UNIQUE_CALLS:
                _same_results(torch.unique(x, **kwargs), torch.unique(reference, **kwargs))
                _same_results(x.unique(**kwargs), reference.unique(**kwargs))
            for kwargs in (dict(), dict(return_inverse=True, return_counts=True), dict(dim=1)):
                _same_results(torch.unique_consecutive(x, **kwargs), torch.unique_consecutive(reference, **kwargs))
                _same_results(x.unique_consecutive(**kwargs), reference.unique_consecutive(**kwargs))


def test_unique_inverse_keeps_the_input_placements(mesh22):
    value = torch.randint(0, 3, (7, 5), generator=torch.Generator().manual_seed(1))
    x = dtorch.tensor(value, device_mesh=mesh22, placements=[Shard(0), Shard(1)])
    values, inverse = torch.unique(x, return_inverse=True)
    assert _replicated(values, mesh22) and inverse.placements == (Shard(0), Shard(1))
    assert_same(values.to_torch()[inverse.to_torch()], value)


# --- bincount --------------------------------------------------------------------------------------------
def test_bincount_matches_torch_with_weights(mesh):
    for length in (8, 7):
        g = torch.Generator().manual_seed(length)
        value = torch.randint(0, 6, (length,), generator=g)
        weights = torch.randn(length, generator=g)
        for placements in ([[R]] if tuple(mesh.shape) == (1,)
                           else [[Shard(0)] + [R] * (mesh.ndim - 1), [R] * mesh.ndim]):
            x = dtorch.tensor(value, device_mesh=mesh, placements=placements)
            w = dtorch.tensor(weights, device_mesh=mesh, placements=placements).requires_grad_()
            assert_same(torch.bincount(x).to_torch(), torch.bincount(value))
            assert_same(x.bincount(minlength=10).to_torch(), value.bincount(minlength=10))
            got = torch.bincount(x, w, minlength=3)
            assert_same(got.to_torch(), torch.bincount(value, weights, minlength=3))
            assert not got.requires_grad   # torch's bincount has no derivative either
            assert_same(torch.bincount(x, w.double()).to_torch(), torch.bincount(value, weights.double()))


def test_bincount_refuses_as_torch_does(mesh4):
    empty = dtorch.tensor(torch.zeros(0, dtype=torch.long), device_mesh=mesh4)
    assert_same(torch.bincount(empty, minlength=4).to_torch(), torch.bincount(torch.zeros(0, dtype=torch.long),
                                                                             minlength=4))
    for bad in (torch.tensor([1, -1, 2]), torch.tensor([[1, 2]]), torch.tensor([1.0, 2.0])):
        with pytest.raises(RuntimeError, match="non-negative integral"):
            torch.bincount(dtorch.tensor(bad, device_mesh=mesh4))


def test_out_is_refused_with_what_to_write(mesh22):
    x = dtorch.tensor(torch.ones(4, 4), device_mesh=mesh22, placements=[Shard(0), R])
    with pytest.raises(dtorch.UnsupportedOpError, match=r"torch.nonzero.*test_data_dependent.py.*\[S\(0\), R\]"
                                                        r".*result = torch.nonzero"):
        torch.nonzero(x, out=torch.empty(0, dtype=torch.long))


# --- each is a blocking read: counted, and named at the caller's line -------------------------------------
def _calls(x, mask, columns, index):
    return {"torch.nonzero": lambda: torch.nonzero(x), "x.nonzero": lambda: x.nonzero(as_tuple=True),
            "torch.argwhere": lambda: torch.argwhere(x), "x[mask]": lambda: x[mask],
            "x[:, mask]": lambda: x[:, columns], "torch.masked_select": lambda: torch.masked_select(x, mask),
            "torch.unique": lambda: torch.unique(x), "x.unique": lambda: x.unique(dim=0),
            "torch.unique_consecutive": lambda: torch.unique_consecutive(x),
            "torch.bincount": lambda: torch.bincount(index)}


def test_each_is_one_counted_blocking_read(mesh4):
    x = dtorch.tensor(torch.randn(7, 5), device_mesh=mesh4, placements=[Shard(0)])
    index = dtorch.tensor(torch.tensor([1, 4, 1]), device_mesh=mesh4)
    columns = dtorch.tensor(torch.tensor([True, False, True, True, False]), device_mesh=mesh4)
    for name, call in _calls(x, x > 0, columns, index).items():
        before = dtorch.stats()["blocking_reads"]
        call()
        assert dtorch.stats()["blocking_reads"] == before + 1, name


def test_sync_debug_error_refuses_each_at_the_callers_line(mesh22):
    x = dtorch.tensor(torch.randn(7, 5), device_mesh=mesh22, placements=[Shard(0), Shard(1)])
    index = dtorch.tensor(torch.tensor([1, 4, 1]), device_mesh=mesh22)
    columns = dtorch.tensor(torch.tensor([True, False, True, True, False]), device_mesh=mesh22)
    calls = _calls(x, x > 0, columns, index)
    dtorch.set_sync_debug_mode("error")
    try:
        for name, call in calls.items():
            with pytest.raises(dtorch.BlockingReadError, match=r"test_data_dependent.py:\d+") as info:
                call()
            assert "blocking read" in str(info.value), name
    finally:
        dtorch.set_sync_debug_mode("default")


# --- tuple indices: torch reads a tuple inside an index as a list ------------------------------------------
def test_tuple_indices_match_torch(mesh, automatic):   # ints and slices on sharded dims too
    for value, x, _ in _cases(mesh):
        odd_rows = tuple(bool(row % 2) for row in range(value.shape[0]))   # a tuple of bools: a mask
        for index in [((0, 1), (2, 3)), ((0, 2),), (slice(None), (1, 3)), ((0, 1), slice(1, None), None),
                      (Ellipsis, (0, -1)), (odd_rows,), ((0, 1), [2, 3]), (((0, 1), (1, 2)), 0)]:
            assert_same(x[index].to_torch(), value[index])
        leaf, reference = x.detach().requires_grad_(), value.clone().requires_grad_()
        leaf[(0, 2, 2), (1, 0, 1)].sum().backward()
        reference[(0, 2, 2), (1, 0, 1)].sum().backward()
        assert_same(leaf.grad.to_torch(), reference.grad)


def test_tuple_index_writes_match_torch(mesh4):
    value, g = _sparse((7, 5), 11)
    for placements in ([Shard(0)], [Shard(1)], [R]):
        x = placed(value, mesh4, placements, g)
        x[(0, 1), (2, 3)] = -1.0
        x[:, (4,)] = dtorch.tensor(torch.full((7, 1), 2.0), device_mesh=mesh4)
        want = value.clone()
        want[(0, 1), (2, 3)] = -1.0
        want[:, (4,)] = 2.0
        assert_same(x.to_torch(), want)


def test_index_put_with_a_dtensor_mask_reads_it(mesh4):
    value, g = _sparse((6, 4), 13)
    rows = torch.tensor([True, False, True, False, True, True])
    x = placed(value, mesh4, [Shard(1)], g)
    x.index_put_((dtorch.tensor(rows, device_mesh=mesh4),), dtorch.tensor(torch.tensor(5.0), device_mesh=mesh4))
    assert_same(x.to_torch(), value.index_put((rows,), torch.tensor(5.0)))


def test_a_compiled_function_refuses_the_read_at_its_line(mesh4):
    x = dtorch.tensor(torch.randn(6, 4), device_mesh=mesh4, placements=[Shard(0)])

    @dtorch.compile
    def positive_sum(x):
        return x[x > 0].sum()
    with pytest.raises(dtorch.CompileError, match=r"a read .*test_data_dependent.py:\d+, inside compiled"):
        positive_sum(x)


def test_sync_debug_warn_names_the_op_and_the_line(mesh4):
    x = dtorch.tensor(torch.randn(7, 5), device_mesh=mesh4, placements=[Shard(0)])
    dtorch.set_sync_debug_mode("warn")
    try:
        with pytest.warns(dtorch.BlockingReadWarning, match=r"torch.unique\(x\) .*test_data_dependent.py:\d+"):
            torch.unique(x)
        with pytest.warns(dtorch.BlockingReadWarning, match=r"x\[mask\] .*test_data_dependent.py:\d+"):
            x[x > 0]
    finally:
        dtorch.set_sync_debug_mode("default")

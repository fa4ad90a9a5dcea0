"""Advanced (tensor) indexing against torch: x[t], x[t] = v, index_put(_), masked_scatter(_)
(dtorch/dtensor/indexing.py, dtorch/ops/advanced_indexing.py), on meshes (1,), (2,), (2,2) with
Shard, Replicate and Partial inputs, even and uneven shapes, every index form: torch and DTensor
index tensors, lists, masks the controller holds, tuples mixing them with ints, slices, None and
Ellipsis. The sweep and the validator cover the registered ops from their samples as well.

A DTensor bool mask in a read (x[mask]: its shape depends on its values) is a blocking read of the
mask: tests/test_data_dependent.py. Known gap (it raises, never a wrong value): an int or a slice
other than `:` on a sharded dim next to index tensors (the automatic redistribute replicates that
dim first; strict mode raises).
"""
from __future__ import annotations

import random
import warnings

import numpy as np
import pytest
import torch

import dtorch
from dtorch.spec.placements import Partial, Replicate, Shard, init_device_mesh
from dtorch.errors import PlacementError, UnsupportedOpError
from dtorch.ops.advanced_indexing import index, layout, torch_items
from dtorch.ops.indexing import WHOLE
from support import assert_same, placed

R, P = Replicate(), Partial()


@pytest.fixture(scope="module")
def mesh2(session):
    return init_device_mesh("cpu", (2,))


def layouts(mesh1, mesh2, mesh22):
    return [(mesh1, [R]), (mesh2, [Shard(0)]), (mesh2, [Shard(1)]), (mesh2, [R]), (mesh2, [P]),
            (mesh22, [Shard(0), Shard(1)]), (mesh22, [Shard(1), Shard(0)]), (mesh22, [P, Shard(0)])]


def _up(value, mesh, placements=None):
    return dtorch.tensor(value, device_mesh=mesh, placements=placements or [R] * mesh.ndim)


# --- the pure part: where each dim goes, as torch puts it ------------------------------------------
def test_layout_matches_torch_on_random_indices():
    rng, checked = random.Random(0), 0
    for _ in range(1500):
        shape = tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 4)))
        items, dim = [], 0
        while dim < len(shape) and rng.random() < 0.9:
            kind = rng.choice(["int", "whole", "slice", "none", "t1", "t2", "t0", "bool"])
            if kind in ("none", "bool"):
                items.append(None if kind == "none" else rng.random() < 0.8)
                continue
            size, dim = shape[dim], dim + 1
            items.append({"int": lambda: rng.randrange(size), "whole": lambda: WHOLE,
                          "slice": lambda: (0, size, 2), "t0": lambda: torch.tensor(rng.randrange(size)),
                          "t1": lambda: torch.randint(0, size, (2,)),
                          "t2": lambda: torch.randint(0, size, (rng.choice([1, 2]), 2))}[kind]())
        try:
            want = torch.zeros(shape)[torch_items(items)]
        except (IndexError, RuntimeError):
            continue   # not broadcastable: torch refuses, and so does meta inference
        checked += 1
        lay = layout(items, len(shape))
        assert lay.ndim == want.ndim and want.shape[lay.block:lay.block + len(lay.block_shape)] == lay.block_shape
        for dim, out in lay.kept.items():   # a kept dim's coordinate varies along its result dim only
            coordinate = torch.arange(shape[dim]).reshape([-1 if d == dim else 1 for d in range(len(shape))])
            got = coordinate.expand(shape)[torch_items(items)]
            if got.numel():
                moved = got.movedim(out, 0).reshape(got.shape[out], -1)
                assert bool((moved == moved[:, :1]).all()), (shape, items)
        meta_items = [i.to("meta") if isinstance(i, torch.Tensor) else i for i in items]
        assert index(torch.empty(shape, device="meta"), meta_items).shape == want.shape
    assert checked > 1000


# --- reads ---------------------------------------------------------------------------------------------
def _read_forms(shape):
    rows, columns = shape
    return [torch.tensor([1, 0, -1, 2, 2]), [2, 0], (slice(None), torch.tensor([1, -1, 0])),
            (torch.tensor([[0, 1], [2, 2]]), torch.tensor([1, 0])), (..., torch.tensor([0, 2])),
            (None, torch.tensor([1, 2]), slice(None), None), (torch.tensor([1, 0]), 1), (1, [0, 2]),
            torch.arange(rows) % 2 == 0, [True] * (rows - 1) + [False], (slice(None), torch.arange(columns) > 0),
            (slice(1, None), torch.tensor([0, 1])), (torch.tensor(1), [0, 1]), (True, [0, 2]),
            np.array([2, 1]), ([0, 2], slice(None, None, 2))]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("shape", [(8, 4), (7, 5)])
def test_reads_match_torch(shape, mesh1, mesh2, mesh22):
    g = torch.Generator().manual_seed(1)
    a = torch.randn(shape, generator=g)
    checks = []
    for mesh, placements in layouts(mesh1, mesh2, mesh22):
        x = placed(a, mesh, placements, g)
        for form in _read_forms(shape):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                checks.append((x[form].fetch(), a[form], f"{placements} {form}"))
    for future, want, _what in checks:
        assert_same(future.result(timeout=60), want)


@pytest.mark.parametrize("shape", [(8, 4), (7, 5)])
def test_dtensor_indices_on_every_placement(shape, mesh2, mesh22):
    g = torch.Generator().manual_seed(2)
    a, t = torch.randn(shape, generator=g), torch.tensor([[3, 0, -1], [1, 1, 2]])
    cube = torch.randn(3, 4, 5, generator=g)
    for mesh, xp, tp in [(mesh2, [R], [Shard(0)]), (mesh2, [R], [Shard(1)]), (mesh2, [Shard(0)], [R]),
                         (mesh2, [Shard(1)], [R]), (mesh2, [P], [R]), (mesh22, [Shard(0), R], [R, Shard(1)]),
                         (mesh22, [Shard(1), Shard(0)], [R, R]), (mesh22, [P, R], [R, Shard(0)])]:
        x, dt = placed(a, mesh, xp, g), _up(t, mesh, tp)
        assert_same(x[dt].to_torch(), a[t])
        assert_same(x[:, dtorch.remainder(dt, shape[1])].to_torch(), a[:, t % shape[1]])
    x = _up(cube, mesh22, [Shard(1), Shard(2)])   # separated by a slice: the broadcast dims go first
    i, j = _up(torch.tensor([2, 0]), mesh22), _up(torch.tensor([[4], [1]]), mesh22, [Shard(0), R])
    assert_same(x[i, :, j].to_torch(), cube[torch.tensor([2, 0]), :, torch.tensor([[4], [1]])])


def test_result_placements_follow_the_rules(mesh2, mesh22):
    a = torch.arange(40.).reshape(8, 5)
    t = torch.tensor([1, 6, 3])
    cases = [(mesh2, [Shard(1)], t, [Shard(1)]),              # a dim no index touches keeps its shard
             (mesh2, [Shard(0)], t, [P]),                     # gather along a sharded dim: P(sum)
             (mesh2, [P], t, [P]),                            # selection copies contributions
             (mesh22, [Shard(0), Shard(1)], (t, slice(None)), [P, Shard(1)])]
    for mesh, placements, form, want in cases:
        x = _up(a, mesh, placements)
        y = x[form]
        assert list(y.placements) == want and torch.equal(y.to_torch(), a[form])
    x, dt = _up(a, mesh2), _up(torch.tensor([[1, 2], [7, 0]]), mesh2, [Shard(1)])
    assert list(x[dt].placements) == [Shard(1)] and list(x[:, dtorch.remainder(dt, 5)].placements) == [Shard(2)]
    flags = _up(torch.arange(8) % 3 == 0, mesh2, [Shard(0)])   # a bool input: P(max) (an OR) instead
    assert (list(flags[t].placements) == [Partial("max")]
            and torch.equal(flags[t].to_torch(), torch.arange(8)[t] % 3 == 0))


def test_bad_indices_raise_as_torch_does(mesh2):
    a = torch.randn(4, 3)
    x = _up(a, mesh2, [Shard(0)])
    for form in [torch.tensor([4]), [0, -5], torch.tensor([True, False]), torch.tensor([1.0]),
                 (torch.tensor([0]), torch.tensor([0]), torch.tensor([0]))]:
        with pytest.raises(IndexError) as ours:
            x[form]
        with pytest.raises(IndexError) as theirs:
            a[form]
        assert str(ours.value).split()[0] == str(theirs.value).split()[0], (form, ours.value, theirs.value)
    far = _up(torch.tensor([1, 9]), mesh2)   # values only the workers see: the error comes at the read
    with pytest.raises(dtorch.RemoteError, match="out of bounds"):
        x[far].to_torch()


def test_automatic_redistribute_and_strict_mode(mesh2, automatic):
    a, t = torch.randn(6, 4), torch.tensor([5, 0, 2, 2])
    x, dt = _up(a, mesh2, [Shard(0)]), _up(t, mesh2, [Shard(0)])
    before = dtorch.stats()["redistributes_inserted"]
    assert torch.equal(x[dt].to_torch(), a[t])                     # x and index both split: one moves
    assert torch.equal(x[2:, dtorch.remainder(dt, 4)].to_torch(), a[2:, t % 4])     # a slice on the sharded dim
    assert dtorch.stats()["redistributes_inserted"] > before
    dtorch.set_strict(True)
    try:
        with pytest.raises(PlacementError, match=r"index: inputs \[S\(0\)\].*both split.*Legal there"):
            x[dt]
        with pytest.raises(PlacementError, match="index_put"):
            x[dt] = 1.0
    finally:
        dtorch.set_strict(False)


# --- writes --------------------------------------------------------------------------------------------
def _write_forms(shape):
    rows, columns = shape
    g = torch.Generator().manual_seed(3)
    return [(torch.tensor([1, 0, -1]), 2.5), (torch.tensor([2, 0]), torch.randn(2, columns, generator=g)),
            ((slice(None), torch.tensor([1, -1])), torch.randn(rows, 2, generator=g)),
            ((slice(None), [0, 2]), torch.randn(2, generator=g)),
            ((torch.tensor([0, 3]), torch.tensor([1, 0])), torch.randn(2, generator=g)),
            (torch.arange(rows) % 3 == 1, -1.0), ([True] + [False] * (rows - 1), torch.randn(columns, generator=g)),
            ((Ellipsis, torch.tensor([0])), torch.randn(rows, 1, generator=g)), ((torch.tensor(2), [1, 0]), 7.0)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("shape", [(8, 4), (7, 5)])
def test_writes_match_torch_and_keep_placements(shape, mesh1, mesh2, mesh22):
    g = torch.Generator().manual_seed(4)
    a = torch.randn(shape, generator=g)
    for mesh, placements in layouts(mesh1, mesh2, mesh22):
        for form, value in _write_forms(shape):
            x, want = placed(a, mesh, placements, g), a.clone()
            x[form] = value
            want[form] = value
            assert list(x.placements) == placements
            assert_same(x.to_torch(), want)


def test_sharded_writes_take_no_communication(mesh2, mesh22, strict):
    a = torch.randn(8, 6)
    for mesh, placements in [(mesh2, [Shard(0)]), (mesh22, [Shard(0), Shard(1)])]:
        x, want = _up(a, mesh, placements), a.clone()
        rows, value = torch.tensor([7, 0, 3]), torch.randn(3, 6)
        before = dtorch.stats()["redistributes_inserted"]
        x[_up(rows, mesh)] = _up(value, mesh)                   # strict: a collective would raise
        want[rows] = value
        cache = _up(torch.zeros(4, 8, 6), mesh, [Shard(1)] + ([Shard(2)] if mesh.ndim == 2 else []))
        k = _up(torch.ones(4, 8, 6), mesh, cache.placements)
        cache[_up(torch.tensor([2]), mesh)] = k[:1]             # x[:, t] style write, value aligned
        assert dtorch.stats()["redistributes_inserted"] == before
        assert torch.equal(x.to_torch(), want) and cache.to_torch()[2].eq(1).all() and cache.to_torch()[0].eq(0).all()


def test_index_put_and_accumulate(mesh2, mesh22):
    a, rows = torch.randn(7, 3), torch.tensor([1, 5, 1, 0])
    value = torch.randn(4, 3)
    for mesh, placements in [(mesh2, [Shard(0)]), (mesh2, [R]), (mesh22, [Shard(0), Shard(1)]), (mesh2, [P])]:
        x = placed(a, mesh, placements, torch.Generator().manual_seed(5))
        got = x.index_put((rows,), _up(value, mesh), accumulate=True)
        assert_same(got.to_torch(), a.index_put((rows,), value, accumulate=True))
        assert_same(torch.index_put(x, (_up(rows[1:], mesh),), _up(value[1:], mesh)).to_torch(),
                    a.index_put((rows[1:],), value[1:]))
        # torch's function with a local index tensor: uploaded Replicate as a constant (docs/reference/ops.md)
        assert_same(torch.index_put(x, (rows[1:],), _up(value[1:], mesh)).to_torch(),
                    a.index_put((rows[1:],), value[1:]))
        y = x.clone()
        y.index_put_((torch.tensor([True, False, False, True, False, False, True]),), torch.tensor(2.0))
        assert_same(y.to_torch(), a.index_put((torch.tensor([0, 3, 6]),), torch.tensor(2.0)))
        assert list(y.placements) == placements


def test_masked_scatter_and_dtensor_mask_writes(mesh2, mesh22):
    g = torch.Generator().manual_seed(6)
    a, source = torch.randn(7, 5, generator=g), torch.randn(40, generator=g)
    mask, row_mask = torch.rand(7, 5, generator=g) > 0.5, torch.rand(7, generator=g) > 0.5
    for mesh, placements in [(mesh2, [Shard(0)]), (mesh2, [Shard(1)]), (mesh2, [R]), (mesh22, [Shard(1), Shard(0)])]:
        x, m, s = _up(a, mesh, placements), _up(mask, mesh), _up(source, mesh)
        assert_same(x.masked_scatter(m, s).to_torch(), a.masked_scatter(mask, source))
        assert_same(torch.masked_scatter(x, m[0], s).to_torch(), a.masked_scatter(mask[0], source))
        rows = _up(row_mask, mesh)
        for value in (0.5, torch.randn(5, generator=g), torch.randn(1, 5, generator=g),
                      torch.randn(int(row_mask.sum()), 5, generator=g)):
            y, want = x.clone(), a.clone()
            y[rows] = value if not isinstance(value, torch.Tensor) else _up(value, mesh)
            want[row_mask] = value
            assert list(y.placements) == placements and torch.equal(y.to_torch(), want)
        y = x.clone()
        y.masked_scatter_(m, s)
        assert torch.equal(y.to_torch(), a.masked_scatter(mask, source)) and list(y.placements) == placements
    with pytest.raises(UnsupportedOpError, match="masked_scatter_"):
        x[rows] = _up(torch.randn(3, 2), mesh22)


def test_writes_follow_the_aliasing_rules(mesh2):
    a = torch.arange(24.).reshape(6, 4)
    x = _up(a, mesh2, [Shard(0)])
    view, want = x[1:3], a.clone()
    x[torch.tensor([1, 4])] = -1.0                        # the base changes: its view is re-derived
    want[torch.tensor([1, 4])] = -1.0
    assert torch.equal(view.to_torch(), want[1:3])
    x.T[torch.tensor([0, 3])] = 9.0                       # through a view: written back into x
    want.T[torch.tensor([0, 3])] = 9.0
    assert torch.equal(x.to_torch(), want) and torch.equal(view.to_torch(), want[1:3])
    copy = x[torch.tensor([0, 1])]                        # a tensor index copies, as in torch
    x.zero_()
    assert torch.equal(copy.to_torch(), want[torch.tensor([0, 1])])

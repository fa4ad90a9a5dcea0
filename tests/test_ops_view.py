"""Shape, view and indexing ops (dtorch/ops/view.py, indexing.py): their rules without processes,
the user-facing spellings (x.T, x[1:3], x.view((r, c)), ...) against torch, and the edges.

The placement sweep of these ops (every input placement combination on meshes (4,), (2,2) and
(2,1,2), even and uneven shapes) is the shared one, tests/test_ops_sweep.py, over the same cases as
sample calls in dtorch/ops/tooling/view_samples.py and indexing_samples.py; the sweep's docstring
lists the known gaps, each refused with a PlacementError that names the redistribute to run first
(test_known_gaps_still_refuse pins a sample). Other gaps:
  - tensor (advanced) indexing x[idx] is tests/test_indexing.py's (x[dtensor_mask] reads the mask:
    tests/test_data_dependent.py).
  - view(dtype) is unsupported. Views and in-place ops: tests/test_inplace.py (docs/reference/inplace.md).
"""
import math

import pytest
import torch

import dtorch
from dtorch.spec.placements import DeviceMesh, Partial, Replicate, Shard, init_device_mesh
from dtorch.errors import MeshError, PlacementError, UnsupportedOpError
from dtorch.ops.dispatch import plan_call
from dtorch.ops.indexing import WHOLE, AdvancedIndex, canonical_index
from dtorch.ops.dispatch import lookup
from dtorch.ops.view import reshape_groups
from support import assert_same
from support import Symbol

R, P = Replicate(), Partial()


@pytest.fixture(scope="module")
def mesh212(session):
    return init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=["pp", "dp", "tp"])


# --- the pure layer: rules without processes ----------------------------------------------------
MESH4 = DeviceMesh("cpu", [0, 1, 2, 3])
MESH22 = DeviceMesh("cpu", [[0, 1], [2, 3]], ["dp", "tp"])


def out_placements(op, *args, **kwargs):
    specs = []
    for value in list(args) + list(kwargs.values()):
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, Symbol):
                specs.append(item._meta)
    return [spec.placements for spec in plan_call(lookup(op), args, kwargs, specs, strict=True).out_specs]


def test_reshape_groups_pair_equal_products():
    assert reshape_groups((8, 6), (48,)) == [((0, 1), (0,))]
    assert reshape_groups((48,), (8, 6)) == [((0,), (0, 1))]
    assert reshape_groups((4, 6), (8, 3)) == [((0, 1), (0, 1))]
    assert reshape_groups((4, 1, 6), (4, 6)) == [((0,), (0,)), ((1,), ()), ((2,), (1,))]
    assert reshape_groups((2, 3), (1, 6, 1)) == [((), (0,)), ((0, 1), (1,)), ((), (2,))]


@pytest.mark.parametrize("shape,placements,new_shape,out", [
    ((8, 6), [Shard(0)], (48,), [Shard(0)]),            # merged, evenly: shards stay contiguous
    ((48,), [Shard(0)], (8, 6), [Shard(0)]),            # split keeping shard boundaries
    ((3, 2), [Shard(0)], (6,), [Shard(0)]),             # uneven, yet the same torch.chunk blocks
    ((8, 8), [Shard(1)], (8, 4, 2), [Shard(1)]),
    ((4, 6), [Shard(0)], (8, 3), [Shard(0)]),           # regrouped: 6 elements = 2 rows of 3
    ((8, 6), [P], (48,), [P]),
    ((8, 6), [Shard(0), Shard(0)], (48,), [Shard(0), Shard(0)]),
])
def test_reshape_keeps_clean_shards(shape, placements, new_shape, out):
    mesh = MESH22 if len(placements) == 2 else MESH4
    assert out_placements("reshape", Symbol(shape, placements, mesh), new_shape) == [tuple(out)]


@pytest.mark.parametrize("shape,placements,new_shape,why", [
    ((7, 6), [Shard(0)], (42,), "do not fall on"),      # 2,2,2,1 rows -> 12,12,12,6 vs chunks of 11
    ((48,), [Shard(0)], (6, 8), "do not fall on"),      # 12-element blocks split rows of 8
    ((8, 6), [Shard(1)], (48,), "inner dim"),           # columns are not contiguous once merged
    ((8, 1), [Shard(1)], (8,), "size-1 dim"),
])
def test_reshape_refusals_name_the_redistribute(shape, placements, new_shape, why):
    with pytest.raises(PlacementError) as info:
        out_placements("reshape", Symbol(shape, placements), new_shape)
    message = str(info.value)
    assert why in message and "x.redistribute(placements=[Replicate()])" in message
    assert "reshape" in message and repr(placements[0]) in message


def test_view_family_follows_dims():
    x = Symbol((8, 8, 4), [Shard(1)])
    assert out_placements("transpose", x, 0, 1) == [(Shard(0),)]
    assert out_placements("permute", x, 2, 0, 1) == [(Shard(2),)]
    assert out_placements("unsqueeze", x, 0) == [(Shard(2),)]
    assert out_placements("flatten", x, 1) == [(Shard(1),)]
    assert out_placements("expand", Symbol((8, 1), [Shard(0)]), 3, 8, 5) == [(Shard(1),)]
    assert out_placements("split", x, 2, 2) == [(Shard(1),)] * 2
    assert out_placements("unbind", x, 0) == [(Shard(0),)] * 8
    with pytest.raises(PlacementError, match="expand broadcasts"):
        out_placements("expand", Symbol((8, 1), [Shard(1)]), 8, 5)
    with pytest.raises(PlacementError, match="interleaves"):
        out_placements("repeat", x, 1, 2, 1)


def test_joins():
    a, b = Symbol((8, 6), [Shard(1)]), Symbol((8, 6), [R])
    assert out_placements("cat", [a, b]) == [(Shard(1),)]
    assert out_placements("stack", [a, b], 1) == [(Shard(2),)]
    assert out_placements("cat", [Symbol((8, 6), [P]), Symbol((8, 6), [P])]) == [(P,)]
    with pytest.raises(PlacementError, match="cat along sharded dim 1"):
        out_placements("cat", [a, b], 1)
    with pytest.raises(PlacementError, match="Partial"):
        out_placements("cat", [Symbol((8, 6), [P]), b])


def test_indexing_rules():
    x = Symbol((8, 6), [Shard(0)])
    assert out_placements("getitem", x, canonical_index((slice(None), None, 2), (8, 6))) == [(Shard(0),)]
    assert out_placements("getitem", x, canonical_index((None, ...), (8, 6))) == [(Shard(1),)]
    with pytest.raises(PlacementError, match=r"slice\(1, 3, 1\) on sharded dim 0"):
        out_placements("getitem", x, canonical_index(slice(1, 3), (8, 6)))
    index = Symbol((5,), [Shard(0)], dtype=torch.int64)
    assert out_placements("index_select", Symbol((8, 6), [R]), 1, index) == [(Shard(1),)]
    assert out_placements("gather", Symbol((8, 6), [R]), 1, Symbol((8, 6), [Shard(0)], dtype=torch.int64)) \
        == [(Shard(0),)]
    with pytest.raises(PlacementError, match="compares values"):
        out_placements("topk", Symbol((8, 6), [P]), 2)


def test_canonical_index():
    assert canonical_index(..., (4, 5)) == (WHOLE, WHOLE)
    assert canonical_index((-1, None, slice(1, None)), (4, 5)) == (3, None, (1, 5, 1))
    assert canonical_index((..., 0), (4, 5, 6)) == (WHOLE, WHOLE, 0)
    with pytest.raises(IndexError):
        canonical_index(4, (4, 5))
    with pytest.raises(IndexError):
        canonical_index((0, 0, 0), (4, 5))
    with pytest.raises(AdvancedIndex):   # index tensors, lists, bools: the advanced path's
        canonical_index([0, 1], (4, 5))
    with pytest.raises(UnsupportedOpError, match="index tensors"):
        canonical_index("0", (4, 5))


def test_sub_meshes_and_unbind():
    mesh = DeviceMesh("cpu", [[[0, 1]], [[2, 3]]], ["pp", "dp", "tp"])
    stages = mesh.unbind("pp")
    assert [m.ranks for m in stages] == [(0, 1), (2, 3)]
    assert stages[1].shape == (1, 2) and stages[1].mesh_dim_names == ("dp", "tp")
    assert mesh[1].ranks == (2, 3) and mesh[1].mesh_dim_names == ("dp", "tp")
    assert mesh["tp"].ranks == (0, 1) and mesh["tp"].mesh_dim_names == ("tp",)
    assert mesh[0:1].shape == (1, 1, 2) and mesh[0:1].mesh_dim_names == ("pp", "dp", "tp")
    assert [m.ranks for m in mesh.unbind("tp")] == [(0, 2), (1, 3)]
    assert DeviceMesh("cpu", [4, 5])[1].ranks == (5,)
    with pytest.raises(MeshError):
        mesh.unbind("ep")


# --- the spellings reach the ops: Replicate inputs (the placement sweep is test_ops_sweep's) ---------
def outputs_of(result) -> list:
    return list(result) if isinstance(result, (tuple, list)) else [result]


def distinct(*shape, dtype=torch.float32):
    """Distinct integer values: exact arithmetic, and one right answer for sort and topk."""
    return torch.randperm(math.prod(shape)).reshape(shape).to(dtype)


def spellings_match_torch(mesh, values, cases) -> None:
    inputs = [dtorch.tensor(v, device_mesh=mesh, placements=[R] * mesh.ndim) for v in values]
    for name, case in cases.items():
        expected, got = outputs_of(case(torch, *values)), outputs_of(case(dtorch, *inputs))
        assert len(got) == len(expected), name
        for actual, wanted in zip(got, expected):
            try:
                assert_same(actual.to_torch(), wanted, exact=True)
            except AssertionError as error:
                raise AssertionError(f"{name} on {mesh}: {error}") from None


MATRIX_CASES = {
    "reshape(-1)": lambda t, x: x.reshape(-1),
    "view(c, r)": lambda t, x: x.view(x.shape[1], x.shape[0]),
    "view(2, -1, c)": lambda t, x: x.view(2, -1, x.shape[1]),
    "reshape((r, c, 1))": lambda t, x: x.reshape((x.shape[0], x.shape[1], 1)),
    "torch.reshape": lambda t, x: t.reshape(x, (1, -1)),
    "flatten": lambda t, x: t.flatten(x),
    "unflatten(0, (2, -1))": lambda t, x: x.unflatten(0, (2, -1)),
    "unsqueeze(1)": lambda t, x: x.unsqueeze(1),
    "squeeze()": lambda t, x: x.squeeze(),
    "transpose(0, 1)": lambda t, x: x.transpose(0, 1),
    "permute(1, 0)": lambda t, x: x.permute(1, 0),
    "torch.permute": lambda t, x: t.permute(x, (1, 0)),
    "T": lambda t, x: x.T,
    "mT": lambda t, x: x.mT,
    "expand(3, r, c)": lambda t, x: x.expand(3, *x.shape),
    "repeat(1, 2)": lambda t, x: x.repeat(1, 2),
    "repeat(2, 1, 1)": lambda t, x: x.repeat(2, 1, 1),
    "contiguous": lambda t, x: x.contiguous(),
    "clone": lambda t, x: t.clone(x),
    "cat": lambda t, x: t.cat([x, x]),
    "cat(dim=1)": lambda t, x: t.cat([x, x], dim=1),
    "stack": lambda t, x: t.stack([x, x]),
    "stack(-1)": lambda t, x: t.stack((x, x), -1),
    "split(3)": lambda t, x: x.split(3),
    "split([1, c-1], 1)": lambda t, x: x.split([1, x.shape[1] - 1], 1),
    "torch.split(dim=1)": lambda t, x: t.split(x, 2, dim=1),
    "chunk(2, 1)": lambda t, x: x.chunk(2, 1),
    "unbind(0)": lambda t, x: x.unbind(0),
    "unbind(1)": lambda t, x: t.unbind(x, 1),
    "narrow(0, 1, 2)": lambda t, x: x.narrow(0, 1, 2),
    "narrow(1, 1, 2)": lambda t, x: t.narrow(x, 1, 1, 2),
    "[1]": lambda t, x: x[1],
    "[:, 1]": lambda t, x: x[:, 1],
    "[1:3]": lambda t, x: x[1:3],
    "[:, ::2]": lambda t, x: x[:, ::2],
    "[None, ..., None]": lambda t, x: x[None, ..., None],
    "[..., -1]": lambda t, x: x[..., -1],
    "[:, :]": lambda t, x: x[:, :],
    "[::2, None]": lambda t, x: x[::2, None],
    "[-1, 1:]": lambda t, x: x[-1, 1:],
    "topk(2, dim=1)": lambda t, x: x.topk(2, dim=1),
    "topk(1, 0, largest=False)": lambda t, x: t.topk(x, 1, 0, largest=False),
    "sort(0)": lambda t, x: x.sort(0),
    "sort(descending=True)": lambda t, x: t.sort(x, descending=True),
}


@pytest.mark.parametrize("shape", [(8, 4), (6, 5)], ids=["even", "uneven"])
def test_matrix_spellings(mesh22, shape):
    spellings_match_torch(mesh22, [distinct(*shape)], MATRIX_CASES)


CUBE_CASES = {
    "view(-1, last)": lambda t, x: x.view(-1, x.shape[2]),
    "reshape(first, -1)": lambda t, x: x.reshape(x.shape[0], -1),
    "flatten(1)": lambda t, x: x.flatten(1),
    "unflatten(2, (1, -1))": lambda t, x: x.unflatten(2, (1, -1)),
    "permute(2, 0, 1)": lambda t, x: x.permute(2, 0, 1),
    "transpose(0, 2)": lambda t, x: x.transpose(0, 2),
    "mT": lambda t, x: x.mT,
    "[:, 1]": lambda t, x: x[:, 1],
    "[..., 1:]": lambda t, x: x[..., 1:],
    "cat(dim=2)": lambda t, x: t.cat([x, x], 2),
    "sort(1)": lambda t, x: x.sort(1),
}


@pytest.mark.parametrize("shape", [(2, 4, 3), (3, 2, 5)], ids=["even", "uneven"])
def test_three_d_spellings(mesh22, shape):
    spellings_match_torch(mesh22, [distinct(*shape)], CUBE_CASES)


SIZE_ONE_CASES = {
    "squeeze()": lambda t, x: x.squeeze(),
    "squeeze(1)": lambda t, x: t.squeeze(x, 1),
    "expand(-1, 3, -1)": lambda t, x: x.expand(-1, 3, -1),
    "view(r, c)": lambda t, x: x.view(x.shape[0], x.shape[2]),
    "[:, 0]": lambda t, x: x[:, 0],
    "repeat(1, 2, 1)": lambda t, x: x.repeat(1, 2, 1),
}


@pytest.mark.parametrize("shape", [(4, 1, 4), (3, 1, 5)], ids=["even", "uneven"])
def test_size_one_spellings(mesh22, shape):
    spellings_match_torch(mesh22, [distinct(*shape)], SIZE_ONE_CASES)


VECTOR_CASES = {
    "view(-1, 3)": lambda t, x: x.view(-1, 3),
    "unflatten(0, (-1, 3))": lambda t, x: x.unflatten(0, (-1, 3)),
    "view(3, -1)": lambda t, x: x.view(3, -1),
    "unsqueeze(0)": lambda t, x: x.unsqueeze(0),
    "expand(2, -1)": lambda t, x: x.expand(2, -1),
    "stack": lambda t, x: t.stack([x, x], 1),
    "[None, 2:]": lambda t, x: x[None, 2:],
}


@pytest.mark.parametrize("size", [24, 9], ids=["even", "uneven"])
def test_vector_spellings(mesh22, size):
    spellings_match_torch(mesh22, [distinct(size)], VECTOR_CASES)


PAIR_CASES = {
    "cat": lambda t, x, y: t.cat([x, y]),
    "cat(dim=1)": lambda t, x, y: t.cat([x, y], 1),
    "stack(1)": lambda t, x, y: t.stack([x, y], 1),
}


@pytest.mark.parametrize("shape", [(8, 4), (6, 5)], ids=["even", "uneven"])
def test_joins_of_two_tensors_spellings(mesh22, shape):
    spellings_match_torch(mesh22, [distinct(*shape), distinct(*shape)], PAIR_CASES)


def test_index_select_spellings(mesh22):
    cases = {
        "index_select(0)": lambda t, x, i: t.index_select(x, 0, i),
        "index_select(1)": lambda t, x, i: x.index_select(1, i),
        "index_select(-1)": lambda t, x, i: x.index_select(-1, i),
    }
    index = torch.tensor([3, 0, 2, 2, 1])
    for shape in [(8, 4), (6, 5)]:
        spellings_match_torch(mesh22, [distinct(*shape), index], cases)


def test_gather_and_scatter_spellings(mesh22):
    cases = {
        "gather(1)": lambda t, x, i: x.gather(1, i),
        "gather(0)": lambda t, x, i: t.gather(x, 0, i),
        "gather(1, narrower index)": lambda t, x, i: x.gather(1, i[:, :2]),
        "scatter(1, src)": lambda t, x, i: x.scatter(1, i, x * -3),
        "scatter(0, src)": lambda t, x, i: t.scatter(x.T, 0, i.T, x.T * -3),
        "scatter(1, value)": lambda t, x, i: t.scatter(x, 1, i, -1.0),
        "scatter(1, src as index)": lambda t, x, i: x.scatter(1, i, i.to(torch.float32)),
    }
    for shape in [(4, 4), (6, 5)]:
        # a permutation per row (values < rows too): scatter positions are unique, so defined
        spellings_match_torch(mesh22, [distinct(*shape), torch.rand(shape).argsort(dim=1)], cases)


# --- methods of the marked block and odd inputs ------------------------------------------------------
def test_iteration_and_index_errors(mesh4, strict):
    a = distinct(3, 4)
    x = dtorch.tensor(a, device_mesh=mesh4, placements=[Shard(1)])
    assert [row.tolist() for row in x] == a.tolist()
    with pytest.raises(IndexError):
        x[3]
    mask = torch.tensor([True, False, True])   # a DTensor mask is read (tests/test_data_dependent.py)
    assert torch.equal(x[dtorch.tensor(mask, device_mesh=mesh4)].to_torch(), a[mask])
    with pytest.raises(UnsupportedOpError, match="view"):
        x.view(torch.int32)
    with pytest.raises(PlacementError, match=r"x.redistribute\(placements=\[Replicate\(\)\]\)"):
        x[:, 1]


def test_redistribute_like_and_by_dict(mesh22):
    a = distinct(6, 5)
    x = dtorch.tensor(a, device_mesh=mesh22, placements=[Shard(0), Replicate()])
    other = dtorch.zeros(2, 2, device_mesh=mesh22, placements=[Replicate(), Shard(1)])
    like = x.redistribute_like(other)
    assert like.placements == (Replicate(), Shard(1))
    by_name = x.redistribute_by_dict({"tp": Shard(1)})   # "dp" unlisted: keeps S(0)
    assert by_name.placements == (Shard(0), Shard(1))
    by_index = x.redistribute_by_dict({0: Partial()})
    assert by_index.placements == (Partial(), Replicate())
    for y in (like, by_name, by_index):
        assert_same(y.to_torch(), a, exact=True)
    with pytest.raises(MeshError):
        x.redistribute_by_dict({"pp": Replicate()})
    with pytest.raises(MeshError, match="twice"):
        x.redistribute_by_dict({"dp": Replicate(), 0: Shard(1)})


def test_ops_on_a_sub_mesh_from_unbind(mesh212):
    stage = mesh212.unbind("pp")[1]
    a = distinct(4, 6)
    x = dtorch.tensor(a, device_mesh=stage, placements=[Replicate(), Shard(0)])
    assert_same(x.view(-1).reshape(2, 12).T.to_torch(), a.view(-1).reshape(2, 12).T, exact=True)


KNOWN_GAPS = {  # see the module docstring: each still refuses, cleanly
    "uneven merge": (lambda x: x.reshape(-1), (7, 6), [Shard(0)]),
    "slice of a sharded dim": (lambda x: x[1:3], (8, 6), [Shard(0)]),
    "cat along the sharded dim": (lambda x: dtorch.cat([x, x]), (8, 6), [Shard(0)]),
    "sort along the sharded dim": (lambda x: x.sort(0), (8, 6), [Shard(0)]),
    "gather along the sharded dim": (lambda x: x.gather(0, x.to(torch.int64) * 0), (8, 6), [Shard(0)]),
    "Partial with Replicate in cat": (lambda x: dtorch.cat([x, x.redistribute(placements=[R])]), (8, 6), [P]),
}


@pytest.mark.parametrize("gap", KNOWN_GAPS)
def test_known_gaps_still_refuse(mesh4, gap, strict):
    op, shape, placements = KNOWN_GAPS[gap]
    x = dtorch.tensor(distinct(*shape), device_mesh=mesh4, placements=placements)
    with pytest.raises(PlacementError, match="redistribute"):
        op(x)

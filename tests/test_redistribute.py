"""The redistribute matrix on real workers: every placement pair on 1-D and 2-D meshes, uneven
shapes, nested sharding, several mesh dims changing at once. Compared with torch."""
import itertools

import pytest
import torch

import dtorch
from dtorch.spec.placements import Partial, Replicate, Shard
from support import assert_same, run_script

R = Replicate()


def choices(ndim, partials=("sum",)):
    return [R] + [Shard(d) for d in range(ndim)] + [Partial(op) for op in partials]


@pytest.mark.parametrize("shape", [(8, 12), (7, 5), (3, 2)])
def test_every_pair_on_a_1d_mesh(mesh4, shape):
    value = torch.randn(shape)
    for src, dst in itertools.product(choices(2), repeat=2):
        x = dtorch.tensor(value, device_mesh=mesh4, placements=[src])
        y = x.redistribute(placements=[dst])
        assert y.placements == (dst,)
        assert_same(y.to_torch(), value)


def test_every_pair_on_meshes_with_a_dim_of_one_rank(session):
    """Steps along a mesh dim of one rank move nothing (workers skip them): every pair still
    reads back equal, with the other dim's collectives in between."""
    from dtorch.spec.placements import init_device_mesh
    value = torch.randn(5, 6)
    for shape in [(1,), (2, 1), (1, 2)]:
        mesh = init_device_mesh("cpu", shape)
        layouts = list(itertools.product(choices(2, ("sum", "max")), repeat=len(shape)))
        for src, dst in itertools.product(layouts, repeat=2):
            x = dtorch.tensor(value, device_mesh=mesh, placements=src)
            assert_same(x.redistribute(placements=dst).to_torch(), value)


@pytest.mark.parametrize("shape", [(8, 12), (5, 7)])
def test_every_pair_on_a_2d_mesh(mesh22, shape):
    value = torch.randn(shape)
    layouts = list(itertools.product(choices(2), repeat=2))
    for src, dst in itertools.product(layouts, repeat=2):
        x = dtorch.tensor(value, device_mesh=mesh22, placements=src)
        assert_same(x.redistribute(placements=dst).to_torch(), value)


@pytest.mark.parametrize("op", ["avg", "max", "min"])
def test_partial_reductions(mesh22, op):
    value = torch.randn(6, 5)
    for dst in ([R, R], [Shard(0), R], [R, Shard(1)]):
        x = dtorch.tensor(value, device_mesh=mesh22, placements=[Partial(op), Partial(op)])
        assert_same(x.redistribute(placements=dst).to_torch(), value)


def test_reduction_results_read_back_exactly_for_integers(mesh22):
    value = torch.randint(-9, 9, (6, 7))
    x = dtorch.tensor(value, device_mesh=mesh22, placements=[Shard(0), Shard(1)])
    s = x.sum(0)  # P(sum) on dp, S(0) on tp
    assert s.placements == (Partial(), Shard(0))
    assert_same(s.redistribute(placements=[Shard(0), R]).to_torch(), value.sum(0), exact=True)


# Gloo carries none of int16, uint16/32 or float8 (moves go as bytes, reductions in a wider type),
# and a local sum of int32 pieces is int64 in torch: each dtype through each kind of move.
_MOVED_DTYPES = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool, torch.float16,
                 torch.bfloat16, torch.uint16, torch.uint32, torch.float8_e4m3fn]
_SUMMED_DTYPES = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16]


def _values(dtype, shape):
    if dtype is torch.bool:
        return torch.rand(shape) > 0.5
    return torch.randint(0, 7, shape).to(dtype)


@pytest.mark.parametrize("dtype", _MOVED_DTYPES, ids=str)
def test_every_dtype_moves_bit_for_bit(mesh22, dtype):
    value = _values(dtype, (7, 5))
    for src, dst in [([Shard(0), Shard(1)], [R, R]), ([Shard(0), R], [Shard(1), R]), ([R, R], [Shard(1), Shard(0)])]:
        moved = dtorch.tensor(value, device_mesh=mesh22, placements=src).redistribute(placements=dst).to_torch()
        assert moved.dtype == dtype and torch.equal(moved.view(torch.uint8), value.view(torch.uint8)), (src, dst)


@pytest.mark.parametrize("dtype", _SUMMED_DTYPES, ids=str)
def test_every_dtype_sums_in_its_own_dtype(mesh22, dtype):
    """P(sum) -> R (an all-reduce) and -> S (a reduce-scatter): the dtype stays the tensor's, and
    a sum that overflows it wraps as torch's does (int8: 4 x 100)."""
    parts = [_values(dtype, (7, 5)) for _ in range(4)]
    if dtype is torch.int8:
        parts = [torch.full((7, 5), 100, dtype=dtype)] * 4
    expected = parts[0] + parts[1] + parts[2] + parts[3]
    stacked = dtorch.tensor(torch.stack(parts), device_mesh=mesh22, placements=[Shard(0), Shard(0)])
    summed = stacked.sum(0, dtype=dtype)
    for dst in ([R, R], [Shard(0), R], [Shard(1), Shard(0)]):
        assert_same(summed.redistribute(placements=dst).to_torch(), expected, exact=True)


def test_nested_sharding_of_one_dim_over_two_mesh_dims(mesh22):
    value = torch.randn(11, 3)
    x = dtorch.tensor(value, device_mesh=mesh22, placements=[Shard(0), Shard(0)])
    assert x.local_shape(0) == (3, 3) and x.local_shape(3) == (2, 3)
    for dst in ([R, Shard(0)], [Shard(0), R], [Shard(1), Shard(0)], [R, R], [Shard(0), Shard(1)]):
        assert_same(x.redistribute(placements=dst).to_torch(), value)


def test_a_16_mib_redistribute_moves_only_commands_through_the_controller(mesh4):
    x = dtorch.randn(4096, 1024, device_mesh=mesh4, placements=[Shard(0)])  # 16 MiB of float32
    dtorch.synchronize()
    before = dtorch.stats()
    y = x.redistribute(placements=[Shard(1)]).redistribute(placements=[R])
    dtorch.synchronize()
    after = dtorch.stats()
    moved = (after["bytes_sent"] - before["bytes_sent"]) + (after["bytes_received"] - before["bytes_received"])
    assert moved < 4096, f"{moved} bytes went through the controller"
    del y


@pytest.mark.parametrize("shape", [(9, 6), (4, 4)])
def test_move_between_meshes(mesh1, mesh4, mesh22, shape):
    value = torch.randn(shape)
    stages = mesh22.unbind("dp")          # two pipeline stages of 2 ranks each
    layouts = {mesh1: [[R], [Shard(0)]], mesh4: [[R], [Shard(0)], [Shard(1)], [Partial()]],
               mesh22: [[Shard(0), Shard(1)], [R, Shard(0)], [Partial(), R]],
               stages[0]: [[Shard(1)], [R]], stages[1]: [[Shard(0)], [Partial()]]}
    for src_mesh, dst_mesh in itertools.product(layouts, repeat=2):
        if src_mesh == dst_mesh:
            continue
        for src, dst in itertools.product(layouts[src_mesh], layouts[dst_mesh]):
            x = dtorch.tensor(value, device_mesh=src_mesh, placements=src)
            y = x.redistribute(device_mesh=dst_mesh, placements=dst)
            assert y.device_mesh == dst_mesh and y.placements == tuple(dst)
            assert_same(y.to_torch(), value)


def test_move_moves_no_data_through_the_controller(mesh4, mesh22):
    x = dtorch.randn(1024, 1024, device_mesh=mesh4, placements=[Shard(0)])  # 4 MiB
    dtorch.synchronize()
    before = dtorch.stats()
    y = x.redistribute(device_mesh=mesh22.unbind("tp")[1], placements=[Shard(1)])
    dtorch.synchronize()
    after = dtorch.stats()
    assert (after["bytes_sent"] - before["bytes_sent"]) + (after["bytes_received"] - before["bytes_received"]) < 4096
    del y


def test_compute_reads_communication_results_in_order(mesh4):
    """On GPUs redistributes run on a communication stream while independent compute goes on
    (tests/test_cuda.py reruns this there): every later use of a result must see it complete,
    even when its inputs are dropped while it is in flight."""
    value = torch.randn(512, 256)
    base = dtorch.tensor(value, device_mesh=mesh4, placements=[Partial()])
    expected, total = torch.zeros(512, 256), dtorch.zeros(512, 256, device_mesh=mesh4)
    for step in range(12):
        scaled = base * (step + 1)                                   # compute, then dropped
        reduced = scaled.redistribute(placements=[Shard(0)])        # communication
        del scaled
        busy = dtorch.ones(256, 256, device_mesh=mesh4) @ dtorch.ones(256, 256, device_mesh=mesh4)
        total = total + reduced.redistribute(placements=[Replicate()]) + busy.sum() * 0
        expected += value * (step + 1)
    assert_same(total.to_torch(), expected)


def test_move_to_workers_that_joined_after_the_source_mesh_was_made():
    """Workers started for a later, larger mesh never saw the older mesh defined, yet a move
    from it names it (as a CPU mesh and a later CUDA mesh do): the controller re-announces."""
    result = run_script("""
        import torch, dtorch
        from dtorch.spec.placements import init_device_mesh, Shard
        early = init_device_mesh("cpu", (2,))
        value = torch.arange(12.0).reshape(4, 3)
        x = dtorch.tensor(value, device_mesh=early, placements=[Shard(0)])
        assert x.sum().item() == 66
        late = init_device_mesh("cpu", (4,))[2:4]          # ranks 2 and 3 joined just now
        y = x.redistribute(device_mesh=late, placements=[Shard(1)])
        assert torch.equal(y.to_torch(), value)
        assert torch.equal(y.redistribute(device_mesh=early, placements=[Shard(1)]).to_torch(), value)
        dtorch.shutdown()
        print("moved")
    """)
    assert result.returncode == 0 and "moved" in result.stdout, result.stderr[-3000:]


@pytest.fixture(scope="module")
def mesh3d(session):
    from dtorch.spec.placements import init_device_mesh
    return init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=["pp", "dp", "tp"])


def test_a_3d_mesh_every_layout_and_a_sample_of_pairs(mesh3d):
    import random
    value = torch.randn(7, 6)
    layouts = list(itertools.product(choices(2), repeat=3))
    full = [R, R, R]
    pairs = [(layout, full) for layout in layouts] + [(full, layout) for layout in layouts]
    pairs += random.Random(0).sample(list(itertools.product(layouts, repeat=2)), 120)
    for src, dst in pairs:
        x = dtorch.tensor(value, device_mesh=mesh3d, placements=src)
        assert_same(x.redistribute(placements=dst).to_torch(), value)


@pytest.mark.parametrize("op", ["max", "min"])
def test_nan_survives_partial_max_and_min(mesh4, op):
    value = torch.randn(8, 6)
    value[5, 2] = float("nan")              # held by rank 2 of a Shard(0) layout
    x = dtorch.tensor(value, device_mesh=mesh4, placements=[Shard(0)])
    reduced = x.amax(0) if op == "max" else x.amin(0)
    assert reduced.placements == (Partial(op),)
    expected = value.amax(0) if op == "max" else value.amin(0)
    assert_same(reduced.to_torch(), expected)                                       # all-reduce
    assert_same(reduced.redistribute(placements=[Shard(0)]).to_torch(), expected)   # reduce-scatter

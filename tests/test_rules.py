"""Placement rules and the redistribute planner, without processes."""
import pytest
import torch

import dtorch.ops  # noqa: F401  (registers the families)
from dtorch.distributed_spec import DeviceMesh, Partial, Replicate, Shard
from dtorch.errors import PlacementError, ShapeError
from dtorch.ops.dispatch import plan_call
from dtorch.ops.registry import lookup
from dtorch.ops.spec import tensor_spec
from dtorch.redistribute import plan_redistribute, step_kind

R, P = Replicate(), Partial()
MESH = DeviceMesh("cpu", [0, 1, 2, 3])
MESH2 = DeviceMesh("cpu", [[0, 1], [2, 3]], ["dp", "tp"])


class Symbol:
    """Stands in for a DTensor: the rules only look at `_spec`."""
    def __init__(self, shape, placements, mesh=MESH, dtype=torch.float32):
        self._spec = tensor_spec(shape, dtype, mesh, placements)


def plan(op, *args, **kwargs):
    specs = [a._spec for a in list(args) + list(kwargs.values()) if isinstance(a, Symbol)]
    return plan_call(lookup(op), args, kwargs, specs)


def placements_of(result):
    return [spec.placements for spec in result.out_specs]


@pytest.mark.parametrize("a,b,out", [
    ([Shard(0)], [Shard(0)], [Shard(0)]),
    ([Shard(1)], [R], [Shard(1)]),
    ([R], [R], [R]),
    ([P], [P], [P]),
])
def test_add_rules(a, b, out):
    assert placements_of(plan("add", Symbol((8, 6), a), Symbol((8, 6), b))) == [tuple(out)]


def test_replicate_operand_is_sliced_locally_without_communication():
    result = plan("add", Symbol((8, 6), [Shard(0)]), Symbol((8, 6), [R]))
    ((index, shape, placements, steps),) = result.input_steps
    assert index == 1 and [step_kind(b, a) for _, b, a in steps] == ["slice"]


def test_broadcast_dim_stays_replicate():
    result = plan("mul", Symbol((8, 6), [Shard(0)]), Symbol((6,), [R]))
    assert placements_of(result) == [(Shard(0),)] and result.input_steps == ()


@pytest.mark.parametrize("a,b", [([P], [R]), ([Shard(0)], [P]), ([Shard(0)], [Shard(1)])])
def test_add_rejections_name_placements_and_fix(a, b):
    with pytest.raises(PlacementError) as info:
        plan("add", Symbol((8, 8), a), Symbol((8, 8), b))
    message = str(info.value)
    assert "add" in message and "Legal there" in message and "redistribute" in message
    assert repr(a[0]) in message


def test_partial_times_replicate_and_scalars():
    assert placements_of(plan("mul", Symbol((4,), [P]), Symbol((4,), [R]))) == [(P,)]
    assert placements_of(plan("mul", Symbol((4,), [P]), 2.0)) == [(P,)]
    with pytest.raises(PlacementError):
        plan("add", Symbol((4,), [P]), 1.0)  # would add the scalar once per rank
    with pytest.raises(PlacementError):
        plan("exp", Symbol((4,), [P]))


@pytest.mark.parametrize("a,b,out", [
    ([Shard(0)], [R], Shard(0)),
    ([R], [Shard(1)], Shard(1)),
    ([Shard(1)], [Shard(0)], P),
    ([P], [R], P),
    ([R], [R], R),
])
def test_matmul_rules_from_einsum(a, b, out):
    assert placements_of(plan("matmul", Symbol((8, 6), a), Symbol((6, 4), b))) == [(out,)]


def test_batched_matmul_with_broadcast():
    result = plan("matmul", Symbol((3, 8, 6), [Shard(0)]), Symbol((6, 4), [R]))
    assert placements_of(result) == [(Shard(0),)] and result.out_specs[0].shape == (3, 8, 4)


def test_reductions():
    x = Symbol((8, 6), [Shard(0)])
    assert placements_of(plan("sum", x)) == [(P,)]
    assert placements_of(plan("sum", x, 1)) == [(Shard(0),)]
    assert placements_of(plan("amax", x, 0)) == [(Partial("max"),)]
    mean = plan("mean", x, 0)
    assert mean.kernel == "mean_as_partial_sum" and mean.extra_kwargs == {"count": 8}
    with pytest.raises(PlacementError):
        plan("prod", x, 0)


def test_two_d_mesh_expansion():
    x = Symbol((8, 6), [Shard(0), Shard(1)], MESH2)
    w = Symbol((6, 4), [R, Shard(0)], MESH2)
    assert placements_of(plan("matmul", x, w)) == [(Shard(0), P)]


def test_shape_errors_come_from_meta_inference():
    with pytest.raises(ShapeError, match="add"):
        plan("add", Symbol((8, 6), [R]), Symbol((5, 6), [R]))


def test_plan_cache_keys_scalars_by_type():
    from dtorch.ops.dispatch import cached_plan, PLAN_CACHE
    x = Symbol((8, 6), [Shard(0)])
    cached_plan("mul", (x, 2.0), {})
    size = len(PLAN_CACHE)
    cached_plan("mul", (x, 3.0), {})
    assert len(PLAN_CACHE) == size


KINDS = {"S->R": ([Shard(0)], [R], ["all_gather"]), "P->R": ([P], [R], ["all_reduce"]),
         "P->S": ([P], [Shard(1)], ["reduce_scatter"]), "S->S": ([Shard(0)], [Shard(1)], ["all_to_all"]),
         "R->S": ([R], [Shard(0)], ["slice"]), "R->P": ([R], [P], ["partialize"])}


@pytest.mark.parametrize("name", KINDS)
def test_planner_one_step(name):
    src, dst, kinds = KINDS[name]
    assert [step_kind(b, a) for _, b, a in plan_redistribute(src, dst)] == kinds


def test_planner_nested_sharding_gathers_inner_first():
    steps = plan_redistribute([Shard(0), Shard(0)], [R, Shard(0)])
    assert [(m, repr(b), repr(a)) for m, b, a in steps] == [(1, "S(0)", "R"), (0, "S(0)", "R"), (1, "R", "S(0)")]

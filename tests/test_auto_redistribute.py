"""Automatic communication: a call whose input placements the rules refuse gets the cheapest
redistributes (ops/auto_redistribute.py), fused into the op's own command (RunOp.moves), and
equals torch, gradients and dtorch.compile replays included; dtorch.set_strict(True) keeps the
refusal with its legal alternatives.

The randomized sweep draws placement combinations (R, S(d), P(sum), P(max) per input and mesh
dim; P(sum) inputs split element by element over the ranks so that every reduction order is
exact, P(max) inputs genuine random contributions) for every op of the shared sample table on
meshes (4,) and (2,2), even and uneven shapes: every call must equal torch, or raise only where
no placement combination computes it at all (checked against the strict rules on the same
mesh, one input choice per combination on mesh dim 0 and Replicate on the others).
"""
from __future__ import annotations

import itertools
import os
import random
import subprocess
import sys
import zlib

import pytest
import torch

import dtorch
from dtorch.spec.placements import DeviceMesh, Partial, Replicate, Shard
from dtorch.errors import PlacementError
from dtorch.ops import REGISTRY
from dtorch.ops.auto_redistribute import legal_call
from dtorch.ops.rules import Call, Decision, RuleRejected, TensorSlot
from dtorch.ops.dispatch import PLAN_CACHE, cached_plan, lookup, plan_call
from dtorch.ops.tooling.samples import SAMPLED_FAMILIES, samples
from dtorch.ops.tooling.simulate import placement_options, split_partial, tensor_inputs, with_inputs
from dtorch.ops.tensor_meta import tensor_meta
from dtorch.dtensor.tensor import call_op
from support import REPO, Symbol, assert_same, placed

R, P = Replicate(), Partial()
MESH2 = DeviceMesh("cpu", [[0, 1], [2, 3]], ["dp", "tp"])
pytestmark = pytest.mark.usefixtures("automatic")


def up(value, mesh, placements):
    return dtorch.tensor(value, device_mesh=mesh, placements=placements)


def moves_of(op, *args, **kwargs):
    specs = [a._meta for a in list(args) + list(kwargs.values()) if isinstance(a, Symbol)]
    return plan_call(lookup(op), args, kwargs, specs, strict=False)


# --- (a) the examples that used to raise ---------------------------------------------------------
# (name, shapes even, shapes uneven, placements per input on mesh (4,), the call)
EXAMPLES = {
    "add S(0)+S(1)": (((8, 8), (8, 8)), ((7, 6), (7, 6)), ([Shard(0)], [Shard(1)]), lambda t, x, y: x + y),
    "softmax over the sharded dim": (((8, 4),), ((7, 5),), ([Shard(0)],), lambda t, x: t.softmax(x, 0)),
    "matmul, contracted dim sharded on one side": (((8, 12), (12, 4)), ((7, 5), (5, 3)),
                                                   ([Shard(1)], [Shard(1)]), lambda t, x, w: x @ w),
    "cumsum over the sharded dim": (((8, 4),), ((7, 5),), ([Shard(0)],), lambda t, x: t.cumsum(x, 0)),
    "broadcasting add, differently sharded": (((8, 12), (12,)), ((7, 5), (5,)), ([Shard(0)], [Shard(0)]),
                                              lambda t, x, y: x + y),
    "P(sum) + R": (((8, 4), (8, 4)), ((7, 5), (7, 5)), ([P], [R]), lambda t, x, y: x + y),
}


def _on(mesh, placements):
    """A 1-D example's placements on `mesh`: the given one on the last mesh dim, and on (2,2)
    a second layout on the first (S(0) where the tensor has dims) to exercise nesting."""
    if mesh.ndim == 1:
        return placements
    return [Shard(0) if isinstance(placements[0], Shard) else R] + list(placements)


@pytest.mark.parametrize("uneven", [False, True], ids=["even", "uneven"])
@pytest.mark.parametrize("name", list(EXAMPLES))
@pytest.mark.parametrize("mesh_name", ["mesh4", "mesh22"])
def test_examples_equal_torch(request, mesh_name, name, uneven):
    mesh = request.getfixturevalue(mesh_name)
    even_shapes, uneven_shapes, placements, call = EXAMPLES[name]
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    values = [torch.randn(s, generator=g) for s in (uneven_shapes if uneven else even_shapes)]
    inputs = [placed(v, mesh, _on(mesh, p), g) for v, p in zip(values, placements)]
    before = dtorch.stats()["redistributes_inserted"]
    result = call(dtorch, *inputs)
    assert dtorch.stats()["redistributes_inserted"] > before, f"{name}: expected an inserted move"
    assert_same(result.to_torch(), call(torch, *values))


def test_stats_count_each_inserted_move_and_hot_calls_reuse_the_plan(mesh4):
    x = up(torch.randn(8, 8), mesh4, [Shard(0)])
    y = up(torch.randn(8, 8), mesh4, [Shard(1)])
    before = dtorch.stats()["redistributes_inserted"]
    for _ in range(3):
        z = x + y            # one move each time: y S(1) -> S(0), an all-to-all
    assert dtorch.stats()["redistributes_inserted"] - before == 3
    assert z.placements == (Shard(0),)
    before = dtorch.stats()["redistributes_inserted"]
    w = dtorch.tensor(torch.randn(8, 8), device_mesh=mesh4, placements=[Shard(1)])
    x + w + y                # two calls, each with one move
    x + x                    # no move
    assert dtorch.stats()["redistributes_inserted"] - before == 2


def test_one_tensor_passed_twice_moves_once(mesh4):
    a = torch.randn(8, 8)
    x = up(a, mesh4, [Shard(0)])
    before = dtorch.stats()["redistributes_inserted"]
    z = dtorch.cat([x, x], 0)        # cat along the sharded dim: both inputs move to the same target
    assert dtorch.stats()["redistributes_inserted"] - before == 1
    assert_same(z.to_torch(), torch.cat([a, a], 0))


def _commands_sent_by(call) -> tuple:
    """(commands `call` sent, its result)."""
    dtorch.synchronize()
    before = dtorch.stats()["commands_sent"]
    result = call()
    dtorch.synchronize()
    return dtorch.stats()["commands_sent"] - before - 1, result   # less synchronize's Sync


def test_a_move_rides_in_the_op_command(mesh4):
    """One RunOp, no Redistribute (nor a Free for its output); a tensor passed twice still gets
    one Redistribute, and a Free for its output once the op has run."""
    a, b = torch.randn(7, 6), torch.randn(7, 6)
    x, y = up(a, mesh4, [Shard(0)]), up(b, mesh4, [Shard(1)])
    sent, z = _commands_sent_by(lambda: x + y)
    assert sent == 1 and z.placements == (Shard(0),)
    assert_same(z.to_torch(), a + b)
    sent, z = _commands_sent_by(lambda: dtorch.cat([y, y], 1))
    assert sent == 3   # Redistribute, RunOp, Free
    assert_same(z.to_torch(), torch.cat([b, b], 1))


@pytest.mark.parametrize("mesh_name", ["mesh4", "mesh22"])
def test_gradients_through_fused_moves_equal_torch(request, mesh_name):
    """Each move is recorded with its dual collective only where its input requires grad: x and
    w do, y (moved as well) does not."""
    mesh = request.getfixturevalue(mesh_name)
    g = torch.Generator().manual_seed(3)
    a, b, c = torch.randn(7, 6, generator=g), torch.randn(7, 6, generator=g), torch.randn(6, 5, generator=g)
    x = up(a, mesh, _on(mesh, [Shard(1)])).requires_grad_()
    y = up(b, mesh, _on(mesh, [Shard(0)]))
    w = up(c, mesh, _on(mesh, [Shard(1)])).requires_grad_()
    before = dtorch.stats()["redistributes_inserted"]
    loss = ((x + y) @ w).tanh().sum()
    assert dtorch.stats()["redistributes_inserted"] > before
    loss.backward()
    ta, tc = a.clone().requires_grad_(), c.clone().requires_grad_()
    ((ta + b) @ tc).tanh().sum().backward()
    assert_same(x.grad.to_torch(), ta.grad)
    assert_same(w.grad.to_torch(), tc.grad)
    assert x.grad.placements == x.placements and w.grad.placements == w.placements


def test_a_compiled_function_replays_its_fused_moves(mesh4):
    a, b = torch.randn(8, 6), torch.randn(8, 6)
    x, y = up(a, mesh4, [Shard(0)]), up(b, mesh4, [Shard(1)])

    @dtorch.compile
    def step(p, q):
        return (p + q).softmax(0) * q

    expected = (a + b).softmax(0) * b
    for _ in range(3):   # a capture, then replays
        assert_same(step(x, y).to_torch(), expected)


def test_moves_of_tensors_nested_in_lists_follow_call_numbering(mesh4):
    a, b = torch.randn(8, 6), torch.randn(8, 6)
    x, y = up(a, mesh4, [Shard(1)]), up(b, mesh4, [R])
    assert_same(dtorch.cat([y, x], 1).to_torch(), torch.cat([b, a], 1))
    assert_same(dtorch.stack([x, y], 0).to_torch(), torch.stack([a, b], 0))


# --- (c) strict mode --------------------------------------------------------------------------
def test_strict_mode_raises_with_the_legal_alternatives(mesh4, strict):
    x = up(torch.randn(8, 8), mesh4, [Shard(0)])
    y = up(torch.randn(8, 8), mesh4, [Shard(1)])
    with pytest.raises(PlacementError, match="Legal there") as info:
        x + y
    assert "redistribute" in str(info.value) and "test_auto_redistribute.py" in str(info.value)
    dtorch.set_strict(False)
    assert_same((x + y).to_torch(), x.to_torch() + y.to_torch())
    dtorch.set_strict(True)
    with pytest.raises(PlacementError, match="Legal there"):
        x + y


def test_a_change_of_mode_clears_the_plan_cache():
    x, y = Symbol((8, 8), [Shard(0)]), Symbol((8, 8), [Shard(1)])
    assert cached_plan("add", (x, y), {}).moves == ((1, (Shard(0),)),)
    dtorch.set_strict(True)
    assert not PLAN_CACHE
    with pytest.raises(PlacementError):
        cached_plan("add", (x, y), {})
    dtorch.set_strict(False)
    assert cached_plan("add", (x, y), {}).moves


@pytest.mark.parametrize("value,strict", [("", False), ("0", False), ("1", True)])
def test_strict_from_the_environment_at_import(value, strict):
    env = {**os.environ, "DTORCH_STRICT": value, "PYTHONPATH": REPO}
    done = subprocess.run([sys.executable, "-c", "import dtorch; print(dtorch.is_strict())"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == str(strict), done.stderr


# --- the planner, pure --------------------------------------------------------------------------
def test_planner_picks_the_fewest_bytes():
    plan = moves_of("add", Symbol((8, 8), [Shard(0)]), Symbol((8,), [Shard(0)]))
    assert plan.moves == ((1, (R,)),)                     # gather 8 elements, not re-shard 64
    plan = moves_of("add", Symbol((8, 8), [P]), Symbol((8, 8), [R]))
    assert plan.moves == ((1, (P,)),) and plan.out_specs[0].placements == (P,)   # free: R -> P(sum)
    plan = moves_of("softmax", Symbol((8, 8), [Shard(0)]), 0)
    assert plan.moves == ((0, (Shard(1),)),)              # all-to-all beats all-gather
    assert moves_of("add", Symbol((8, 8), [Shard(0)]), Symbol((8, 8), [R])).moves == ()


def test_planner_on_a_2d_mesh_replans_after_each_mesh_dim():
    # dim 1 refuses S(0)+S(1); moving x there makes dim 0's free R -> S(0) slice of y nest
    # under y's own S(0) on dim 1 ... the re-plan settles on a layout the rules accept as given
    x, y = Symbol((8, 8), [Shard(0), Shard(0)], MESH2), Symbol((8, 8), [R, Shard(1)], MESH2)
    plan = moves_of("add", x, y)
    assert plan.moves
    strict = plan_call(lookup("add"), *_moved_args([x, y], plan.moves), strict=True)
    assert strict.out_specs == plan.out_specs and strict.kernel == plan.kernel


def test_planner_settles_nested_shards_of_the_softmax_dim():
    plan = moves_of("softmax", Symbol((8, 6), [Shard(1), Shard(1)], MESH2), 1)
    assert plan.moves and Shard(1) not in plan.moves[0][1]


def _only_all_replicate(call, placements):
    """A rule that accepts an input only when it is Replicate on EVERY mesh dim: no choice on one
    mesh dim alone can satisfy it, so the greedy round finds nothing."""
    if any(p != R for spec in call.inputs for p in spec.placements):
        raise RuleRejected("only all-Replicate", "R")
    return Decision(placements, (R,))


def _call_on(*metas):
    return Call("synthetic", tuple(metas), tuple(TensorSlot(i) for i in range(len(metas))), {},
                (((8, 6), torch.float32),))


def test_planner_falls_back_to_replicate_everywhere():
    x = tensor_meta((8, 6), torch.float32, MESH2, (Shard(0), Shard(1)))
    call, moves = legal_call(_only_all_replicate, _call_on(x))
    assert moves == ((0, (R, R)),) and call.inputs[0].placements == (R, R)


def test_planner_gives_up_where_no_layout_works():
    def refuse(call, placements):
        raise RuleRejected("never", "nothing")
    assert legal_call(refuse, _call_on(tensor_meta((8, 6), torch.float32, MESH2, (Shard(0), R)))) is None


def _moved_args(symbols, moves):
    targets = dict(moves)
    moved = [Symbol(s._meta.shape, targets.get(i, s._meta.placements), s._meta.mesh, s._meta.dtype)
             for i, s in enumerate(symbols)]
    return tuple(moved), {}, [s._meta for s in moved]


# --- (d) randomized sweep over the sample table -----------------------------------------------------
OPS = sorted(name for name, spec in REGISTRY.items() if spec.family in SAMPLED_FAMILIES)
PARTIALS = ("sum", "max")
DRAWS = 2   # random combinations per sample, mesh and evenness


@pytest.mark.timeout(120)
@pytest.mark.parametrize("op", OPS)
def test_random_placements_equal_torch_or_nothing_computes(op, mesh4, mesh22):
    checks = []
    for uneven in (False, True):
        for number, sample in enumerate(samples(op, uneven)):
            seed = zlib.crc32(f"{op} {uneven} {number}".encode())
            draw, g = random.Random(seed), torch.Generator().manual_seed(seed)
            for mesh in (mesh4, mesh22):
                for _ in range(DRAWS):
                    _call_drawn(op, sample, mesh, draw, g, checks, " uneven" if uneven else "")
    for outs, expected, what in checks:
        for future, want in zip(outs, expected):
            _assert_matches(future.result(timeout=60), want, what)


def _call_drawn(op, sample, mesh, draw, g, checks, note) -> None:
    """One random placement per input and mesh dim; queue the read, or check that it had to raise."""
    values = tensor_inputs(sample)
    combo = [tuple(draw.choice(placement_options(v, PARTIALS)) for _ in range(mesh.ndim)) for v in values]
    inputs = [placed(v, mesh, p, g, exact_split) for v, p in zip(values, combo)]
    args, kwargs = with_inputs(sample, inputs)
    what = f"{op}{combo} on {mesh.shape}{note}"
    try:
        out = call_op(op, args, kwargs)
    except PlacementError as error:
        assert _nothing_computes(op, sample, values, mesh), f"{what} raised: {error}"
        return
    result = REGISTRY[op].torch_fn(*sample.args, **sample.kwargs)
    expected = tuple(result) if isinstance(result, (tuple, list)) else (result,)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    checks.append(([o.fetch() for o in outs], expected, what))


def exact_split(value, ranks: int, reduce_op: str, g) -> list:
    """P(sum) contributions that add up exactly in any order: each element on one random rank,
    zero on the others (a sum of random reals would round differently under a reduce-scatter
    and an all-reduce, and a cast to bool or a count of nonzeros would see it). Other reduce
    ops are exact as they are."""
    if reduce_op != "sum":
        return split_partial(value, ranks, reduce_op, g)
    owner = torch.randint(0, ranks, value.shape, generator=g)
    return [torch.where(owner == rank, value, torch.zeros_like(value)) for rank in range(ranks)]


def _assert_matches(got, want, what) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, got.dtype)
    if not want.dtype.is_floating_point:
        assert torch.equal(got, want), what
        return
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, equal_nan=True, msg=lambda text: f"{what}: {text}")


def _nothing_computes(op, sample, values, mesh) -> bool:
    """No combination of input placements is accepted as given (strict) on `mesh`: each input's
    choice on mesh dim 0, Replicate on the others."""
    rest = (R,) * (mesh.ndim - 1)
    for choice in itertools.product(*(placement_options(v, ("sum",)) for v in values)):
        specs = [tensor_meta(v.shape, v.dtype, mesh, (p,) + rest) for v, p in zip(values, choice)]
        args, kwargs = with_inputs(sample, [Symbol(s.shape, s.placements, mesh, s.dtype) for s in specs])
        try:
            plan_call(lookup(op), args, kwargs, specs, strict=True)
            return False
        except PlacementError:
            continue
    return True

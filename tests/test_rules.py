"""Placement rules and the redistribute planner, without processes."""
import pytest
import torch

import dtorch.ops  # noqa: F401  (registers the families)
from dtorch.spec.placements import DeviceMesh, Partial, Replicate, Shard, ShardRegion
from dtorch.errors import PlacementError, ShapeError
from dtorch.ops.dispatch import plan_call
from dtorch.ops.dispatch import lookup
from dtorch.spec.redistribute import plan_redistribute, step_kind
from support import Symbol

R, P = Replicate(), Partial()
MESH = DeviceMesh("cpu", [0, 1, 2, 3])
MESH2 = DeviceMesh("cpu", [[0, 1], [2, 3]], ["dp", "tp"])


def plan(op, *args, **kwargs):
    specs = [a._meta for a in list(args) + list(kwargs.values()) if isinstance(a, Symbol)]
    return plan_call(lookup(op), args, kwargs, specs, strict=True)   # the rules as written, no moves


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


def test_every_layout_of_the_same_shapes_shares_one_meta_inference(monkeypatch):
    """Inference reads shapes, dtypes and arguments, not placements: a sweep over 18,000 layouts
    of one norm's inputs ran torch's meta kernels 18,000 times (110 s) before this cache."""
    from dtorch.ops import dispatch
    runs = []
    real = dispatch._run_meta
    monkeypatch.setattr(dispatch, "_run_meta", lambda *a: runs.append(a[0].name) or real(*a))
    monkeypatch.setattr(dispatch, "INFERENCE_CACHE", {})   # as if no earlier test had planned these
    for placements in ([Shard(0)], [Shard(1)], [R], [P]):
        assert plan("sum", Symbol((7, 5), placements), 1).out_specs[0].shape == (7,)
    assert plan("sum", Symbol((7, 5), [R]), 0).out_specs[0].shape == (5,)   # another argument: its own
    assert plan("sum", Symbol((7, 6), [R]), 0).out_specs[0].shape == (6,)   # another shape: its own
    assert plan("sum", Symbol((7, 6), [R], dtype=torch.float64), 0).out_specs[0].dtype == torch.float64
    assert runs == ["sum"] * 4


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


# --- op coverage: Partial laws, reductions, products, nn (issue 3) -------------------------------
MAX, MIN, AVG = Partial("max"), Partial("min"), Partial("avg")


@pytest.mark.parametrize("op,given,out", [
    ("exp", MAX, MAX), ("neg", MAX, MIN), ("relu", MIN, MIN), ("log", MIN, MIN), ("rsqrt", MIN, MAX),
    ("neg", P, P), ("sigmoid", AVG, None), ("log", MAX, None), ("abs", MAX, None), ("gelu", MAX, None),
])
def test_unary_partial_laws(op, given, out):
    x = Symbol((8, 6), [given])
    if out is None:
        with pytest.raises(PlacementError, match="Legal there"):
            plan(op, x)
    else:
        assert placements_of(plan(op, x)) == [(out,)]


def test_selection_and_shift_laws():
    cond, a, b = Symbol((4, 3), [R], dtype=torch.bool), Symbol((4, 3), [P]), Symbol((4, 3), [P])
    assert placements_of(plan("where", cond, a, b)) == [(P,)]
    assert placements_of(plan("where", cond, a, 0.0)) == [(P,)]          # a zero adds nothing
    with pytest.raises(PlacementError):
        plan("where", cond, a, 1.0)                                      # 1.0 once per rank
    assert placements_of(plan("masked_fill", Symbol((4, 3), [MAX]), cond, float("-inf"))) == [(MAX,)]
    assert placements_of(plan("sub", Symbol((4, 3), [R]), Symbol((4, 3), [MAX]))) == [(MIN,)]
    assert placements_of(plan("add", Symbol((4, 3), [R]), Symbol((4, 3), [MAX]), alpha=-1)) == [(MIN,)]
    assert placements_of(plan("maximum", Symbol((4, 3), [MAX]), Symbol((4, 3), [MAX]))) == [(MAX,)]
    with pytest.raises(PlacementError):
        plan("minimum", Symbol((4, 3), [MAX]), Symbol((4, 3), [MAX]))


def test_shifts_refuse_infinities_that_could_meet():
    # an empty shard's max is -inf: on another mesh dim, -inf - -inf would be nan
    x, y = Symbol((4, 3), [R, MAX], MESH2), Symbol((4, 3), [MAX, R], MESH2)
    assert placements_of(plan("add", x, y)) == [(MAX, MAX)]
    with pytest.raises(PlacementError):
        plan("sub", x, y)
    with pytest.raises(PlacementError):   # integers wrap around their stand-in for -inf
        plan("add", Symbol((4, 3), [MAX], dtype=torch.int64), 1)


def test_casts_keep_order_but_sum_only_when_widening():
    x = Symbol((4, 3), [P], dtype=torch.float16)
    assert placements_of(plan("to_dtype", x, torch.float32)) == [(P,)]
    with pytest.raises(PlacementError):
        plan("to_dtype", Symbol((4, 3), [P]), torch.bfloat16)
    assert placements_of(plan("to_dtype", Symbol((4, 3), [MAX]), torch.float16)) == [(MAX,)]
    with pytest.raises(PlacementError):
        plan("to_dtype", Symbol((4, 3), [MAX]), torch.bool)


def test_reductions_over_sharded_dims():
    x = Symbol((8, 6), [Shard(0)])
    assert placements_of(plan("any", Symbol((8, 6), [Shard(0)], dtype=torch.bool))) == [(MAX,)]
    assert placements_of(plan("norm", x, 1, 0)) == [(P,)]
    infinity = plan("norm", x, float("inf"), 0)
    assert placements_of(infinity) == [(MAX,)] and infinity.kernel == "norm_inf_safe"
    assert placements_of(plan("max", x)) == [(MAX,)] and plan("max", x).kernel == "amax_safe"
    assert placements_of(plan("max", x, 1)) == [(Shard(0),), (Shard(0),)]
    for op, args in [("max", (0,)), ("argmax", ()), ("var", (0,)), ("norm", (2, 0)), ("logsumexp", (0,)),
                     ("softmax", (0,)), ("cumsum", (0,))]:
        with pytest.raises(PlacementError):
            plan(op, x, *args)
    assert placements_of(plan("softmax", x, 1)) == [(Shard(0),)]
    assert placements_of(plan("cumsum", Symbol((8, 6), [P]), 1)) == [(P,)]


def test_plans_tell_dims_from_tensors_and_bools_from_ints():
    x, y = Symbol((8, 6), [Shard(0)]), Symbol((8, 6), [R])
    assert len(plan("max", x, 1).out_specs) == 2
    assert placements_of(plan("max", x, y)) == [(Shard(0),)]
    from dtorch.ops.dispatch import cached_plan
    assert cached_plan("var", (y, True), {}).out_specs[0].shape == ()
    assert cached_plan("var", (y, 1), {}).out_specs[0].shape == (8,)


def test_linear_bias_follows_the_product():
    x, w = Symbol((8, 6), [Shard(1)]), Symbol((4, 6), [Shard(1)])
    with pytest.raises(PlacementError, match="once per rank"):
        plan("linear", x, w, Symbol((4,), [R]))
    assert placements_of(plan("linear", x, w, Symbol((4,), [P]))) == [(P,)]
    column = plan("linear", Symbol((8, 6), [R]), Symbol((4, 6), [Shard(0)]), Symbol((4,), [R]))
    assert placements_of(column) == [(Shard(1),)] and [i for i, *_ in column.input_steps] == [2]
    assert placements_of(plan("linear", Symbol((8, 6), [R]), Symbol((4, 6), [R]), Symbol((4,), [MAX]))) == [(MAX,)]


def test_einsum_rule_from_the_equation():
    from dtorch.ops.matrix import explicit_equation
    assert explicit_equation("...ij,...jk", [4, 3]) == "abij,bjk->abik"
    assert explicit_equation("ij,jk", [2, 2]) == "ij,jk->ik"
    a, b = Symbol((4, 5, 6), [Shard(0)]), Symbol((4, 6, 3), [R])
    assert placements_of(plan("einsum", "bij,bjk->bik", a, b)) == [(Shard(0),)]
    assert placements_of(plan("einsum", "bij,bjk->bik", Symbol((4, 5, 6), [Shard(2)]),
                              Symbol((4, 6, 3), [Shard(1)]))) == [(P,)]
    with pytest.raises(PlacementError, match="repeats"):
        plan("einsum", "ii->i", Symbol((6, 6), [Shard(0)]))
    assert placements_of(plan("einsum", "ii->i", Symbol((6, 6), [MAX]))) == [(MAX,)]


def test_attention_shards_queries_but_not_keys():
    q, k, v = Symbol((2, 4, 8, 4), [Shard(2)]), Symbol((2, 4, 6, 4), [R]), Symbol((2, 4, 6, 4), [R])
    assert placements_of(plan("scaled_dot_product_attention", q, k, v)) == [(Shard(2),)]
    with pytest.raises(PlacementError):
        plan("scaled_dot_product_attention", q, k, v, is_causal=True)
    with pytest.raises(PlacementError):
        plan("scaled_dot_product_attention", Symbol((2, 4, 8, 4), [R]), Symbol((2, 4, 6, 4), [Shard(2)]), v)
    heads = [Symbol((2, 4, 8, 4), [Shard(1)]), Symbol((2, 4, 6, 4), [Shard(1)]), Symbol((2, 4, 6, 4), [Shard(1)])]
    assert placements_of(plan("scaled_dot_product_attention", *heads)) == [(Shard(1),)]


def test_embedding_split_vocabulary_is_a_partial_sum_with_a_region():
    ids, table = Symbol((3, 5), [R], dtype=torch.int64), Symbol((10, 4), [Shard(0)])
    result = plan("embedding", ids, table)
    assert placements_of(result) == [(P,)] and result.kernel == "embedding_vocabulary_split"
    assert result.extra_kwargs["region"] == ShardRegion((10, 4), (Shard(0),))
    assert placements_of(plan("embedding", ids, Symbol((10, 4), [Shard(1)]))) == [(Shard(2),)]
    assert placements_of(plan("embedding", Symbol((3, 5), [Shard(1)], dtype=torch.int64),
                              Symbol((10, 4), [R]))) == [(Shard(1),)]


def test_losses_and_pad():
    x, t = Symbol((8, 5), [Shard(0)]), Symbol((8,), [Shard(0)], dtype=torch.int64)
    assert placements_of(plan("cross_entropy", x, t, reduction="sum")) == [(P,)]
    assert placements_of(plan("cross_entropy", x, t, reduction="none")) == [(Shard(0),)]
    with pytest.raises(PlacementError, match="reduction='sum'"):
        plan("cross_entropy", x, t)
    with pytest.raises(PlacementError):
        plan("cross_entropy", Symbol((8, 5), [Shard(1)]), Symbol((8,), [R], dtype=torch.int64))
    mean = plan("mse_loss", Symbol((8, 5), [Shard(1)]), Symbol((8, 5), [R]))
    assert placements_of(mean) == [(P,)] and mean.extra_kwargs == {"loss": "mse_loss", "count": 40}
    assert placements_of(plan("pad", Symbol((8, 5), [Shard(0)]), (1, 1))) == [(Shard(0),)]
    with pytest.raises(PlacementError, match="padded"):
        plan("pad", Symbol((8, 5), [Shard(1)]), (1, 1))


def test_the_dropout_op_without_its_seed_names_the_functions_that_draw_one():
    from dtorch.errors import UnsupportedOpError
    with pytest.raises(UnsupportedOpError, match="call torch.nn.functional.dropout"):
        plan("dropout", Symbol((8, 5), [Shard(0)]), 0.5, True)
    seeded = plan("dropout", Symbol((8, 5), [Shard(0)]), 0.5, True, False, 1, 2)
    assert seeded.kernel == "dropout_counter" and seeded.extra_kwargs["global_shape"] == (8, 5)


def test_parse_shape_takes_both_spellings():
    from dtorch.ops.tensor_meta import parse_shape
    assert parse_shape((4, 6)) == parse_shape(((4, 6),)) == parse_shape(([4, 6],)) == (4, 6)
    assert parse_shape((torch.Size([2, 3]),)) == (2, 3) and parse_shape(()) == ()


def test_operator_rows_reach_registered_ops():
    from dtorch.ops import REGISTRY
    from dtorch.ops.operators import BINARY_OPERATORS, SPELLINGS, UNARY_OPERATORS
    assert set(BINARY_OPERATORS.values()) | set(UNARY_OPERATORS.values()) <= set(REGISTRY)
    assert SPELLINGS["add"] == "+" and SPELLINGS["rsub"] == "scalar - x" and SPELLINGS["bitwise_and"] == "&"


def test_reduction_buckets_newest_first_by_dims_and_dtype_within_budget(monkeypatch):
    """autograd.rules.reduction_buckets: which leaves' gradients a backward all-reduces, over
    which mesh dims, in which launch order (pure: no workers)."""
    from types import SimpleNamespace
    from dtorch.autograd import placement_rules as rules

    def leaf(placements, numel, dtype=torch.float32):
        return SimpleNamespace(placements=placements, numel=lambda: numel, dtype=dtype)
    R, S0 = Replicate(), Shard(0)
    leaves = [leaf([R, R], 10), leaf([R, S0], 10), leaf([S0, S0], 10), leaf([R, R], 10, torch.bfloat16),
              leaf([R, R], 10), leaf([R, R], 10)]
    assert rules.reduction_buckets(leaves, (2, 2)) == [((0, 1), [5, 4, 0]), ((0, 1), [3]), ((0,), [1])]
    assert rules.reduction_buckets(leaves, (2, 1)) == [((0,), [5, 4, 1, 0]), ((0,), [3])]   # size-1 dims drop out
    assert rules.reduction_buckets(leaves, (1, 1)) == []
    monkeypatch.setattr(rules, "FIRST_BUCKET_BYTES", 40)   # the first bucket closes at its budget
    monkeypatch.setattr(rules, "BUCKET_BYTES", 80)
    assert rules.reduction_buckets(leaves, (2, 2))[:2] == [((0, 1), [5]), ((0, 1), [4, 0])]

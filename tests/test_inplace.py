"""In-place ops, item assignment and aliasing (dtorch/dtensor/inplace.py, dtorch/dtensor/aliasing.py,
dtorch/ops/assignment.py; docs/reference/inplace.md), against torch on meshes (1,), (2,), (2,2).

Every in-place method is tested from the op's own sample calls (dtorch/ops/tooling/samples.py):
`x.<op>_(*rest)` on a torch clone is the reference; where torch refuses the in-place form (the
result would broadcast past x's shape, or cannot be cast to x's dtype) dtorch must refuse too.
The aliasing cases run one function on torch tensors and on DTensors: each either gives torch's
values or raises the documented AliasingError (EXPECTED_REFUSALS lists which, with the reason).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import dtorch
from dtorch import AliasingError
from dtorch.spec.placements import Partial, Replicate, Shard, init_device_mesh
from dtorch.errors import ShapeError
from dtorch.dtensor.inplace_methods import EXTRA_METHODS, INPLACE_METHODS
from dtorch.ops.tooling.samples import samples
from support import assert_same, placed

R, P = Replicate(), Partial()


@pytest.fixture(scope="module")
def mesh2(session):
    return init_device_mesh("cpu", (2,), mesh_dim_names=["dp"])


def layouts(mesh1, mesh2, mesh22):
    """(mesh, placements of x): Shard, Replicate and Partial inputs on each mesh shape."""
    return [(mesh1, [R]), (mesh2, [Shard(0)]), (mesh2, [Shard(1)]), (mesh2, [R]), (mesh2, [P]),
            (mesh22, [Shard(0), Shard(1)]), (mesh22, [P, Shard(0)])]


def upload(value, mesh, placements, g):
    if not isinstance(value, torch.Tensor):
        return value
    if value.ndim < len([p for p in placements if isinstance(p, Shard)]) or any(
            isinstance(p, Shard) and p.dim >= value.ndim for p in placements):
        placements = [R] * mesh.ndim
    if any(isinstance(p, Partial) for p in placements) and not value.dtype.is_floating_point:
        placements = [R] * mesh.ndim
    return placed(value, mesh, placements, g)


def _run(fn):
    try:
        return fn(), None
    except Exception as error:   # noqa: BLE001  the comparison is on whether both refuse
        return None, error


DERIVED = sorted(set(INPLACE_METHODS) - set(EXTRA_METHODS))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", DERIVED)
def test_derived_inplace_method_matches_torch(method, mesh1, mesh2, mesh22):
    op, g = method[:-1], torch.Generator().manual_seed(0)
    cases = [s for uneven in (False, True) for s in samples(op, uneven)][:3]
    for sample in cases:
        x, rest = sample.args[0], sample.args[1:]
        expected, torch_error = _run(lambda: getattr(x.clone(), method)(*rest, **sample.kwargs))
        for mesh, placements in layouts(mesh1, mesh2, mesh22):
            dx = upload(x, mesh, placements, g)
            before = dx.placements
            drest = [upload(a, mesh, [R] * mesh.ndim, g) for a in rest]
            dkwargs = {k: upload(v, mesh, [R] * mesh.ndim, g) for k, v in sample.kwargs.items()}
            returned, error = _run(lambda: getattr(dx, method)(*drest, **dkwargs))
            where = f"{method} on {placements} of {mesh.shape}"
            if torch_error is not None:
                assert error is not None, f"{where}: torch refuses ({torch_error}), dtorch did not"
                continue
            if expected.shape != x.shape:   # torch resized x (deprecated; addbmm_ of a (n,) x): a shape change
                assert isinstance(error, ShapeError), f"{where}: torch resized x, dtorch did not refuse: {error}"
                continue
            assert error is None, f"{where}: {error}"
            assert returned is dx and dx.placements == before, where
            assert_same(dx.to_torch(), expected, sample.exact and P not in placements)


def test_the_method_list_follows_the_registry():
    assert {"add_", "sub_", "mul_", "div_", "pow_", "neg_", "abs_", "exp_", "log_", "sqrt_", "rsqrt_", "clamp_",
            "clamp_min_", "clamp_max_", "masked_fill_", "copy_", "zero_", "fill_", "relu_", "sigmoid_", "tanh_",
            "lerp_"} <= set(INPLACE_METHODS)
    assert {"transpose_", "swapdims_", "swapaxes_", "t_", "unsqueeze_", "squeeze_", "detach_", "tril_",
            "triu_"} <= set(INPLACE_METHODS)


def test_extra_methods_match_torch(mesh2, mesh22):
    t, end = torch.randn(5, 3), torch.randn(5, 3)
    for mesh, placements in ((mesh2, [Shard(0)]), (mesh22, [R, Shard(1)]), (mesh2, [P])):
        g = torch.Generator().manual_seed(1)
        calls = [("zero_", (), ()), ("fill_", (2.5,), (2.5,)), ("clamp_min_", (0.1,), (0.1,)),
                 ("clamp_max_", (-0.2,), (-0.2,)), ("lerp_", (end, 0.3), (end, 0.3)),
                 ("lerp_", (end, 0.8), (end, 0.8)), ("copy_", (end[0],), (end[0],)),
                 ("copy_", (end.to(torch.int64),), (end.to(torch.int64),))]
        for name, torch_args, args in calls:
            dx = placed(t, mesh, placements, g)
            dargs = [dtorch.tensor(a, device_mesh=mesh) if isinstance(a, torch.Tensor) and name == "lerp_" else a
                     for a in args]
            getattr(dx, name)(*dargs)
            assert dx.placements == tuple(placements)
            assert_same(dx.to_torch(), getattr(t.clone(), name)(*torch_args))


def test_inplace_errors_are_torchs(mesh2):
    x = dtorch.tensor(torch.arange(6).reshape(2, 3), device_mesh=mesh2, placements=[Shard(1)])
    with pytest.raises(ShapeError, match="can't be cast"):
        x.add_(0.5)
    with pytest.raises(ShapeError, match="doesn't match the broadcast shape"):
        x.add_(dtorch.zeros(4, 2, 3, dtype=torch.int64, device_mesh=mesh2))
    assert_same(x.to_torch(), torch.arange(6).reshape(2, 3))   # unchanged by the refusals


def test_inplace_flags_and_torch_spellings(mesh2):
    t = torch.randn(6, 4)
    x = dtorch.tensor(t, device_mesh=mesh2, placements=[Shard(0)])
    assert F.relu(x, inplace=True) is x
    F.leaky_relu(x, 0.2, inplace=True)
    F.elu(x, inplace=True)
    F.silu(x, inplace=True)
    torch.relu_(x)
    x.mul_(3)
    dtorch.nn.functional.dropout(x, 0.5, training=False, inplace=True)
    expected = F.silu(F.elu(F.leaky_relu(F.relu(t), 0.2))).relu() * 3
    assert_same(x.to_torch(), expected)
    dtorch.nn.functional.dropout(x, 0.5, inplace=True)
    kept = x.to_torch() != 0
    assert_same(x.to_torch()[kept], expected[kept] * 2)


# --- item assignment ----------------------------------------------------------------------------
INDICES = [1, -1, (slice(None), 2), (slice(1, 4), slice(None, None, 2)), (slice(None, None, 3), -2),
           (Ellipsis, 0), (None, 2), (slice(None), slice(None)), (slice(2, 3), slice(1, 5))]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("index", INDICES, ids=str)
def test_item_assignment_matches_torch(index, mesh1, mesh2, mesh22):
    g = torch.Generator().manual_seed(2)
    for shape in ((4, 6), (5, 7)):
        t = torch.randn(shape, generator=g)
        region = t[index].shape
        values = [3.5, torch.randn(region, generator=g), torch.randn(region[-1:], generator=g)]
        for mesh, placements in layouts(mesh1, mesh2, mesh22):
            for value in values:
                x = placed(t, mesh, placements, g)
                expected = t.clone()
                expected[index] = value
                x[index] = value
                assert x.placements == tuple(placements)
                assert_same(x.to_torch(), expected)
            x = placed(t, mesh, placements, g)
            value = dtorch.tensor(values[1], device_mesh=mesh)   # a DTensor value, R
            x[index] = value
            expected = t.clone()
            expected[index] = values[1]
            assert_same(x.to_torch(), expected)


def test_kv_cache_write_on_sharded_heads_needs_no_communication(mesh22):
    cache = dtorch.zeros(2, 4, 8, 3, device_mesh=mesh22, placements=[Shard(0), Shard(1)])
    reference = torch.zeros(2, 4, 8, 3)
    before = dtorch.stats()["redistributes_inserted"]
    for pos in (0, 5, 7):
        k = torch.randn(2, 4, 3)
        cache[:, :, pos] = dtorch.tensor(k, device_mesh=mesh22, placements=[Shard(0), Shard(1)])
        reference[:, :, pos] = k
    assert dtorch.stats()["redistributes_inserted"] == before
    from dtorch.ops.dispatch import PLAN_CACHE
    plans = [plan for key, plan in PLAN_CACHE.items()
             if key[0] == "setitem" and plan.out_specs[0].shape == (2, 4, 8, 3)]
    assert plans and all(not plan.moves and not plan.input_steps for plan in plans)
    assert cache.placements == (Shard(0), Shard(1))
    assert_same(cache.to_torch(), reference, exact=True)


def test_assignment_of_a_sharded_value_on_a_sharded_region(mesh2):
    t, v = torch.randn(5, 7), torch.randn(5, 3)
    x = dtorch.tensor(t, device_mesh=mesh2, placements=[Shard(0)])
    x[:, 2:5] = dtorch.tensor(v, device_mesh=mesh2, placements=[Shard(0)])   # aligned rows: local
    t[:, 2:5] = v
    assert_same(x.to_torch(), t)


# --- aliasing: each case either matches torch or raises the documented error --------------------
def view_sees_base(x):
    v = x[0]
    x.add_(1)
    return v, x


def base_sees_view(x):
    v = x[1]
    v.mul_(-2)
    return x, v


def sibling_views(x):
    a, b = x[0], x[:, 1]
    a.zero_()
    return b, x


def transpose_write_back(x):
    v = x.T
    v[0] = 9.0
    return x, v


def chain_of_views(x):
    v = x[1:].T[0]          # the middle view is dropped at once: a ghost node
    v.fill_(4.0)
    return x, v


def chunk_and_unbind(x):
    a, b = x.chunk(2, dim=1)
    b.add_(10)
    rows = x.unbind(0)
    rows[2].neg_()
    return x, a, b, rows[2]


def narrow_and_split(x):
    n = x.narrow(1, 1, 2)
    n.sub_(3)
    pieces = x.split([1, 3], dim=0)
    pieces[1].mul_(0.5)
    return x, n, pieces[0]


def reshape_views_and_copies(x):
    flat = x.reshape(-1)            # torch: a view
    copied = x.T.reshape(-1)        # torch: a copy
    x.add_(1)
    flat.mul_(2)
    return x, flat, copied


def setitem_on_a_view(x):
    v = x[1:3]
    v[0, 1:] = -7.0
    return x, v


def view_of_permuted_unsqueezed(x):
    v = x.unsqueeze(0).permute(2, 0, 1)
    v.clamp_(-0.5, 0.5)
    return x, v


def deepcopy_does_not_alias(x):
    d = copy.deepcopy(x)
    c = copy.copy(x)
    x.add_(1)
    return d, c


def expand_write(x):
    v = x[0:1].expand(3, x.shape[1])
    v.add_(1)               # torch: RuntimeError (one memory location, several elements)
    return x


def orphan_with_sibling(x):
    base = x * 1
    a, b = base[0], base[0]
    del base
    a.add_(1)               # torch: b changes too; dtorch cannot follow: AliasingError
    return b


def orphan_alone(x):
    base = x * 1
    a = base[0]
    del base
    a.add_(1)
    return a


def detach_and_data_share_memory(x):
    d = x.detach()
    x.add_(1)               # d sees it
    x.data.mul_(2)          # x (and d) see it
    d[0] = 5.0              # x sees it
    return x, d


def diagonal_views(x):
    """`A.diagonal().add_(eps)` is how torch code adds to a diagonal: it must reach A (it did not
    while diagonal was a copy here); offsets, a transposed base and setitem through it too."""
    main, upper, lower = x.diagonal(), x.diagonal(1), x.T.diagonal(-1)
    main.add_(10)
    x.mul_(2)               # every diagonal re-derived
    upper[1] = -7.0
    lower.fill_(3)
    return x, main, upper, lower


def unfold_views(x):
    windows = x.unfold(1, 2, 1)
    x.add_(1)               # the windows see it
    return x, windows


def unfold_write(x):
    x.unfold(1, 2, 2).mul_(3)   # torch: changes x; dtorch: AliasingError
    return x


def shape_changed_in_place(x):
    """x.t_() makes x a view of its own storage in torch: the views made before see x's later
    changes, x sees theirs, and item assignment takes x's new shape."""
    row, cols = x[1], x[:, 1:3]
    x.t_()
    x.mul_(2)
    row.add_(1)
    x[0] = -3.0
    return x, row, cols


def shape_changes_chained(x):
    rows = x[1:3]
    x.unsqueeze_(0)
    x.transpose_(0, 2)      # (cols, rows, 1)
    x.squeeze_(-1)
    x.swapdims_(0, 1)
    x.swapaxes_(1, 0)
    x.add_(1)
    rows.mul_(3)
    return x, rows


def shape_change_of_a_view(x):
    tail = x[1:]
    row = tail[0]
    tail.transpose_(0, 1)
    tail.mul_(2)            # x and row see it
    row.sub_(1)             # x and tail see it
    return x, tail, row


def shape_change_then_base_dropped(x):
    """Unlike orphan_with_sibling: the tensor whose storage both views share is kept (by the one
    whose shape changed), so dtorch can follow torch."""
    base = x * 1
    row = base[0]
    base.t_()
    col = base[:, 0]        # the same elements as row
    del base
    row.add_(1)             # col sees it
    return row, col


ALIASING = [view_sees_base, base_sees_view, sibling_views, transpose_write_back, chain_of_views, chunk_and_unbind,
            narrow_and_split, reshape_views_and_copies, setitem_on_a_view, view_of_permuted_unsqueezed,
            deepcopy_does_not_alias, expand_write, orphan_with_sibling, orphan_alone, detach_and_data_share_memory,
            diagonal_views, unfold_views, unfold_write, shape_changed_in_place, shape_changes_chained,
            shape_change_of_a_view, shape_change_then_base_dropped]
# Cases where dtorch raises AliasingError instead of torch's values, and why (docs/reference/inplace.md).
EXPECTED_REFUSALS = {
    "expand_write": "torch refuses it too (RuntimeError)",
    "orphan_with_sibling": "the base is gone while two views of it live: dtorch cannot update the other",
    "unfold_write": "windows are not written back (overlapping ones share elements: torch refuses those)",
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ALIASING, ids=lambda f: f.__name__)
def test_aliasing_matches_torch_or_refuses(case, mesh1, mesh2, mesh22):
    t = torch.randn(4, 5, generator=torch.Generator().manual_seed(3))
    expected, torch_error = _run(lambda: case(t.clone()))
    for mesh, placements in ((mesh1, [R]), (mesh2, [Shard(0)]), (mesh2, [Shard(1)]), (mesh22, [Shard(1), R])):
        x = dtorch.tensor(t, device_mesh=mesh, placements=placements)
        got, error = _run(lambda: case(x))
        if case.__name__ in EXPECTED_REFUSALS:
            assert isinstance(error, AliasingError), error
            assert torch.equal(x.to_torch(), t)     # refused before anything changed
            assert "test_inplace.py" in str(error)   # names the user's line
            continue
        assert error is None and torch_error is None, (error, torch_error)
        got = got if isinstance(got, tuple) else (got,)
        expected_values = expected if isinstance(expected, tuple) else (expected,)
        for g, e in zip(got, expected_values):
            assert_same(g.to_torch(), e)


def test_views_hold_their_base_weakly_and_leave_no_nodes(mesh2):
    import gc
    from dtorch.dtensor import aliasing
    gc.collect()
    before = len(aliasing._NODES)
    x = dtorch.randn(8, 4, device_mesh=mesh2, placements=[Shard(0)])
    for _ in range(50):
        v = x.T[0]
        del v
    assert len(aliasing._NODES) == before + 1      # x's own node only
    v = x[0]
    del x                        # the view does not keep its base's buffers
    assert len(aliasing._NODES) == before + 1 and v.shape == (4,)
    del v
    assert len(aliasing._NODES) == before


def test_augmented_assignment_is_in_place_like_torch(mesh4):
    x = dtorch.tensor(torch.arange(8.0), device_mesh=mesh4, placements=[Shard(0)])
    y = x                       # another name for the same tensor
    y += 1
    y *= 2
    y -= 1
    y /= 4
    expected = ((torch.arange(8.0) + 1) * 2 - 1) / 4
    assert y is x and torch.equal(x.to_torch(), expected)
    counts = dtorch.tensor(torch.arange(4), device_mesh=mesh4, placements=[Shard(0)])
    with pytest.raises(dtorch.ShapeError, match="can't be cast"):
        counts /= 2             # torch: true division into an integer tensor is refused
    counts //= 2
    assert torch.equal(counts.to_torch(), torch.arange(4) // 2)


def test_setting_data_shares_the_new_values_and_keeps_the_leaf(mesh2):
    """`p.data = t` as torch: p takes t's shape, dtype and layout and aliases t; a view made of p
    before keeps p's old values; p stays the same leaf (requires_grad, gradients, optimizers)."""
    a, b, x = torch.randn(6, 3), torch.randn(4, 6), torch.randn(6, 5)
    p, reference = dtorch.nn.Parameter(dtorch.tensor(a, device_mesh=mesh2, placements=[Shard(0)])), a.clone()
    row = p[0]
    t = dtorch.tensor(b, device_mesh=mesh2, placements=[R])
    p.data = t
    assert p.shape == (4, 6) and p.placements == (R,) and p.is_leaf and p.requires_grad
    assert torch.equal(p.to_torch(), b) and torch.equal(row.to_torch(), reference[0])
    t.add_(1)                   # p sees t's change ...
    with dtorch.no_grad():
        p.mul_(2)               # ... and t sees p's
    p.data.sub_(0.5)            # and p.data's
    expected = (b + 1) * 2 - 0.5
    assert torch.equal(p.to_torch(), expected) and torch.equal(t.to_torch(), expected)
    (p @ dtorch.tensor(x, device_mesh=mesh2, placements=[R])).sum().backward()
    torch.testing.assert_close(p.grad.to_torch(), torch.ones(4, 5) @ x.T)
    p.data = p.data.to(torch.float64)   # mixed-precision code's spelling; the float32 .grad no longer fits
    assert p.dtype == torch.float64 and p.grad is None and torch.equal(p.to_torch(), expected.double())
    with pytest.raises(TypeError, match="Variable data has to be a tensor, but got int"):
        p.data = 3


# --- in-place shape changes: x.t_(), x.transpose_(), x.unsqueeze_(), x.squeeze_() ------------------------
SHAPE_CHANGES = [("transpose_", (0, 1), (5, 3)), ("transpose_", (0, 2), (4, 1, 3)), ("swapdims_", (1, 0), (5, 3)),
                 ("swapaxes_", (-1, 0), (5, 3)), ("t_", (), (5, 3)), ("t_", (), (5,)), ("unsqueeze_", (1,), (5, 3)),
                 ("unsqueeze_", (-1,), (5, 3)), ("squeeze_", (1,), (5, 1, 3)), ("squeeze_", (), (5, 1, 3)),
                 ("squeeze_", (0,), (5, 3))]


@pytest.mark.parametrize("method,args,shape", SHAPE_CHANGES, ids=lambda v: str(v))
def test_inplace_shape_changes_match_torch(method, args, shape, mesh1, mesh2, mesh22):
    """On every layout, even and uneven: x takes torch's shape and the placements the out-of-place
    op gives, stays the same object, and shares values with a view made before, both ways; a
    tensor with no view simply takes the new shape."""
    g = torch.Generator().manual_seed(7)
    values = torch.randn(*shape, generator=g)
    for mesh, placements in layouts(mesh1, mesh2, mesh22):
        t, x = values.clone(), upload(values, mesh, placements, g)
        view, expected_view = x[1:3], t[1:3]
        expected_placements = getattr(x, method[:-1])(*args).placements
        assert getattr(x, method)(*args) is x and getattr(t, method)(*args) is t
        where = (method, args, shape, mesh, placements)
        assert x.shape == t.shape and x.placements == expected_placements, where
        x.mul_(2), t.mul_(2)
        view.add_(1), expected_view.add_(1)
        assert_same(x.to_torch(), t), where
        assert_same(view.to_torch(), expected_view), where
        alone = upload(values, mesh, placements, g)
        getattr(alone, method)(*args).add_(1)
        assert_same(alone.to_torch(), getattr(values.clone(), method)(*args) + 1), where


def test_inplace_shape_changes_and_autograd(mesh2):
    """A tensor with history: the gradient flows through the change as torch's. A leaf that
    requires grad is refused, as torch refuses it, unless under no_grad: then it stays that leaf,
    and the next backward fills a .grad of its new shape (as after p.data = t; torch's backward
    fails there instead)."""
    a = torch.randn(4, 3, generator=torch.Generator().manual_seed(2))
    weights = torch.arange(4.0)
    x = dtorch.tensor(a, device_mesh=mesh2, placements=[Shard(0)]).requires_grad_()
    w = dtorch.tensor(weights, device_mesh=mesh2, placements=[R])
    ta = a.clone().requires_grad_()
    y, ty = x * 2, ta * 2
    y.t_(), ty.t_()
    y.unsqueeze_(0), ty.unsqueeze_(0)
    (y * w).sum().backward(), (ty * weights).sum().backward()
    torch.testing.assert_close(x.grad.to_torch(), ta.grad)
    with pytest.raises(RuntimeError, match="test_inplace.py.*leaf Variable that requires grad"):
        x.t_()
    assert x.shape == (4, 3)
    with dtorch.no_grad():
        x.t_()
    assert x.is_leaf and x.requires_grad and x.grad is None and x.shape == (3, 4)
    (x * w).sum().backward()   # torch fails here: its gradient accumulator keeps the old shape
    torch.testing.assert_close(x.grad.to_torch(), weights.expand(3, 4))


def test_detach_in_place_matches_torch(mesh2):
    x = dtorch.randn(4, 3, device_mesh=mesh2, placements=[Shard(0)]).requires_grad_()
    y = x * 2
    assert y.detach_() is y and not y.requires_grad and y.grad_fn is None
    assert x.detach_() is x and not x.requires_grad
    z = dtorch.randn(4, 3, device_mesh=mesh2, placements=[Shard(0)]).requires_grad_() * 1
    with pytest.raises(RuntimeError, match="test_inplace.py.*Can.t detach views in-place"):
        z[0].detach_()
    assert z.detach().detach_() is not None   # detach's result shares memory, yet is no view in torch


def test_tril_and_triu_in_place(mesh2, mesh22):
    t = torch.randn(5, 5, generator=torch.Generator().manual_seed(4))
    for mesh, placements in ((mesh2, [Shard(0)]), (mesh2, [Shard(1)]), (mesh22, [Shard(1), R])):
        x = dtorch.tensor(t, device_mesh=mesh, placements=placements)
        row = x[1]
        x.tril_(1)
        assert torch.equal(x.to_torch(), t.tril(1)) and torch.equal(row.to_torch(), t.tril(1)[1])
        x.triu_(-1)
        assert torch.equal(x.to_torch(), t.tril(1).triu(-1)) and x.placements == tuple(placements)


def test_a_shape_change_keeps_its_old_storage_only_while_needed(mesh2):
    """The hidden tensor that carries x's old value lives while x, or a view of either, does."""
    import gc
    import weakref
    from dtorch.dtensor import aliasing
    gc.collect()
    before = len(aliasing._NODES)
    x = dtorch.randn(8, 4, device_mesh=mesh2, placements=[Shard(0)])
    x.t_()                      # nothing shares x's values: no hidden tensor, no node
    assert aliasing.node_of(x) is None and x.placements == (Shard(1),)
    x.t_()
    row = x[0]
    x.t_()
    old = weakref.ref(aliasing.node_of(x).keep)
    col = x[:, 0]
    del x
    row.add_(1)                 # reaches col through the kept storage
    assert old() is not None and torch.equal(col.to_torch(), row.to_torch())
    del row, col
    assert old() is None and len(aliasing._NODES) == before


def test_compiled_shape_changes(mesh2):
    """Inside dtorch.compile: a tensor the call made may change shape in place, and replays give
    eager's values; one from before the call is refused (a replay cannot repeat a shape change)."""
    w = dtorch.tensor(torch.randn(4, 5), device_mesh=mesh2, placements=[R])

    @dtorch.compile
    def step(x):
        y = x * 2
        y.t_()
        y.add_(1)
        return y.t() @ w

    for i in range(3):
        t = torch.randn(4, 4, generator=torch.Generator().manual_seed(i))
        out = step(dtorch.tensor(t, device_mesh=mesh2, placements=[Shard(0)]))
        torch.testing.assert_close(out.to_torch(), ((t * 2).t() + 1).t() @ w.to_torch())
    assert step.captures == 1

    @dtorch.compile
    def changes_its_argument(x):
        x.t_()
        return x + 1

    x = dtorch.randn(4, 6, device_mesh=mesh2, placements=[Shard(0)])
    with pytest.raises(dtorch.CompileError, match="t_.*changes the shape of a tensor from before the call"):
        changes_its_argument(x)


@pytest.mark.parametrize("shape", [(7, 3), (3, 7), (4, 4), (3, 3, 3)])
def test_fill_diagonal_matches_torch(shape, mesh2, mesh22):
    values = torch.randn(*shape, generator=torch.Generator().manual_seed(5))
    for mesh, placements in ((mesh2, [Shard(0)]), (mesh2, [Shard(1)]), (mesh22, [Shard(1), R]), (mesh2, [P])):
        for wrap in (False, True):
            t, x = values.clone(), dtorch.tensor(values, device_mesh=mesh, placements=placements)
            row = x[0]
            assert x.fill_diagonal_(5.0, wrap=wrap) is x and x.placements == tuple(placements)
            t.fill_diagonal_(5.0, wrap=wrap)
            assert torch.equal(x.to_torch(), t) and torch.equal(row.to_torch(), t[0]), (shape, placements, wrap)
    for bad, message in ((torch.zeros(3), "dimensions must larger than 1"),
                         (torch.zeros(2, 3, 2), "all dimensions of input must be of equal length")):
        for tensor in (bad, dtorch.tensor(bad, device_mesh=mesh2)):
            with pytest.raises(RuntimeError, match=message):
                tensor.fill_diagonal_(1.0)

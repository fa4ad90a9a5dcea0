"""Edges a new user meets (issue 17): never a wrong value, never a hang, and every refusal names
the op, the user's own line and what to write instead."""
import copy

import numpy
import pytest
import torch
import torch.nn.functional as F

import dtorch
import dtorch.nn.functional as DF
from dtorch.spec.placements import DeviceMesh, Partial, Replicate, Shard
from dtorch.errors import PlacementError, RemoteError, ShapeError, UnsupportedOpError
from dtorch.ops.dispatch import plan_call
from dtorch.ops.dispatch import lookup
from support import Symbol

HERE = "test_api_edges.py:"
R, P = Replicate(), Partial()


def sharded(mesh, *shape):
    values = torch.randn(*shape)
    return values, dtorch.tensor(values, device_mesh=mesh, placements=[Shard(0)] + [R] * (mesh.ndim - 1))


# --- 4. inplace=True works (x is rebound, dtorch/dtensor/inplace.py); what has no in-place form is refused ----
INPLACE_CALLS = {
    "F.relu": (lambda x: F.relu(x, inplace=True), F.relu),
    "F.leaky_relu": (lambda x: F.leaky_relu(x, 0.1, inplace=True), lambda v: F.leaky_relu(v, 0.1)),
    "F.elu": (lambda x: F.elu(x, inplace=True), F.elu),
    "F.silu": (lambda x: F.silu(x, inplace=True), F.silu),
    "dtorch relu": (lambda x: DF.relu(x, inplace=True), F.relu),
    "dtorch relu positional": (lambda x: DF.relu(x, True), F.relu),
    "dtorch leaky_relu positional": (lambda x: DF.leaky_relu(x, 0.1, True), lambda v: F.leaky_relu(v, 0.1)),
    "dtorch elu": (lambda x: DF.elu(x, inplace=True), F.elu),
    "dtorch silu": (lambda x: DF.silu(x, inplace=True), F.silu),
    "dtorch dropout eval": (lambda x: DF.dropout(x, 0.5, training=False, inplace=True), lambda v: v),
    "F.alpha_dropout eval": (lambda x: F.alpha_dropout(x, 0.5, False, inplace=True), lambda v: v),
}


@pytest.mark.parametrize("name", INPLACE_CALLS)
def test_inplace_flag_changes_the_input(mesh4, name):
    values, x = sharded(mesh4, 8, 3)
    call, reference = INPLACE_CALLS[name]
    assert call(x) is x
    assert torch.allclose(x.to_torch(), reference(values))


@pytest.mark.parametrize("call", [lambda x: dtorch.relu(x, inplace=True)])
def test_inplace_flag_without_an_inplace_path_is_refused(mesh4, call):
    values, x = sharded(mesh4, 8, 3)
    with pytest.raises(UnsupportedOpError) as info:
        call(x)
    assert HERE in str(info.value)
    assert torch.equal(x.to_torch(), values)


def test_inplace_false_still_works(mesh4):
    values, x = sharded(mesh4, 8, 3)
    assert torch.equal(F.relu(x, inplace=False).to_torch(), F.relu(values))
    assert torch.equal(DF.relu(x, False).to_torch(), F.relu(values))
    assert torch.equal(DF.dropout(x, 0.5, training=False).to_torch(), values)


@pytest.mark.parametrize("call,alternative", [
    (lambda x: x.resize_(24), "x = x.reshape(shape)"),
    (lambda x: x.set_(x * 2), "x.data = source"),
    (lambda x: x.as_strided_((3, 8), (8, 1)), "no as_strided op"),
    (lambda x: x.renorm_(2, 0, 1.0), "no renorm op"),
])
def test_inplace_methods_without_a_form_are_refused_with_the_alternative(mesh4, call, alternative):
    values, x = sharded(mesh4, 8, 3)
    with pytest.raises(UnsupportedOpError) as info:
        call(x)
    message = str(info.value)
    assert "in place" in message and alternative in message and HERE in message, message
    assert torch.equal(x.to_torch(), values)


# --- 5. errors through torch's own Python functions name the user's line --------------------------
def test_controller_errors_through_torch_functions_name_the_users_line(mesh4):
    _, x = sharded(mesh4, 8, 3)
    with pytest.raises(ShapeError) as info:
        torch.einsum("ij,jk->ik", x, x)
    assert HERE in str(info.value) and "overrides.py" not in str(info.value), str(info.value)
    with pytest.raises(UnsupportedOpError) as info:
        F.pdist(x)
    assert HERE in str(info.value), str(info.value)


def test_remote_errors_through_torch_functions_name_the_users_line(mesh4):
    _, x = sharded(mesh4, 8, 3)
    bad = F.softmax(x, dim=7)          # meta inference accepts the dim; the workers do not
    with pytest.raises(RemoteError) as info:
        bad.to_torch()
    assert HERE in info.value.user_site, info.value.user_site


# --- 6. unsupported ops and methods: the user's line and the nearest supported ops ----------------
def test_unsupported_function_names_line_and_neighbours(mesh4):
    _, x = sharded(mesh4, 8, 3)
    with pytest.raises(UnsupportedOpError) as info:
        torch.cumulative_trapezoid(x, dim=1)
    message = str(info.value)
    assert "cumulative_trapezoid" in message and "not supported" in message and HERE in message, message
    assert "cumsum" in message and "cumprod" in message and len(message) < 600, message


def test_cumprod_once_refused_equals_torch(mesh4):
    values, x = sharded(mesh4, 8, 3)
    torch.testing.assert_close(torch.cumprod(x, 1).to_torch(), torch.cumprod(values, 1))
    torch.testing.assert_close(x.cumprod(0).to_torch(), values.cumprod(0))   # along the sharded dim: gathered
    x.cumprod_(1)
    torch.testing.assert_close(x.to_torch(), values.cumprod(1))


def test_unsupported_method_is_an_unsupported_op_and_an_attribute_error(mesh4):
    _, x = sharded(mesh4, 8, 3)
    with pytest.raises(UnsupportedOpError) as info:
        x.index_reduce(0, x[0].long(), x, "prod")
    assert isinstance(info.value, AttributeError)
    assert "index_reduce" in str(info.value) and "index_add" in str(info.value) and HERE in str(info.value)
    assert not hasattr(x, "index_reduce") and not hasattr(x, "no_such_thing")
    assert getattr(x, "index_reduce", None) is None
    with pytest.raises(AttributeError) as info:
        _ = x.no_such_thing
    assert not isinstance(info.value, UnsupportedOpError)   # not a torch.Tensor name either


def test_protocol_lookups_stay_plain_attribute_errors(mesh4):
    _, x = sharded(mesh4, 8, 3)
    # (__array_priority__ is torch.Tensor's own class attribute: a DTensor is a torch.Tensor)
    for name in ("__array_interface__", "_version", "_base", "__cuda_array_interface__"):
        with pytest.raises(AttributeError) as info:
            getattr(x, name)
        assert not isinstance(info.value, UnsupportedOpError), name
    # copy.copy shares storage in torch: the symbol itself (never a double free); deepcopy is a clone
    assert copy.copy(x) is x and copy.deepcopy([x])[0] is not x
    assert torch.equal(copy.deepcopy(x).to_torch(), x.to_torch())


# --- 7. einsum in sublist form ---------------------------------------------------------------------
@pytest.mark.parametrize("placements", [
    ([R], [R]), ([Shard(1)], [Shard(0)]), ([R], [Shard(1)]), ([Shard(0)], [R])])
def test_einsum_sublist_form_matches_torch(mesh4, placements):
    a, b = torch.randn(7, 5), torch.randn(5, 3)
    x = dtorch.tensor(a, device_mesh=mesh4, placements=placements[0])
    y = dtorch.tensor(b, device_mesh=mesh4, placements=placements[1])
    expected = torch.einsum(a, [0, 1], b, [1, 2], [0, 2])
    torch.testing.assert_close(torch.einsum(x, [0, 1], y, [1, 2], [0, 2]).to_torch(), expected)
    torch.testing.assert_close(torch.einsum(x, [0, 1], y, [1, 2]).to_torch(), torch.einsum(a, [0, 1], b, [1, 2]))
    # one operand: torch.einsum never sees a DTensor among its operands to dispatch on, so call dtorch's
    torch.testing.assert_close(dtorch.einsum(x, [..., 1], [..., 1]).to_torch(), torch.einsum(a, [..., 1], [..., 1]))


def test_einsum_sublist_form_on_a_2d_mesh(mesh22):
    a, b = torch.randn(6, 4, 5), torch.randn(6, 5, 3)
    x = dtorch.tensor(a, device_mesh=mesh22, placements=[Shard(0), Shard(2)])
    y = dtorch.tensor(b, device_mesh=mesh22, placements=[Shard(0), Shard(1)])
    expected = torch.einsum(a, [0, 1, 30], b, [0, 30, 51], [0, 1, 51])
    torch.testing.assert_close(torch.einsum(x, [0, 1, 30], y, [0, 30, 51], [0, 1, 51]).to_torch(), expected)


# --- 8. to("cpu") and cpu() keep a DTensor on a CPU mesh; numpy() is a blocking read ------------------
def test_to_cpu_keeps_the_dtensor_and_numpy_reads_the_whole_tensor(mesh4):
    values, x = sharded(mesh4, 9, 3)
    for same in (x.to("cpu"), x.cpu(), x.to(torch.device("cpu")), x.to(device="cpu"), x.to(x.device)):
        assert same is x
    assert numpy.array_equal(x.numpy(), values.numpy()) and numpy.array_equal(numpy.asarray(x), values.numpy())
    as_double = x.to("cpu", torch.float64)
    assert isinstance(as_double, dtorch.DTensor) and torch.equal(as_double.to_torch(), values.double())


def test_to_dtype_stays_a_cast_and_another_device_is_refused(mesh4, mesh1):
    values, x = sharded(mesh4, 9, 3)
    cast = x.to(torch.float64)
    assert isinstance(cast, dtorch.DTensor) and torch.equal(cast.to_torch(), values.double())
    cast = x.to(dtype=torch.float16)
    assert isinstance(cast, dtorch.DTensor) and cast.dtype == torch.float16
    moved = x.to(mesh1)     # a move between meshes (tests/test_api_compat.py covers its forms)
    assert moved.device_mesh == mesh1 and torch.equal(moved.to_torch(), values)
    for call in (lambda: x.to("cuda"), x.cuda, lambda: x.to("cuda:1")):
        with pytest.raises(UnsupportedOpError, match="to_torch"):
            call()


# --- 9. PlacementError: concrete legal combinations and the cheapest fix ---------------------------
MESH = DeviceMesh("cpu", [0, 1, 2, 3])
MESH2 = DeviceMesh("cpu", [[0, 1], [2, 3]], ["dp", "tp"])


def rejection(op, *args, **kwargs):
    specs = [a._meta for a in list(args) + list(kwargs.values()) if isinstance(a, Symbol)]
    with pytest.raises(PlacementError) as info:
        plan_call(lookup(op), args, kwargs, specs, strict=True)
    return str(info.value)


def test_legal_there_lists_concrete_placement_combinations():
    message = rejection("add", Symbol((8, 8), [Shard(0)]), Symbol((8, 8), [P]))
    legal = message.split("Legal there: ")[1].split(". Fix")[0]
    combos = set(legal.split(", "))
    assert {"S(0)+S(0)", "R+R", "P(sum)+P(sum)", "S(1)+S(1)"} <= combos, legal
    assert "linear" not in legal and "monotone" not in legal


def test_fix_moves_the_cheaper_input_to_exact_placements():
    # a big sharded x and a small partial y: reducing y is cheaper than gathering x
    message = rejection("add", Symbol((64, 64), [Shard(0), R], mesh=MESH2), Symbol((64,), [P, R], mesh=MESH2))
    assert "Fix: move input 1 to [R, R]" in message, message
    assert "all-reduce" in message, message


def test_fix_holds_the_other_input_and_prefers_a_free_move():
    # S(0) @ S(0) for (m, k) @ (k, n): resharding the weight to S(1) costs an all-to-all of the
    # smaller tensor; gathering either input costs more
    message = rejection("mm", Symbol((64, 8), [Shard(0)]), Symbol((8, 64), [Shard(0)]))
    fix = message.split("Fix: ")[1]
    assert fix.startswith("move input 1 to [R]") or fix.startswith("move input 0 to [S(1)]"), fix
    assert "redistribute(placements=[" in fix, fix


def test_legal_there_is_bounded():
    message = rejection("add", Symbol((8, 8, 8, 8), [Shard(0)]), Symbol((8, 8, 8, 8), [P]))
    legal = message.split("Legal there: ")[1].split(". Fix")[0]
    assert legal.count("+") <= 8 and legal.endswith(", … (6 more)"), legal


def test_dropout_probability_outside_zero_one_is_refused_at_the_line(mesh4):
    x = dtorch.ones(8, 4, device_mesh=mesh4, placements=[Shard(0)])
    with pytest.raises(ValueError, match="between 0 and 1") as info:
        dtorch.nn.functional.dropout(x, p=2.0)
    assert "test_api_edges.py" in str(info.value)

"""torch's tensor methods that dtorch composes from its ops (dtorch/torch_api/methods.py), each against
torch on the same values: sharded on either dim, replicated, uneven, on (4,) and (2, 2); the
torch.* spellings; gradients of the ones that move values."""
from __future__ import annotations

import pytest
import torch

import dtorch
from dtorch import Replicate, Shard

pytestmark = pytest.mark.timeout(300)

LAYOUTS = {"mesh4": [[Shard(0)], [Shard(1)], [Replicate()]],
           "mesh22": [[Shard(0), Shard(1)], [Shard(1), Replicate()]]}

CASES = {   # name -> (the call, on a torch tensor or a DTensor alike)
    "t": lambda x: x.t(),
    "torch.t": lambda x: torch.t(x),
    "H": lambda x: x.H,
    "mH": lambda x: x.mH,
    "adjoint": lambda x: x.adjoint(),
    "swapaxes": lambda x: x.swapaxes(0, 1),
    "torch.swapdims": lambda x: torch.swapdims(x, 1, 0),
    "movedim": lambda x: x.unsqueeze(0).movedim(0, -1),
    "torch.moveaxis": lambda x: torch.moveaxis(x.unsqueeze(-1), (0, 2), (2, 0)),
    "view_as": lambda x: x.view(-1).view_as(x),
    "reshape_as": lambda x: x.flatten().reshape_as(x),
    "expand_as": lambda x: x[:1].expand_as(x),
    "type_as": lambda x: x.type_as(x.double()),
    "clip": lambda x: x.clip(-0.5, 0.5),
    "torch.clip": lambda x: torch.clip(x, min=0.0),
    "where": lambda x: x.where(x > 0, -1.0),
    "tril": lambda x: x.tril(),
    "triu(1)": lambda x: x.triu(1),
    "torch.tril(-1)": lambda x: torch.tril(x, -1),
    "tril of a batch": lambda x: x.unsqueeze(0).expand(2, -1, -1).triu(-2),
    "tril of bools": lambda x: (x > 0).tril(),
    "flip": lambda x: x.flip(0),
    "torch.flip both": lambda x: torch.flip(x, (0, 1)),
    "flip dims=": lambda x: torch.flip(x, dims=[1]),
    "fliplr": lambda x: x.fliplr(),
    "flipud": lambda x: x.flipud(),
    "rot90": lambda x: x.rot90(),
    "torch.rot90 twice": lambda x: torch.rot90(x, 2),
    "rot90 backwards": lambda x: x.rot90(-1, (1, 0)),
    "rot90 four times": lambda x: x.rot90(4),
    "rot90 of a batch": lambda x: x.unsqueeze(0).expand(2, -1, -1).rot90(3, (-1, 0)),
    "roll": lambda x: x.roll(2, 0),
    "roll two dims": lambda x: torch.roll(x, (-1, 3), (0, 1)),
    "roll flattened": lambda x: x.roll(4),
    "select": lambda x: x.select(1, 2),
    "torch.select": lambda x: torch.select(x, 0, -1),
    "aminmax": lambda x: x.aminmax(),
    "aminmax dim": lambda x: torch.aminmax(x, dim=1, keepdim=True),
    "count_nonzero": lambda x: x.clamp(min=0).count_nonzero(),
    "count_nonzero dim": lambda x: torch.count_nonzero(x.clamp(min=0), dim=0),
    "var_mean": lambda x: torch.var_mean(x, 1),
    "std_mean": lambda x: torch.std_mean(x, dim=0, keepdim=True),
    # torch's aliases of registry ops (dtorch/torch_api/methods.py ALIASES)
    "arccos": lambda x: x.tanh().arccos(),
    "torch.arcsin": lambda x: torch.arcsin(x.tanh()),
    "arctan": lambda x: x.arctan(),
    "torch.arctan2": lambda x: torch.arctan2(x, x.flip(0)),
    "arccosh": lambda x: (x.abs() + 1).arccosh(),
    "torch.arcsinh": lambda x: torch.arcsinh(x),
    "arctanh": lambda x: (x.tanh() * 0.9).arctanh(),
    "absolute": lambda x: torch.absolute(x),
    "negative": lambda x: x.negative(),
    "positive": lambda x: torch.positive(x),
    "fix": lambda x: (x * 3).fix(),
    "multiply": lambda x: torch.multiply(x, 2.5),
    "divide": lambda x: x.divide(x.abs() + 1, rounding_mode="floor"),
    "true_divide": lambda x: torch.true_divide(x, 4.0),
    "subtract": lambda x: x.subtract(x.flip(1), alpha=2),
    "arccos_": lambda x: (x.tanh() * 0.5).arccos_(),
    # composites of registry ops whose torch spelling differs from the op's
    "polygamma method": lambda x: x.polygamma(1),
    "torch.polygamma": lambda x: torch.polygamma(2, x),
    "F.threshold": lambda x: torch.nn.functional.threshold(x, 0.1, 20.0),
    "torch.threshold": lambda x: torch.threshold(x, 0.5, -1.0),
    "nn.Threshold": lambda x: torch.nn.Threshold(0.1, 20.0)(x),
    "F.logsigmoid": lambda x: torch.nn.functional.logsigmoid(x),
    "nn.LogSigmoid": lambda x: torch.nn.LogSigmoid()(x),
    "F.rrelu eval": lambda x: torch.nn.functional.rrelu(x, 0.1, 0.3),
    "nn.RReLU eval": lambda x: torch.nn.RReLU().eval()(x),
    "nn.Hardtanh": lambda x: torch.nn.Hardtanh(-0.5, 2.0)(x),
    "F.hardtanh": lambda x: torch.nn.functional.hardtanh(x),
    "nn.ReLU6": lambda x: torch.nn.ReLU6()(x * 4),
    "nn.Hardswish": lambda x: torch.nn.Hardswish()(x * 4),
    "nn.Mish": lambda x: torch.nn.Mish()(x),
    "torch.selu": lambda x: torch.selu(x),
    "nn.CELU": lambda x: torch.nn.CELU(0.5)(x),
    "nn.Softsign": lambda x: torch.nn.Softsign()(x),
    "nn.Hardshrink": lambda x: torch.nn.Hardshrink(0.3)(x),
    "x.hardshrink": lambda x: x.hardshrink(0.3),
    "nn.Softshrink": lambda x: torch.nn.Softshrink(0.3)(x),
    "nn.Tanhshrink": lambda x: torch.nn.Tanhshrink()(x),
    "nn.Softmin": lambda x: torch.nn.Softmin(dim=1)(x),
    "nn.GLU": lambda x: torch.nn.GLU(dim=0)(torch.cat([x, x.flip(0)], 0)),
    "torch.nansum": lambda x: torch.nansum(x.where(x > -1, torch.nan)),
    "x.nanmean": lambda x: x.where(x > -1, torch.nan).nanmean(1),
}


def _both(got, want):
    if isinstance(want, (tuple, list)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            _both(g, w)
        return
    got = got.to_torch()
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)   # (nanmean of an all-nan row)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("mesh_name", list(LAYOUTS))
def test_a_composed_method_equals_torch(name, mesh_name, request):
    mesh = request.getfixturevalue(mesh_name)
    for shape in ((6, 5), (7, 3)):   # even, and uneven on both mesh sizes
        values = torch.randn(*shape)
        for placements in LAYOUTS[mesh_name]:
            x = dtorch.tensor(values, device_mesh=mesh, placements=placements)
            _both(CASES[name](x), CASES[name](values))


def test_one_d_and_refusals_say_what_torch_says(mesh4):
    v = dtorch.tensor(torch.arange(5.0), device_mesh=mesh4, placements=[Shard(0)])
    assert v.t() is v
    with pytest.raises(RuntimeError, match="at least 2 dimensions"):
        v.tril()
    with pytest.raises(RuntimeError, match="<= 2 dimensions"):
        v.view(1, 1, 5).t()
    with pytest.raises(RuntimeError, match="total dims >= 2"):
        v.rot90()
    with pytest.raises(RuntimeError, match="rotation dims to be different"):
        v.view(1, 5).rot90(1, (1, -1))
    with pytest.raises(IndexError, match="Dimension out of range"):
        v.view(1, 5).rot90(1, (0, 2))


def test_nn_functional_unfold_is_refused_not_run_as_the_tensor_method(mesh4):
    # both are named unfold: F.unfold (im2col) must not reach x.unfold(dimension, size, step)
    x = dtorch.tensor(torch.randn(1, 1, 6, 5), device_mesh=mesh4, placements=[Shard(2)])
    with pytest.raises(dtorch.UnsupportedOpError, match="x.unfold\\(dimension, size, step\\)"):
        torch.nn.functional.unfold(x, 2, 1, 1)


def test_new_factories_take_the_tensors_dtype_and_mesh(mesh22):
    x = dtorch.tensor(torch.randn(4, 4, dtype=torch.float64), device_mesh=mesh22, placements=[Shard(0), Shard(1)])
    assert torch.equal(x.new_zeros(3, 2).to_torch(), torch.zeros(3, 2, dtype=torch.float64))
    assert torch.equal(x.new_ones((2,)).to_torch(), torch.ones(2, dtype=torch.float64))
    assert torch.equal(x.new_full((2, 3), 7).to_torch(), torch.full((2, 3), 7.0, dtype=torch.float64))
    assert x.new_empty(5, dtype=torch.int32).dtype == torch.int32
    made = x.new_zeros(2)
    assert made.device_mesh == mesh22 and made.placements == (Replicate(), Replicate())
    assert x.is_contiguous() and x.element_size() == 8 and x.nelement() == 16


@pytest.mark.parametrize("name", ["tril", "flip", "rot90", "roll two dims", "movedim", "select", "t"])
def test_gradients_through_composed_methods_equal_torchs(name, mesh4):
    values = torch.randn(7, 5)
    reference = values.clone().requires_grad_()
    (CASES[name](reference)
     * torch.arange(1.0, 1.0 + CASES[name](values).numel()).view(CASES[name](values).shape)).sum().backward()
    x = dtorch.tensor(values, device_mesh=mesh4, placements=[Shard(0)], requires_grad=True)
    out = CASES[name](x)
    weight = dtorch.tensor(torch.arange(1.0, 1.0 + out.numel()).view(tuple(out.shape)), device_mesh=mesh4,
                           placements=[Replicate()])
    (out * weight).sum().backward()
    torch.testing.assert_close(x.grad.to_torch(), reference.grad)


def test_in_place_activation_flags_rebind_the_input(mesh4):
    values = torch.randn(7, 5)
    for call in (lambda x: torch.nn.functional.hardtanh(x, inplace=True), lambda x: torch.nn.ReLU6(inplace=True)(x),
                 lambda x: torch.nn.functional.threshold(x, 0.1, 20.0, inplace=True),
                 lambda x: torch.nn.functional.rrelu(x, inplace=True)):
        x = dtorch.tensor(values, device_mesh=mesh4, placements=[Shard(0)])
        expected = values.clone()
        call(expected)
        call(x)
        torch.testing.assert_close(x.to_torch(), expected)


def test_rrelu_in_training_draws_slopes_from_dtorchs_stream(mesh4):
    """torch.nn.RReLU in training: each negative element scaled by its own slope in [lower, upper],
    the same on every layout for the same seed (torch's own draws cannot be matched: compared by law)."""
    values = torch.randn(7, 5)
    results = []
    for placements in ([Shard(0)], [Shard(1)], [Replicate()]):
        dtorch.manual_seed(3)
        x = dtorch.tensor(values, device_mesh=mesh4, placements=placements)
        results.append(torch.nn.RReLU(0.1, 0.3)(x).to_torch())
    negative = values < 0
    slopes = results[0][negative] / values[negative]
    assert torch.equal(results[0][~negative], values[~negative])
    assert bool(((slopes >= 0.1 - 1e-6) & (slopes <= 0.3 + 1e-6)).all()) and slopes.std() > 0
    assert all(torch.equal(results[0], other) for other in results[1:])


def test_rrelu_op_refuses_training_without_dtorchs_stream(mesh4):
    x = dtorch.tensor(torch.randn(4, 4), device_mesh=mesh4, placements=[Shard(0)])
    with pytest.raises(dtorch.UnsupportedOpError, match="rrelu.*training=True.*dtorch's stream"):
        dtorch.rrelu(x, 0.1, 0.3, True)

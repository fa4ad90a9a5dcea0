"""torch.nn.functional losses and layers, torch._foreach_* and vector_to_parameters on DTensors
(dtorch/torch_api/losses.py, torch_api/layers.py, torch_api/foreach.py, nn/utils.py), each against
torch on the same values: sharded on the first dim (the batch) or the last (classes, features),
replicated, on (4,) and (2, 2), with even and uneven shapes (a batch of 7 on 4 ranks), values and
the gradient of every floating-point input. The dropouts draw from dtorch's stream, not torch's:
their statistics, their layout independence and training=False are checked instead."""
from __future__ import annotations

import math
import zlib

import pytest
import torch
import torch.nn.functional as F

import dtorch
from dtorch import Replicate, Shard
# the harness of tests/test_composites.py: same values in torch and dtorch, outputs and gradients compared
from test_composites import LAYOUTS, MATRIX, ROW, COLUMN, _check, _floats, _sizes, _with

pytestmark = pytest.mark.timeout(600)

SEQUENCES = lambda n, d, k: (n, d, 9)  # noqa: E731  (N, C, L): a batch of 7 or 8
IMAGES = lambda n, d, k: (n, d, 3, 2)  # noqa: E731


def _positive(shape, low: float = 0.05):
    return lambda g, uneven: torch.rand(shape(*_sizes(uneven)), generator=g) * 3 + low


def _signs(shape):
    return lambda g, uneven: torch.randint(0, 2, shape(*_sizes(uneven)), generator=g).float() * 2 - 1


def _bits(shape):
    return lambda g, uneven: torch.randint(0, 2, shape(*_sizes(uneven)), generator=g).float()


def _classes(shape, count=lambda n, d, k: d):
    return lambda g, uneven: torch.randint(0, count(*_sizes(uneven)), shape(*_sizes(uneven)), generator=g)


def _inputs(*makers):
    return lambda g, uneven: [make(g, uneven) for make in makers]


def _reductions(name, make, call):
    """One case per reduction: call(*inputs, reduction)."""
    return {f"{name} {r}": (make, lambda *xs, r=r: call(*xs, r)) for r in ("none", "mean", "sum")}


SCALAR = lambda n, d, k: ()  # noqa: E731
LOSSES = {
    **_reductions("poisson_nll_loss", _with(_floats(MATRIX), _positive(MATRIX)),
                  lambda x, t, r: F.poisson_nll_loss(x, t, reduction=r)),
    **_reductions("poisson_nll_loss log_input=False full", _inputs(_positive(MATRIX), _positive(MATRIX)),
                  lambda x, t, r: F.poisson_nll_loss(x, t, log_input=False, full=True, reduction=r)),
    "poisson_nll_loss full eps": (_with(_floats(MATRIX), _positive(MATRIX)),
                                  lambda x, t: F.poisson_nll_loss(x, t, full=True, eps=1e-3)),
    **_reductions("gaussian_nll_loss", _with(_floats(MATRIX, MATRIX), _positive(MATRIX)),
                  lambda x, t, v, r: F.gaussian_nll_loss(x, t, v, reduction=r)),
    **_reductions("gaussian_nll_loss var one dim short full", _with(_floats(MATRIX, MATRIX), _positive(COLUMN)),
                  lambda x, t, v, r: F.gaussian_nll_loss(x, t, v, full=True, reduction=r)),
    "gaussian_nll_loss var of size 1 on a dim": (_with(_floats(MATRIX, MATRIX), _positive(lambda n, d, k: (n, 1))),
                                                 lambda x, t, v: F.gaussian_nll_loss(x, t, v, reduction="sum")),
    "gaussian_nll_loss eps clamps": (_with(_floats(MATRIX, MATRIX), _positive(MATRIX, low=0.0)),
                                     lambda x, t, v: F.gaussian_nll_loss(x, t, v / 3, eps=0.2)),
    "gaussian_nll_loss float var": (_floats(MATRIX, MATRIX), lambda x, t: F.gaussian_nll_loss(x, t, 0.5, True)),
    **_reductions("hinge_embedding_loss", _with(_floats(MATRIX), _signs(MATRIX)),
                  lambda x, t, r: F.hinge_embedding_loss(x, t, reduction=r)),
    "hinge_embedding_loss margin": (_with(_floats(COLUMN), _signs(COLUMN)),
                                    lambda x, t: F.hinge_embedding_loss(x, t, margin=0.3)),
    **_reductions("multi_margin_loss", _with(_floats(MATRIX), _classes(COLUMN)),
                  lambda x, y, r: F.multi_margin_loss(x, y, reduction=r)),
    **_reductions("multi_margin_loss p=2 margin weight", _with(_floats(MATRIX), _classes(COLUMN), _positive(ROW)),
                  lambda x, y, w, r: F.multi_margin_loss(x, y, p=2, margin=0.7, weight=w.detach(),
                                                                     reduction=r)),   # torch: no grad for weight
    "multi_margin_loss one row": (_with(_floats(ROW), _classes(SCALAR)), lambda x, y: F.multi_margin_loss(x, y)),
    **_reductions("multilabel_soft_margin_loss", _with(_floats(MATRIX), _bits(MATRIX)),
                  lambda x, t, r: F.multilabel_soft_margin_loss(x, t, reduction=r)),
    "multilabel_soft_margin_loss weight": (_with(_floats(MATRIX), _bits(MATRIX), _positive(ROW)),
                                           lambda x, t, w: F.multilabel_soft_margin_loss(x, t, weight=w)),
    "torch.poisson_nll_loss": (_inputs(_positive(MATRIX), _positive(MATRIX)),   # ATen's order, int reduction
                               lambda x, t: torch.poisson_nll_loss(x, t, False, True, 1e-6, 2)),
    "torch.hinge_embedding_loss": (_with(_floats(MATRIX), _signs(MATRIX)),
                                   lambda x, t: torch.hinge_embedding_loss(x, t, 0.5, 0)),
    **_reductions("soft_margin_loss", _with(_floats(MATRIX), _signs(MATRIX)),
                  lambda x, t, r: F.soft_margin_loss(x, t.detach(), reduction=r)),   # torch: no grad for target
}

LAYERS = {
    "instance_norm": (_floats(SEQUENCES), lambda x: F.instance_norm(x)),
    "instance_norm weight bias 4-D": (_floats(IMAGES, ROW, ROW), lambda x, w, b: F.instance_norm(x, weight=w, bias=b)),
    "torch.instance_norm": (_floats(SEQUENCES, ROW, ROW),
                            lambda x, w, b: torch.instance_norm(x, w, b, None, None, True, 0.1, 1e-3, False)),
    "local_response_norm": (_floats(SEQUENCES), lambda x: F.local_response_norm(x, 3)),
    "local_response_norm 4-D even size": (_floats(IMAGES), lambda x: F.local_response_norm(x, 2, 0.1, 0.5, 2.0)),
    "max_pool1d": (_floats(SEQUENCES), lambda x: F.max_pool1d(x, 3, stride=2, padding=1)),
    "max_pool1d indices dilation ceil": (_floats(SEQUENCES),
                                         lambda x: F.max_pool1d(x, (2,), dilation=2, ceil_mode=True,
                                                                return_indices=True)),
    "max_pool1d one sample": (_floats(lambda n, d, k: (d, 9)), lambda x: F.max_pool1d(x, 2)),
    "avg_pool1d": (_floats(SEQUENCES), lambda x: F.avg_pool1d(x, 3, stride=2, padding=1)),
    "avg_pool1d ceil without pads": (_floats(SEQUENCES),
                                     lambda x: torch.avg_pool1d(x, 2, ceil_mode=True, count_include_pad=False)),
    "adaptive_avg_pool1d": (_floats(SEQUENCES), lambda x: F.adaptive_avg_pool1d(x, 4)),
    "adaptive_max_pool1d": (_floats(SEQUENCES), lambda x: F.adaptive_max_pool1d(x, 4)),
    "adaptive_max_pool1d indices": (_floats(SEQUENCES), lambda x: F.adaptive_max_pool1d(x, (5,), True)),
    "torch.adaptive_max_pool1d": (_floats(SEQUENCES), lambda x: torch.adaptive_max_pool1d(x, 3)),
    "cdist": (_floats(MATRIX, lambda n, d, k: (k, d)), lambda a, b: torch.cdist(a, b)),
    "cdist p=1": (_floats(MATRIX, lambda n, d, k: (6, d)), lambda a, b: torch.cdist(a, b, p=1)),
    "cdist batched p=inf": (_floats(lambda n, d, k: (2, n, d), lambda n, d, k: (2, 3, d)),
                            lambda a, b: torch.cdist(a, b, p=float("inf"))),
    "cdist mm compute mode": (_floats(lambda n, d, k: (30, d), MATRIX),
                              lambda a, b: torch.cdist(a, b, compute_mode="use_mm_for_euclid_dist")),
    "bilinear": (_floats(MATRIX, lambda n, d, k: (n, 3), lambda n, d, k: (4, d, 3), lambda n, d, k: (4,)),
                 lambda a, b, w, c: F.bilinear(a, b, w, c)),
    "bilinear 3-D no bias": (_floats(lambda n, d, k: (2, n, d), lambda n, d, k: (2, n, k), lambda n, d, k: (5, d, k)),
                             lambda a, b, w: F.bilinear(a, b, w)),
}
CASES = {**LOSSES, **LAYERS}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("size", ["even", "uneven"])
@pytest.mark.parametrize("mesh_name", list(LAYOUTS))
def test_a_composite_and_its_gradients_equal_torchs(name, size, mesh_name, request):
    """On every layout of the mesh (test_composites.LAYOUTS): first dim, last dim, replicated."""
    make, call = CASES[name]
    g = torch.Generator().manual_seed(zlib.crc32(repr((name, size)).encode()))   # not hash(): salted per run
    values = make(g, size == "uneven")
    for layout in LAYOUTS[mesh_name]:
        _check(request.getfixturevalue(mesh_name), values, layout, call, g)


# --- dropouts: dtorch's random stream, so statistics and layouts rather than torch's values --------------
CHANNEL_DROPOUTS = {   # name -> (call, input shape, the dims one mask value covers)
    "dropout1d": (lambda x, **kw: F.dropout1d(x, **kw), (16, 32, 3), (2,)),
    "dropout1d one sample": (lambda x, **kw: F.dropout1d(x, **kw), (512, 3), (1,)),
    "dropout2d": (lambda x, **kw: F.dropout2d(x, **kw), (16, 32, 2, 2), (2, 3)),
    "dropout3d": (lambda x, **kw: F.dropout3d(x, **kw), (16, 32, 1, 2, 2), (2, 3, 4)),
    "dropout3d one sample": (lambda x, **kw: F.dropout3d(x, **kw), (512, 1, 2, 2), (1, 2, 3)),
}


@pytest.mark.parametrize("name", list(CHANNEL_DROPOUTS))
def test_channel_dropout_drops_whole_channels_at_rate_p(mesh22, name):
    call, shape, within = CHANNEL_DROPOUTS[name]
    p = 0.3
    x = dtorch.ones(*shape, device_mesh=mesh22, placements=[Shard(0), Shard(1)], requires_grad=True)
    y = call(x, p=p)
    values = y.to_torch()
    channels = values.amax(within)
    assert torch.equal(values, channels.reshape(channels.shape + (1,) * len(within)).expand(shape))
    assert set(channels.unique().tolist()) <= {0.0, torch.tensor(1 / (1 - p)).item()}
    assert abs((channels == 0).float().mean().item() - p) < 0.1
    y.sum().backward()   # the gradient is the mask
    torch.testing.assert_close(x.grad.to_torch(), values)


@pytest.mark.parametrize("call", [F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout])
def test_a_dropout_mask_is_the_same_on_every_layout_and_eval_is_identity(mesh4, call):
    values = torch.randn((6, 5, 4) if call is F.dropout1d else (6, 5, 4, 3))
    results = []
    for placements in ([Shard(0)], [Shard(1)], [Shard(values.ndim - 1)], [Replicate()]):
        x = dtorch.tensor(values, device_mesh=mesh4, placements=placements)
        dtorch.manual_seed(7)
        results.append(call(x, 0.4, True).to_torch())
        assert torch.equal(call(x, 0.4, False).to_torch(), values)
        assert call(x, 0.4, False, inplace=True) is x
    for other in results[1:]:
        torch.testing.assert_close(other, results[0])


@pytest.mark.parametrize("per_channel", [False, True])
def test_alpha_dropout_keeps_mean_and_variance(mesh4, per_channel):
    p, alpha = 0.2, 1.7580993408473766
    a = 1 / math.sqrt((alpha ** 2 * p + 1) * (1 - p))
    values = torch.randn(64, 64, 4)
    x = dtorch.tensor(values, device_mesh=mesh4, placements=[Shard(0)])
    y = (F.feature_alpha_dropout if per_channel else F.alpha_dropout)(x, p, training=True).to_torch()
    dropped = torch.isclose(y, torch.full_like(y, -alpha * a * (1 - p)))
    torch.testing.assert_close(y[~dropped], (values * a + alpha * a * p)[~dropped])
    assert abs(dropped.float().mean().item() - p) < 0.03
    assert abs(y.mean().item()) < 0.05 and abs(y.std().item() - 1) < 0.05
    if per_channel:
        assert torch.equal(dropped.all(-1), dropped.any(-1))


def test_dropout2d_in_place_rebinds_its_input(mesh4):
    x = dtorch.ones(8, 6, 2, 2, device_mesh=mesh4, placements=[Shard(0)])
    assert F.dropout2d(x, 0.5, inplace=True) is x
    assert set(x.to_torch().unique().tolist()) <= {0.0, 2.0}
    assert x.placements[0] == Shard(0)


# --- instance_norm's running statistics ---------------------------------------------------------------
@pytest.mark.parametrize("placements", [[Shard(0)], [Shard(1)], [Replicate()]])
def test_instance_norm_updates_and_uses_running_statistics(mesh4, placements):
    g = torch.Generator().manual_seed(5)
    values, mean, var = torch.randn(7, 6, 5, generator=g), torch.randn(6, generator=g), torch.rand(6, generator=g) + 0.5
    x = dtorch.tensor(values, device_mesh=mesh4, placements=placements)
    running_mean = dtorch.tensor(mean, device_mesh=mesh4, placements=[Replicate()])
    running_var = dtorch.tensor(var, device_mesh=mesh4, placements=[Replicate()])
    out = F.instance_norm(x, running_mean, running_var, momentum=0.3)
    want_mean, want_var = mean.clone(), var.clone()
    want = F.instance_norm(values, want_mean, want_var, momentum=0.3)
    torch.testing.assert_close(out.to_torch(), want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(running_mean.to_torch(), want_mean)
    torch.testing.assert_close(running_var.to_torch(), want_var)
    evaluated = F.instance_norm(x, running_mean, running_var, use_input_stats=False)
    torch.testing.assert_close(evaluated.to_torch(), F.instance_norm(values, want_mean, want_var,
                                                                     use_input_stats=False), rtol=1e-4, atol=1e-5)


def test_torchs_argument_errors_stay_torchs(mesh4):
    x = dtorch.tensor(torch.randn(4, 5), device_mesh=mesh4, placements=[Shard(0)])
    classes = dtorch.tensor(torch.tensor([0, 1, 2, 3]), device_mesh=mesh4, placements=[Shard(0)])
    with pytest.raises(ValueError, match="only p == 1 and p == 2"):
        F.multi_margin_loss(x, classes, p=3)
    with pytest.raises(ValueError, match="var is of incorrect size"):
        F.gaussian_nll_loss(x, x, x[:, :2])
    with pytest.raises(ValueError, match="3D or higher"):
        F.local_response_norm(x, 2)
    with pytest.raises(RuntimeError, match="same number of columns"):
        torch.cdist(x, x[:, :2])


# --- torch._foreach_* on lists of DTensors ----------------------------------------------------------------
SHAPES_AND_PLACEMENTS = [((5, 3), [Shard(0), Shard(1)]), ((4,), [Replicate(), Replicate()]),
                         ((2, 7), [Shard(1), Replicate()])]
FOREACH = {   # name -> call(lists, scalars); lists: four lists of tensors alike, scalars one per tensor
    "_foreach_mul_ scalar": lambda t, s: torch._foreach_mul_(t[0], 0.9),
    "_foreach_mul_ scalar list": lambda t, s: torch._foreach_mul_(t[0], s),
    "_foreach_mul_ tensors": lambda t, s: torch._foreach_mul_(t[0], t[1]),
    "_foreach_add_ alpha": lambda t, s: torch._foreach_add_(t[0], t[1], alpha=0.1),
    "_foreach_add_ scalar": lambda t, s: torch._foreach_add_(t[0], 2.0),
    "_foreach_sub_": lambda t, s: torch._foreach_sub_(t[0], t[1], alpha=3),
    "_foreach_div_": lambda t, s: torch._foreach_div_(t[0], s),
    "_foreach_lerp_": lambda t, s: torch._foreach_lerp_(t[0], t[1], 0.25),
    "_foreach_lerp_ tensor weights": lambda t, s: torch._foreach_lerp_(t[0], t[1], t[2]),
    "_foreach_copy_": lambda t, s: torch._foreach_copy_(t[0], t[1]),
    "_foreach_zero_": lambda t, s: torch._foreach_zero_(t[0]),
    "_foreach_addcmul_": lambda t, s: torch._foreach_addcmul_(t[0], t[1], t[2], value=0.5),
    "_foreach_addcmul_ scalar list": lambda t, s: torch._foreach_addcmul_(t[0], t[1], t[2], s),
    "_foreach_addcmul_ scalars tensor": lambda t, s: torch._foreach_addcmul_(t[0], t[1], t[2], torch.tensor(s)),
    "_foreach_addcdiv_": lambda t, s: torch._foreach_addcdiv_(t[0], t[1], t[3], 2.0),
    "_foreach_mul": lambda t, s: torch._foreach_mul(t[0], t[1]),
    "_foreach_add": lambda t, s: torch._foreach_add(t[0], s),
    "_foreach_sub scalar": lambda t, s: torch._foreach_sub(t[0], 1.5),
    "_foreach_lerp": lambda t, s: torch._foreach_lerp(t[0], t[1], 0.5),
    "_foreach_norm": lambda t, s: torch._foreach_norm(t[0]),
    "_foreach_norm ord 1": lambda t, s: torch._foreach_norm(t[0], 1),
}


@pytest.mark.parametrize("name", list(FOREACH))
def test_foreach_on_dtensors_equals_torchs(mesh22, name):
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    values = [[torch.rand(shape, generator=g) + 0.5 for shape, _ in SHAPES_AND_PLACEMENTS] for _ in range(4)]
    scalars = [0.5, -2.0, 3.0]
    want_lists = [[v.clone() for v in vs] for vs in values]
    want = FOREACH[name](want_lists, scalars)
    lists = [[dtorch.tensor(v, device_mesh=mesh22, placements=p) for v, (_, p) in zip(vs, SHAPES_AND_PLACEMENTS)]
             for vs in values]
    targets = list(lists[0])
    got = FOREACH[name](lists, scalars)
    assert type(got) is type(want) and len(got) == len(want)
    for result, expected in zip(got, want):
        torch.testing.assert_close(result.to_torch(), expected)
    for target, before, expected, (_, placements) in zip(lists[0], targets, want_lists[0], SHAPES_AND_PLACEMENTS):
        assert target is before and list(target.placements) == placements   # in place: the same objects, layouts
        torch.testing.assert_close(target.to_torch(), expected)


def test_an_ema_of_a_model_with_foreach(mesh4):
    model = dtorch.nn.Linear(6, 4, device_mesh=mesh4)
    ema = [p.detach().clone() for p in model.parameters()]
    before = [e.to_torch() for e in ema]
    with torch.no_grad():
        torch._foreach_lerp_(ema, [p * 0 for p in model.parameters()], 0.1)
    for e, b in zip(ema, before):
        torch.testing.assert_close(e.to_torch(), b * 0.9)


@pytest.mark.parametrize("ema", [False, True], ids=["swa", "ema"])
def test_torchs_averaged_model_averages_a_distributed_model(mesh4, ema):
    """torch.optim.swa_utils.AveragedModel (SWA, or EMA with get_ema_multi_avg_fn) groups the
    parameters with torch's C++ _group_tensors_by_device_and_dtype, which refused DTensors, and
    asks torch.is_floating_point of each group."""
    import copy
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
    torch.manual_seed(0)
    reference = torch.nn.Linear(3, 2)
    model = dtorch.distribute_module(copy.deepcopy(reference), mesh4)
    kwargs = {"multi_avg_fn": get_ema_multi_avg_fn(0.9)} if ema else {}
    want, got = AveragedModel(reference, **kwargs), AveragedModel(model, **kwargs)
    for _ in range(3):
        with torch.no_grad():
            for a, b in zip(reference.parameters(), model.parameters()):
                a.mul_(1.1)
                b.mul_(1.1)
        want.update_parameters(reference)
        got.update_parameters(model)
    for a, b in zip(want.module.parameters(), got.module.parameters()):
        torch.testing.assert_close(b.to_torch(), a.detach())
    x = dtorch.ones(2, 3, device_mesh=mesh4, placements=[Replicate()])
    assert torch.is_floating_point(x) and not torch.is_complex(x) and torch.is_signed(x) and torch.numel(x) == 6


# --- torch.nn.utils.vector_to_parameters ------------------------------------------------------------------
@pytest.mark.parametrize("vec_placement", [Shard(0), Replicate()])
def test_vector_to_parameters_fills_each_parameter_in_its_own_layout(mesh22, vec_placement):
    model = dtorch.nn.Sequential(dtorch.nn.Linear(5, 3, device_mesh=mesh22), dtorch.nn.Linear(3, 2, bias=False,
                                                                                             device_mesh=mesh22))
    layouts = [list(p.placements) for p in model.parameters()]
    count = sum(p.numel() for p in model.parameters())
    values = torch.randn(count)
    vec = dtorch.tensor(values, device_mesh=mesh22, placements=[vec_placement, Replicate()])
    torch.nn.utils.vector_to_parameters(vec, model.parameters())
    pointer = 0
    for p, layout in zip(model.parameters(), layouts):
        assert list(p.placements) == layout and p.requires_grad and p.grad is None
        torch.testing.assert_close(p.to_torch(), values[pointer:pointer + p.numel()].reshape(p.shape))
        pointer += p.numel()
    torch.testing.assert_close(torch.nn.utils.parameters_to_vector(model.parameters()).to_torch(), values)
    plain = [torch.zeros(2, 2)]   # torch parameters still go to torch's own
    torch.nn.utils.vector_to_parameters(torch.ones(4), plain)
    assert torch.equal(plain[0], torch.ones(2, 2))

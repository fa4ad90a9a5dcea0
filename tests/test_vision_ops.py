"""Vision ops beyond the sweep (tests/test_ops_sweep.py runs every sample of dtorch/ops/vision.py
and vision_norm.py on every placement): conv2d's (and conv1d's, conv3d's, conv_transpose*d's)
stride/padding/dilation/groups forms on the tensor-parallel layouts, batch_norm's training mode
across ranks against torch (output and running statistics), the torch.nn.functional spellings, and
the refusals of spatial shards."""
import pytest
import torch
import torch.nn.functional as F

import dtorch
import dtorch.nn.functional as DF
from dtorch import Partial, Replicate, Shard
from dtorch.errors import PlacementError, UnsupportedOpError
from support import assert_same

pytestmark = pytest.mark.timeout(240)
R = Replicate()


def _up(value, mesh, placements):
    return dtorch.tensor(value, device_mesh=mesh, placements=placements)


def _image(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))


# --- conv2d -----------------------------------------------------------------------------------------
CONV_VARIANTS = [dict(), dict(stride=2, padding=1), dict(stride=(2, 1), padding=(0, 2), dilation=(1, 2)),
                 dict(padding="same", dilation=2), dict(padding="valid")]
CONV_LAYOUTS = {   # input, weight, bias placements on a 4-way mesh -> the output's
    "batch": ([Shard(0)], [R], [R], [Shard(0)]),
    "out-channels": ([R], [Shard(0)], [Shard(0)], [Shard(1)]),
    "in-channels": ([Shard(1)], [Shard(1)], [Partial()], [Partial()]),
}


@pytest.mark.usefixtures("strict")
@pytest.mark.parametrize("layout", sorted(CONV_LAYOUTS))
@pytest.mark.parametrize("variant", range(len(CONV_VARIANTS)))
def test_conv2d_variants_on_each_layout(mesh4, layout, variant):
    x, w, b = _image(5, 6, 9, 8), _image(7, 6, 3, 3), _image(7)      # 5, 6, 7: uneven on 4 ranks
    px, pw, pb, out = CONV_LAYOUTS[layout]
    got = F.conv2d(_up(x, mesh4, px), _up(w, mesh4, pw), _up(b, mesh4, pb), **CONV_VARIANTS[variant])
    assert list(got.placements) == out
    assert_same(got.to_torch(), F.conv2d(x, w, b, **CONV_VARIANTS[variant]))


@pytest.mark.usefixtures("strict")
@pytest.mark.parametrize("channels, per_group_out", [(8, 1), (6, 1), (4, 2), (12, 3)])
def test_grouped_conv2d_splits_whole_groups(mesh4, channels, per_group_out):
    # depthwise (groups = channels): 6 channels on 4 ranks are 2, 2, 2, 0 whole groups
    x, w, b = _image(3, channels, 6, 6), _image(channels * per_group_out, 1, 3, 3), _image(channels * per_group_out)
    got = DF.conv2d(_up(x, mesh4, [Shard(1)]), _up(w, mesh4, [Shard(0)]), _up(b, mesh4, [R]), padding=1,
                    groups=channels)
    assert got.placements == (Shard(1),)
    assert_same(got.to_torch(), F.conv2d(x, w, b, padding=1, groups=channels))


def test_grouped_conv2d_refuses_split_groups(mesh4, strict):
    x, w = _image(2, 6, 5, 5), _image(6, 3, 3, 3)      # 2 groups of 3 channels: 4 ranks split them
    with pytest.raises(PlacementError, match="whole groups"):
        DF.conv2d(_up(x, mesh4, [Shard(1)]), _up(w, mesh4, [Shard(0)]), groups=2)


def test_conv2d_on_a_two_dim_mesh(mesh22, strict):
    # data parallel on 'dp', in-channels split on 'tp': a P(sum) on 'tp' only
    x, w = _image(4, 6, 7, 7), _image(5, 6, 3, 3)
    got = DF.conv2d(_up(x, mesh22, [Shard(0), Shard(1)]), _up(w, mesh22, [R, Shard(1)]), stride=2)
    assert got.placements == (Shard(0), Partial())
    assert_same(got.to_torch(), F.conv2d(x, w, stride=2))


def test_conv2d_in_channels_with_a_replicated_bias(mesh4, strict, automatic):
    # the bias must be added once: strict mode names the free move to P(sum), automatic makes it
    x, w, b = _image(2, 8, 5, 5), _image(3, 8, 3, 3), _image(3)
    args = (_up(x, mesh4, [Shard(1)]), _up(w, mesh4, [Shard(1)]), _up(b, mesh4, [R]))
    dtorch.set_strict(True)
    with pytest.raises(PlacementError, match="bias must be P\\(sum\\) too"):
        DF.conv2d(*args)
    dtorch.set_strict(False)
    assert_same(DF.conv2d(*args).to_torch(), F.conv2d(x, w, b))


# --- conv1d, conv3d, conv_transpose1d/2d/3d: one rule; the transposed weight is (in, out / groups, k...)
TRANSPOSED_LAYOUTS = {
    "batch": ([Shard(0)], [R], [R], [Shard(0)]),
    "out-channels": ([R], [Shard(1)], [Shard(0)], [Shard(1)]),
    "in-channels": ([Shard(1)], [Shard(0)], [Partial()], [Partial()]),
}
CONVOLUTIONS = {   # op -> (input, weight shape; variants): 5 images, 6 in- and 7 out-channels, uneven on 4 ranks
    "conv1d": ((5, 6, 9), (7, 6, 3), [dict(), dict(stride=2, padding=2, dilation=3), dict(padding="same")]),
    "conv3d": ((5, 6, 5, 4, 6), (7, 6, 3, 2, 3), [dict(), dict(stride=(2, 1, 2), padding=1),
                                                 dict(padding="same", dilation=(1, 2, 1))]),
    "conv_transpose1d": ((5, 6, 9), (6, 7, 3), [dict(), dict(stride=3, padding=1, output_padding=2),
                                                dict(stride=2, dilation=2, output_padding=1)]),
    "conv_transpose2d": ((5, 6, 5, 4), (6, 7, 3, 2), [dict(), dict(stride=2, padding=(1, 0), output_padding=1),
                                                      dict(stride=(1, 2), dilation=(2, 1), padding=1)]),
    "conv_transpose3d": ((5, 6, 3, 4, 3), (6, 7, 2, 3, 2), [dict(), dict(stride=2, output_padding=(1, 0, 1)),
                                                            dict(dilation=2, padding=(0, 1, 1))]),
}


@pytest.mark.usefixtures("strict")
@pytest.mark.parametrize("layout", sorted(CONV_LAYOUTS))
@pytest.mark.parametrize("variant", range(3))
@pytest.mark.parametrize("op", sorted(CONVOLUTIONS))
def test_convolutions_on_each_layout(mesh4, op, layout, variant):
    x_shape, w_shape, variants = CONVOLUTIONS[op]
    x, w, b = _image(*x_shape), _image(*w_shape), _image(7)
    px, pw, pb, out = (TRANSPOSED_LAYOUTS if "transpose" in op else CONV_LAYOUTS)[layout]
    got = getattr(F, op)(_up(x, mesh4, px), _up(w, mesh4, pw), _up(b, mesh4, pb), **variants[variant])
    assert list(got.placements) == out
    assert_same(got.to_torch(), getattr(F, op)(x, w, b, **variants[variant]))


@pytest.mark.usefixtures("strict")
@pytest.mark.parametrize("channels, per_group_out", [(4, 3), (6, 1), (8, 2), (3, 2)])
@pytest.mark.parametrize("op", ["conv_transpose1d", "conv_transpose2d"])
def test_grouped_conv_transpose_splits_whole_groups(mesh4, op, channels, per_group_out):
    # depthwise: every rank's block of input channels, weight rows and output channels is the
    # same groups though the output has per_group_out channels a group (3 on 4 ranks: 1, 1, 1, 0)
    spatial = (6,) * (int(op[-2]))
    x, w, b = _image(3, channels, *spatial), _image(channels, per_group_out, *(3,) * len(spatial)), \
        _image(channels * per_group_out)
    got = getattr(F, op)(_up(x, mesh4, [Shard(1)]), _up(w, mesh4, [Shard(0)]), _up(b, mesh4, [Shard(0)]),
                         padding=1, groups=channels)
    assert got.placements == (Shard(1),)
    assert_same(got.to_torch(), getattr(F, op)(x, w, b, padding=1, groups=channels))


def test_grouped_conv_transpose_refuses_groups_its_output_would_split(mesh4, strict):
    # 2 groups of 4 in-channels: 8 rows on 4 ranks are 2 each, so no rank holds a whole group
    x, w = _image(2, 8, 5, 5), _image(8, 3, 3, 3)
    with pytest.raises(PlacementError, match="whole groups"):
        F.conv_transpose2d(_up(x, mesh4, [Shard(1)]), _up(w, mesh4, [Shard(0)]), groups=2)


@pytest.mark.parametrize("op, x, w, message", [
    ("conv3d", (2, 3, 6, 5, 4), (4, 3, 3, 3, 3), "conv3d reads windows across sharded spatial dim 2"),
    ("conv_transpose2d", (2, 3, 6, 5), (3, 4, 3, 3), "conv_transpose2d reads windows across sharded spatial dim 2"),
    ("conv1d", (2, 3, 6), (4, 3, 3), "conv1d reads windows across sharded spatial dim 2"),
])
def test_convolutions_refuse_a_spatial_shard_and_name_the_legal_layouts(mesh4, strict, op, x, w, message):
    a, weight = _image(*x), _image(*w)
    with pytest.raises(PlacementError) as refused:
        getattr(F, op)(_up(a, mesh4, [Shard(2)]), _up(weight, mesh4, [R]))
    text = str(refused.value)
    assert message in text and "halo exchange" in text and "Fix:" in text
    dtorch.set_strict(False)
    assert_same(getattr(F, op)(_up(a, mesh4, [Shard(2)]), _up(weight, mesh4, [R])).to_torch(),
                getattr(F, op)(a, weight))


def test_conv_transpose_in_channels_need_the_weight_split_on_its_dim_0(mesh4, strict):
    x, w = _image(2, 8, 5, 5), _image(8, 3, 3, 3)
    with pytest.raises(PlacementError, match="input S\\(1\\) and weight S\\(0\\) together"):
        F.conv_transpose2d(_up(x, mesh4, [Shard(1)]), _up(w, mesh4, [Shard(1)]))


# --- batch_norm ------------------------------------------------------------------------------------
def _torch_batch_norm_training(x, mean, var, weight, bias, momentum, eps):
    mean, var = mean.clone(), var.clone()
    out = F.batch_norm(x, mean, var, weight, bias, True, momentum, eps)
    return out, mean, var


@pytest.mark.usefixtures("strict")      # the all-reduce of the moments is explicit: strict mode works
@pytest.mark.parametrize("mesh_name, placements", [("mesh4", [Shard(0)]), ("mesh4", [Shard(2)]),
                                                   ("mesh4", [Shard(1)]), ("mesh22", [Shard(0), Shard(1)]),
                                                   ("mesh22", [Shard(0), Shard(0)])])
def test_batch_norm_training_across_ranks_matches_torch(request, mesh_name, placements):
    mesh = request.getfixturevalue(mesh_name)
    x = _image(6, 5, 4, 3) * 3 + 2                 # 6 rows on 4 ranks: 2, 2, 2, 0
    mean, var, weight, bias = torch.randn(5), torch.rand(5) + 0.5, torch.randn(5), torch.randn(5)
    stats = [_up(t, mesh, [R] * mesh.ndim) for t in (mean, var, weight, bias)]
    out, new_mean, new_var = DF.batch_norm_with_running_stats(_up(x, mesh, placements), *stats, training=True,
                                                              momentum=0.3, eps=1e-4)
    want = _torch_batch_norm_training(x, mean, var, weight, bias, 0.3, 1e-4)
    assert out.placements == tuple(placements)
    for got, expected in zip((out, new_mean, new_var), want):
        assert_same(got.to_torch(), expected)
    for spelling in (DF.batch_norm, F.batch_norm):
        assert_same(spelling(_up(x, mesh, placements), None, None, weight=stats[2], training=True).to_torch(),
                    F.batch_norm(x, None, None, weight, training=True))


def test_batch_norm_eval_mode_is_per_channel(mesh22, strict):
    x, mean, var, weight = _image(5, 4, 3, 3), torch.randn(4), torch.rand(4) + 0.5, torch.randn(4)
    args = [_up(t, mesh22, [R, R]) for t in (mean, var, weight)]
    for placements in ([Shard(0), Shard(2)], [Shard(1), Shard(3)], [Shard(3), Shard(1)]):
        got, same_mean, _ = DF.batch_norm_with_running_stats(_up(x, mesh22, placements), *args)
        assert same_mean is args[0] and got.placements == tuple(placements)
        assert_same(got.to_torch(), F.batch_norm(x, mean, var, weight))
        assert_same(F.batch_norm(_up(x, mesh22, placements), *args).to_torch(), F.batch_norm(x, mean, var, weight))


@pytest.mark.parametrize("spelling", ["torch", "dtorch"])
def test_batch_norm_training_updates_the_running_stats_in_place_as_torch(mesh22, spelling):
    """F.batch_norm(training=True) with running statistics, torch's spelling (as torch.nn.BatchNorm2d
    calls it) or dtorch's: the output and its gradient equal torch's, and running_mean /
    running_var are changed in place (the same objects, no autograd history), over three steps."""
    call = F.batch_norm if spelling == "torch" else DF.batch_norm
    x = _image(6, 5, 4, 3) * 3 + 2
    mean, var, weight = torch.randn(5), torch.rand(5) + 0.5, torch.randn(5)
    running = [_up(t, mesh22, [R, R]) for t in (mean, var)]
    ids = [id(t) for t in running]
    w = _up(weight, mesh22, [R, R]).requires_grad_()
    reference_weight = weight.clone().requires_grad_()
    for step in range(3):
        x_step = x + step
        out = call(_up(x_step, mesh22, [Shard(0), Shard(2)]), *running, w, None, True, 0.2, 1e-5)
        expected = F.batch_norm(x_step, mean, var, reference_weight, None, True, 0.2, 1e-5)
        assert_same(out.to_torch(), expected.detach())
        (out * out).sum().backward()
        (expected * expected).sum().backward()
    assert [id(t) for t in running] == ids and not any(t.requires_grad for t in running)
    assert_same(running[0].to_torch(), mean)
    assert_same(running[1].to_torch(), var)
    torch.testing.assert_close(w.grad.to_torch(), reference_weight.grad, rtol=1e-4, atol=1e-4)


def test_the_batch_norm_op_itself_refuses_running_stats_in_training(mesh4):
    x, mean, var = _up(_image(4, 3, 2, 2), mesh4, [Shard(0)]), _up(torch.zeros(3), mesh4, [R]), \
        _up(torch.ones(3), mesh4, [R])
    with pytest.raises(UnsupportedOpError, match="torch.nn.functional.batch_norm.*batch_norm_with_running_stats"):
        dtorch.batch_norm(x, mean, var, None, None, True, 0.1, 1e-5)
    with pytest.raises(UnsupportedOpError, match="num_batches_tracked"):
        DF.batch_norm_with_running_stats(x, mean, var, training=True, momentum=None)


# --- spellings, global pooling, refusals ---------------------------------------------------------------
def test_torch_functional_spellings_reach_the_ops(mesh4, strict):
    a = _image(5, 6, 8, 7)
    x = _up(a, mesh4, [Shard(0)])
    g = torch.randn(6)
    pairs = [
        (F.max_pool2d(x, 3, 2, 1), F.max_pool2d(a, 3, 2, 1)),
        (F.max_pool2d(x, 2, return_indices=True)[1], F.max_pool2d(a, 2, return_indices=True)[1]),
        (F.avg_pool2d(x, 3, stride=2, count_include_pad=False, padding=1),
         F.avg_pool2d(a, 3, stride=2, count_include_pad=False, padding=1)),
        (F.adaptive_avg_pool2d(x, (3, 2)), F.adaptive_avg_pool2d(a, (3, 2))),
        (F.adaptive_max_pool2d(x, 1), F.adaptive_max_pool2d(a, 1)),
        (F.adaptive_max_pool2d(x, (2, 3), return_indices=True)[1], F.adaptive_max_pool2d(a, (2, 3), True)[1]),
        (F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False),
         F.interpolate(a, scale_factor=2, mode="bilinear", align_corners=False)),
        (F.interpolate(x, size=(4, 9)), F.interpolate(a, size=(4, 9))),
        (F.group_norm(x, 3, _up(g, mesh4, [R])), F.group_norm(a, 3, g)),
        (torch.flatten(F.adaptive_avg_pool2d(x, 1), 1), torch.flatten(F.adaptive_avg_pool2d(a, 1), 1)),
    ]
    for got, want in pairs:
        assert got.placements == (Shard(0),)
        assert_same(got.to_torch(), want)


@pytest.mark.usefixtures("strict")
@pytest.mark.parametrize("pool, partial", [(F.adaptive_avg_pool2d, Partial("sum")),
                                           (F.adaptive_max_pool2d, Partial("max"))])
@pytest.mark.parametrize("dim", [2, 3])
def test_global_pooling_over_a_sharded_image_is_partial(mesh4, pool, partial, dim):
    a = _image(2, 3, 7, 6)
    got = pool(_up(a, mesh4, [Shard(dim)]), 1)
    assert got.placements == (partial,)
    assert_same(got.to_torch(), pool(a, 1))


WEIGHT = _image(2, 3, 3, 3)
SPATIAL_CALLS = {   # op -> call(image, conv weight), the same on torch tensors and DTensors
    "conv2d": lambda x, w: F.conv2d(x, w, padding=1),
    "max_pool2d": lambda x, w: F.max_pool2d(x, 2),
    "avg_pool2d": lambda x, w: F.avg_pool2d(x, 3, 1, 1),
    "adaptive_avg_pool2d": lambda x, w: F.adaptive_avg_pool2d(x, (2, 2)),
    "interpolate": lambda x, w: F.interpolate(x, scale_factor=2),
    "group_norm": lambda x, w: F.group_norm(x, 3),
    # the registry op itself: F.batch_norm computes batch statistics across spatial shards instead
    "batch_norm": lambda x, w: (dtorch.batch_norm if isinstance(x, dtorch.DTensor) else F.batch_norm)(
        x, None, None, None, None, True, 0.1, 1e-5),
}


@pytest.mark.parametrize("op", sorted(SPATIAL_CALLS))
def test_spatial_shards_are_refused_in_strict_mode_and_moved_otherwise(mesh4, op, strict):
    a = _image(4, 3, 6, 5)
    x, w = _up(a, mesh4, [Shard(2)]), _up(WEIGHT, mesh4, [R])
    with pytest.raises(PlacementError) as refused:
        SPATIAL_CALLS[op](x, w)
    message = str(refused.value)
    assert message.startswith(f"{op}: inputs [S(2)]") and "DeviceMesh" in message and "test_vision_ops.py" in message
    assert ("halo exchange" if op != "batch_norm" else "batch statistics") in message and "Fix:" in message
    dtorch.set_strict(False)
    assert_same(SPATIAL_CALLS[op](x, w).to_torch(), SPATIAL_CALLS[op](a, WEIGHT))

"""DTorch's dtorch.nn.GlobalAvgPool2d and GlobalMaxPool2d (dtorch/nn/pooling.py) against torch's
AdaptiveAvgPool2d((1, 1)) / AdaptiveMaxPool2d((1, 1)), forward and gradients, on meshes (1,),
(4,) and (2, 2) with batch, channels, height or width sharded, even and uneven shapes; channels
last with is_nchw=False."""
from __future__ import annotations

import pytest
import torch

import dtorch
from dtorch.spec.placements import Replicate, Shard
from support import assert_same

R = Replicate()


def layouts(mesh):
    return {(1,): [[R]], (4,): [[Shard(0)], [Shard(1)], [Shard(2)], [Shard(3)], [R]],
            (2, 2): [[Shard(0), Shard(1)], [Shard(2), Shard(3)], [R, Shard(0)]]}[tuple(mesh.shape)]


@pytest.mark.parametrize("ours, theirs", [(dtorch.nn.GlobalAvgPool2d, torch.nn.AdaptiveAvgPool2d),
                                          (dtorch.nn.GlobalMaxPool2d, torch.nn.AdaptiveMaxPool2d)])
def test_global_pooling_matches_torch_adaptive_pooling_to_1x1(mesh, ours, theirs):
    g = torch.Generator().manual_seed(0)
    for shape in [(4, 8, 4, 8), (5, 3, 7, 6)]:
        value = torch.randn(shape, generator=g)
        for placements in layouts(mesh):
            x = dtorch.tensor(value, device_mesh=mesh, placements=placements).requires_grad_()
            reference = value.clone().requires_grad_()
            got, want = ours()(x), theirs((1, 1))(reference)
            assert_same(got.to_torch(), want)
            scale = torch.randn(want.shape, generator=g)
            (got * dtorch.tensor(scale, device_mesh=mesh)).sum().backward()
            (want * scale).sum().backward()
            assert_same(x.grad.to_torch(), reference.grad)


def test_channels_last_and_3d_inputs(mesh4):
    value = torch.randn(5, 7, 6, 3)     # (N, H, W, C)
    x = dtorch.tensor(value, device_mesh=mesh4, placements=[Shard(1)])
    want = torch.nn.AdaptiveAvgPool2d((1, 1))(value.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)
    assert_same(dtorch.nn.GlobalAvgPool2d(is_nchw=False)(x).to_torch(), want)
    image = torch.randn(3, 7, 6)
    assert_same(dtorch.nn.GlobalAvgPool2d()(dtorch.tensor(image, device_mesh=mesh4)).to_torch(),
                torch.nn.AdaptiveAvgPool2d((1, 1))(image))
    assert repr(dtorch.nn.GlobalMaxPool2d(is_nchw=False)) == "GlobalMaxPool2d(is_nchw=False)"
    with pytest.raises(ValueError, match="GlobalAvgPool2d: expected a 3-D or 4-D input"):
        dtorch.nn.GlobalAvgPool2d()(dtorch.tensor(torch.randn(4, 4), device_mesh=mesh4))


def test_flattened_after_pooling_as_dtorchs_resnet(mesh22):
    value = torch.randn(4, 6, 5, 5)
    x = dtorch.tensor(value, device_mesh=mesh22, placements=[Shard(0), Shard(1)])
    pooled = torch.flatten(dtorch.nn.GlobalAvgPool2d()(x), 1)
    assert pooled.placements == (Shard(0), Shard(1))
    assert_same(pooled.to_torch(), torch.flatten(torch.nn.AdaptiveAvgPool2d(1)(value), 1))

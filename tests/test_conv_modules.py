"""dtorch.nn's conv layers (Conv1d/2d/3d, ConvTranspose1d/2d/3d) against torch.nn's with the same
weights: the output and every gradient, on a batch that splits unevenly over 4 ranks, laid out
data-parallel (batch S(0)) and tensor-parallel (out-channels or in-channels split); and torch.nn's
own conv layers in a model made dtorch's by distribute_module."""
from __future__ import annotations

import pytest
import torch
import torch.nn as tnn
import torch.nn.functional as F

import dtorch
from dtorch import Partial, Replicate, Shard

pytestmark = pytest.mark.timeout(300)
R = Replicate()

LAYERS = {   # name -> (positional args, keyword args, input shape: a batch of 5)
    "Conv1d": ((4, 6, 3), {"stride": 2, "padding": 1}, (5, 4, 9)),
    "Conv2d": ((4, 6, (3, 2)), {"dilation": 2}, (5, 4, 7, 6)),
    "Conv3d": ((3, 5, 3), {"padding": "same"}, (5, 3, 4, 3, 4)),
    "ConvTranspose1d": ((4, 6, 3), {"stride": 2, "output_padding": 1}, (5, 4, 7)),
    "ConvTranspose2d": ((4, 6, 3), {"stride": 2, "padding": 1, "dilation": (1, 2)}, (5, 4, 5, 6)),
    "ConvTranspose3d": ((3, 5, 2), {"stride": (2, 1, 1), "bias": False}, (5, 3, 3, 2, 3)),
}
LAYOUTS = {   # input, weight (by its in / out-channel dim), bias placements -> the output's (mesh (4,))
    "batch": ([Shard(0)], R, [R], (Shard(0),)),
    "out-channels": ([R], "out", [Shard(0)], (Shard(1),)),
    "in-channels": ([Shard(1)], "in", [Partial()], (Partial(),)),
}


def _values(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed + sum(shape)))


def _weight_placement(layer, which) -> list:
    if which == R:
        return [R]
    out_dim = 1 if isinstance(layer, tnn.modules.conv._ConvTransposeNd) else 0
    return [Shard(out_dim if which == "out" else 1 - out_dim)]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_conv_layers_match_torch_forward_and_backward(mesh4, name, layout):
    args, kwargs, shape = LAYERS[name]
    torch.manual_seed(0)
    reference = getattr(tnn, name)(*args, **kwargs)
    layer = getattr(dtorch.nn, name)(*args, **kwargs, device_mesh=mesh4)
    x_placements, weight, bias_placements, out_placements = LAYOUTS[layout]
    layer.weight = dtorch.nn.Parameter(dtorch.distribute_tensor(reference.weight.detach(), mesh4,
                                                                _weight_placement(reference, weight)))
    if reference.bias is not None:
        layer.bias = dtorch.nn.Parameter(dtorch.distribute_tensor(reference.bias.detach(), mesh4, bias_placements))
    x = _values(*shape)
    reference_x = x.clone().requires_grad_()
    expected = reference(reference_x)
    weights = _values(*expected.shape, seed=1)      # every output element its own weight in the loss
    (expected * weights).sum().backward()

    got_x = dtorch.distribute_tensor(x, mesh4, x_placements).requires_grad_()
    got = layer(got_x)
    assert got.placements == out_placements
    (got * dtorch.distribute_tensor(weights, mesh4, [R])).sum().backward()
    close = dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got.to_torch(), expected.detach(), **close)
    torch.testing.assert_close(got_x.grad.to_torch(), reference_x.grad, **close)
    for (key, parameter), reference_parameter in zip(layer.named_parameters(), reference.parameters()):
        torch.testing.assert_close(parameter.grad.to_torch(), reference_parameter.grad, **close, msg=key)


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_conv_layers_shape_init_and_repr_as_torch(mesh4, name, groups):
    args, kwargs, _ = LAYERS[name]
    args = (2 * args[0], 2 * args[1]) + args[2:]
    layer = getattr(dtorch.nn, name)(*args, **kwargs, groups=groups, device_mesh=mesh4)
    reference = getattr(tnn, name)(*args, **kwargs, groups=groups)
    assert repr(layer) == repr(reference)
    bound = 1 / tnn.init._calculate_fan_in_and_fan_out(reference.weight)[0] ** 0.5   # torch's U(-bound, bound)
    for (key, parameter), reference_parameter in zip(layer.named_parameters(), reference.parameters()):
        assert parameter.shape == reference_parameter.shape, key
        assert parameter.to_torch().abs().max().item() <= bound, key


class _TinyUNet(tnn.Module):
    """A torch model as users write one: a strided Conv2d down, a ConvTranspose2d back up to the
    input's own size (output_size=), a skip connection; a Conv3d / ConvTranspose3d pair and a
    Conv1d / ConvTranspose1d pair (audio) on their own inputs."""

    def __init__(self):
        super().__init__()
        self.down, self.up = tnn.Conv2d(3, 6, 3, stride=2, padding=1), tnn.ConvTranspose2d(6, 3, 3, stride=2, padding=1)
        self.volume = tnn.Sequential(tnn.Conv3d(2, 4, 3, padding=1), tnn.ReLU(), tnn.ConvTranspose3d(4, 2, 2, stride=2))
        self.audio = tnn.Sequential(tnn.Conv1d(2, 4, 5, stride=2), tnn.Tanh(), tnn.ConvTranspose1d(4, 2, 5, stride=2))

    def forward(self, image, volume, sound):
        image = self.up(F.relu(self.down(image)), output_size=image.shape) + image
        return image.sum() + (self.volume(volume) ** 2).mean() + self.audio(sound).abs().sum()


def test_torch_conv_layers_distributed_with_distribute_module(mesh4):
    torch.manual_seed(3)
    reference = _TinyUNet()
    model = dtorch.distribute_module(_TinyUNet(), mesh4)
    model.load_state_dict(reference.state_dict())
    inputs = [_values(5, 3, 7, 6), _values(5, 2, 3, 4, 3), _values(5, 2, 17)]    # 5: uneven over 4 ranks
    expected = reference(*inputs)
    expected.backward()
    got = model(*(dtorch.distribute_tensor(t, mesh4, [Shard(0)]) for t in inputs))
    got.backward()
    torch.testing.assert_close(got.to_torch(), expected.detach(), rtol=1e-4, atol=1e-4)
    for (key, parameter), reference_parameter in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(parameter.grad.to_torch(), reference_parameter.grad, rtol=1e-4, atol=1e-4, msg=key)

"""dtorch.models.convnets (AlexNet, ResNet) and the vision layers against torchvision-style torch
definitions written here, with the same weights: eval and training mode (BatchNorm with the
global batch's statistics, running statistics updated as torch does) on data-parallel layouts."""
from __future__ import annotations

import pytest
import torch

import dtorch
from dtorch import Shard, nn
from dtorch.models.convnets import AlexNet, BasicBlock, Bottleneck, ResNet

from support import assert_same

pytestmark = pytest.mark.timeout(300)
T = torch.nn


class TorchAlexNet(T.Module):
    def __init__(self, num_classes, widths, hidden):
        super().__init__()
        a, b, c, d, e = widths
        self.features = T.Sequential(
            T.Conv2d(3, a, 11, 4, 2), T.ReLU(), T.MaxPool2d(3, 2), T.Conv2d(a, b, 5, padding=2), T.ReLU(),
            T.MaxPool2d(3, 2), T.Conv2d(b, c, 3, padding=1), T.ReLU(), T.Conv2d(c, d, 3, padding=1), T.ReLU(),
            T.Conv2d(d, e, 3, padding=1), T.ReLU(), T.MaxPool2d(3, 2))
        self.avgpool = T.AdaptiveAvgPool2d((6, 6))
        self.classifier = T.Sequential(T.Dropout(), T.Linear(e * 36, hidden), T.ReLU(), T.Dropout(),
                                       T.Linear(hidden, hidden), T.ReLU(), T.Linear(hidden, num_classes))

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


class TorchBasicBlock(T.Module):
    expansion = 1

    def __init__(self, cin, width, stride, downsample):
        super().__init__()
        self.conv1, self.bn1 = T.Conv2d(cin, width, 3, stride, 1, bias=False), T.BatchNorm2d(width)
        self.relu = T.ReLU()
        self.conv2, self.bn2 = T.Conv2d(width, width, 3, 1, 1, bias=False), T.BatchNorm2d(width)
        self.downsample = downsample

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x))))) + identity)


class TorchBottleneck(T.Module):
    expansion = 4

    def __init__(self, cin, width, stride, downsample):
        super().__init__()
        self.conv1, self.bn1 = T.Conv2d(cin, width, 1, bias=False), T.BatchNorm2d(width)
        self.conv2, self.bn2 = T.Conv2d(width, width, 3, stride, 1, bias=False), T.BatchNorm2d(width)
        self.conv3, self.bn3 = T.Conv2d(width, width * 4, 1, bias=False), T.BatchNorm2d(width * 4)
        self.relu, self.downsample = T.ReLU(), downsample

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x))))))
        return self.relu(self.bn3(self.conv3(out)) + identity)


class TorchResNet(T.Module):
    def __init__(self, block, layers, num_classes, widths):
        super().__init__()
        self.inplanes = widths[0]
        self.conv1 = T.Conv2d(3, widths[0], 7, 2, 3, bias=False)
        self.bn1, self.relu, self.maxpool = T.BatchNorm2d(widths[0]), T.ReLU(), T.MaxPool2d(3, 2, 1)
        self.layer1, self.layer2, self.layer3, self.layer4 = (
            self._stage(block, w, n, s) for w, n, s in zip(widths, layers, (1, 2, 2, 2)))
        self.avgpool, self.fc = T.AdaptiveAvgPool2d((1, 1)), T.Linear(widths[3] * block.expansion, num_classes)

    def _stage(self, block, width, count, stride):
        downsample = None
        if stride != 1 or self.inplanes != width * block.expansion:
            downsample = T.Sequential(T.Conv2d(self.inplanes, width * block.expansion, 1, stride, bias=False),
                                      T.BatchNorm2d(width * block.expansion))
        blocks = [block(self.inplanes, width, stride, downsample)]
        self.inplanes = width * block.expansion
        return T.Sequential(*blocks, *[block(self.inplanes, width, 1, None) for _ in range(1, count)])

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


@pytest.fixture(params=["mesh1", "mesh4", "mesh22"])
def dp_mesh(request):
    return request.getfixturevalue(request.param)


def same_weights(model: nn.Module, reference: T.Module) -> T.Module:
    reference.load_state_dict({k: v.to_torch() for k, v in model.state_dict().items()})
    return reference


def test_alexnet_matches_torch(dp_mesh):
    widths, hidden = (8, 12, 16, 12, 12), 32
    model = AlexNet(10, device_mesh=dp_mesh, widths=widths, hidden=hidden).eval()
    reference = same_weights(model, TorchAlexNet(10, widths, hidden)).eval()
    images = torch.randn(5, 3, 67, 67)            # 5 images: uneven over dp
    with torch.no_grad():
        assert_same(model(images).to_torch(), reference(images))


@pytest.mark.parametrize("block, torch_block, layers", [(BasicBlock, TorchBasicBlock, [1, 1, 1, 1]),
                                                        (Bottleneck, TorchBottleneck, [1, 2, 1, 1])],
                         ids=["basic", "bottleneck"])
def test_resnet_matches_torch_in_eval_and_training(block, torch_block, layers, dp_mesh):
    widths = (4, 8, 8, 16)
    model = ResNet(block, layers, 7, device_mesh=dp_mesh, widths=widths)
    reference = same_weights(model, TorchResNet(torch_block, layers, 7, widths))
    images = torch.randn(6, 3, 32, 32)
    model.eval(), reference.eval()
    with torch.no_grad():
        assert_same(model(images).to_torch(), reference(images))
    model.train(), reference.train()
    with torch.no_grad():
        for _ in range(2):   # training mode twice: the running statistics must follow torch's
            out, expected = model(images), reference(images)
            torch.testing.assert_close(out.to_torch(), expected, rtol=1e-4, atol=1e-4)
    for name, buffer in reference.named_buffers():
        torch.testing.assert_close(model.get_buffer(name).to_torch(), buffer, rtol=1e-5, atol=1e-5)


def test_batchnorm_with_the_batch_sharded_uses_the_global_batch(mesh4):
    layer, reference = nn.BatchNorm2d(3, device_mesh=mesh4), T.BatchNorm2d(3)
    x = torch.randn(7, 3, 4, 4) * 3 + 1
    out = layer(dtorch.tensor(x, device_mesh=mesh4, placements=[Shard(0)]))
    torch.testing.assert_close(out.to_torch(), reference(x).detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.running_var.to_torch(), reference.running_var, rtol=1e-5, atol=1e-5)
    assert layer.num_batches_tracked.item() == 1


@pytest.mark.parametrize("momentum", [0.1, None])
def test_batchnorm_trains_step_after_step_as_torch(mesh4, momentum):
    """The running statistics were rebound to outputs that carried the step's autograd graph, so
    the second step's backward reached into the first's ("backward through the graph a second
    time"): any training loop over dtorch.models.convnets's ResNet. They are updated in place now,
    without history, and a compiled step replays (momentum=None: captured again each call)."""
    layer, reference = nn.BatchNorm2d(3, momentum=momentum, device_mesh=mesh4), T.BatchNorm2d(3, momentum=momentum)
    step = dtorch.compile(lambda x: (layer(x) * x).sum().backward())
    g = torch.Generator().manual_seed(0)
    for call in range(4):
        x = torch.randn(7, 3, 4, 4, generator=g) * 3 + 1
        dx = dtorch.tensor(x, device_mesh=mesh4, placements=[Shard(0)])
        layer.zero_grad()
        reference.zero_grad()
        if call < 2:
            (layer(dx) * dx).sum().backward()
        else:
            step(dx)
        (reference(x) * x).sum().backward()
        torch.testing.assert_close(layer.running_mean.to_torch(), reference.running_mean, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer.running_var.to_torch(), reference.running_var, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer.weight.grad.to_torch(), reference.weight.grad, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(layer.bias.grad.to_torch(), reference.bias.grad, rtol=1e-4, atol=1e-4)
    assert layer.num_batches_tracked.item() == 4
    assert not layer.running_mean.requires_grad
    assert step.captures == (1 if momentum else 2)


@pytest.mark.parametrize("make, reference", [
    (lambda m: nn.Conv2d(4, 6, 3, stride=2, padding=1, device_mesh=m), T.Conv2d(4, 6, 3, stride=2, padding=1)),
    (lambda m: nn.Conv2d(4, 6, (3, 1), padding="same", groups=2, device_mesh=m),
     T.Conv2d(4, 6, (3, 1), padding="same", groups=2)),
    (lambda m: nn.GroupNorm(2, 4, device_mesh=m), T.GroupNorm(2, 4)),
], ids=["conv_strided", "conv_grouped_same", "group_norm"])
def test_layers_match_torch(make, reference, dp_mesh):
    layer = make(dp_mesh)
    reference = same_weights(layer, reference)
    x = torch.randn(5, 4, 9, 9)
    placements = [Shard(0)] + [dtorch.Replicate()] * (dp_mesh.ndim - 1)
    out = layer(dtorch.tensor(x, device_mesh=dp_mesh, placements=placements))
    assert_same(out.to_torch(), reference(x).detach())


@pytest.mark.parametrize("name, args", [("MaxPool2d", (3, 2, 1)), ("AvgPool2d", (2,)), ("AdaptiveAvgPool2d", (1,)),
                                        ("AdaptiveMaxPool2d", ((2, 3),))])
def test_pooling_layers_match_torch(name, args, mesh4):
    x = torch.randn(6, 3, 9, 8)
    out = getattr(nn, name)(*args)(dtorch.tensor(x, device_mesh=mesh4, placements=[Shard(0)]))
    assert_same(out.to_torch(), getattr(T, name)(*args)(x))

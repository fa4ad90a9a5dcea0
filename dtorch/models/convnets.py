"""The small vision models DTorch runs: AlexNet and ResNet (BasicBlock / Bottleneck), with
torchvision's structure and parameter names, so a torchvision state_dict loads as is. Widths are
parameters (torchvision's by default) so tests can build small ones.

Data parallel is the layout these models are for: feed a batch sharded S(0) over the mesh's batch
dim; parameters are replicated, and BatchNorm in training mode normalizes with the statistics of
the whole global batch (like SyncBatchNorm), so any layout gives single-process torch's results.
"""
from __future__ import annotations

from collections.abc import Sequence


from .. import nn
from ..spec.placements import DeviceMesh, Replicate, Shard
from ..dtensor.factories import tensor as upload
from ..dtensor.tensor import DTensor

__all__ = ["AlexNet", "ResNet", "BasicBlock", "Bottleneck", "resnet18", "resnet50", "image_placements"]


def image_placements(mesh: DeviceMesh) -> list:
    """Images (N, C, H, W): the batch over "dp" (or the only mesh dim of an unnamed 1-D mesh)."""
    names = mesh.mesh_dim_names
    if not names:
        return [Shard(0)] + [Replicate()] * (mesh.ndim - 1)
    return [Shard(0) if n in ("dp", "fsdp") else Replicate() for n in names]


def _as_input(images, mesh: DeviceMesh) -> DTensor:
    return images if isinstance(images, DTensor) else upload(images, device_mesh=mesh,
                                                             placements=image_placements(mesh))


class AlexNet(nn.Module):
    def __init__(self, num_classes: int = 1000, dropout: float = 0.5, *, device_mesh: DeviceMesh,
                 widths: Sequence[int] = (64, 192, 384, 256, 256), hidden: int = 4096, dtype=None) -> None:
        super().__init__()
        m, a, b, c, d, e = dict(device_mesh=device_mesh, dtype=dtype), *widths
        self.features = nn.Sequential(
            nn.Conv2d(3, a, kernel_size=11, stride=4, padding=2, **m), nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(a, b, kernel_size=5, padding=2, **m), nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(b, c, kernel_size=3, padding=1, **m), nn.ReLU(inplace=True),
            nn.Conv2d(c, d, kernel_size=3, padding=1, **m), nn.ReLU(inplace=True),
            nn.Conv2d(d, e, kernel_size=3, padding=1, **m), nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2))
        self.avgpool = nn.AdaptiveAvgPool2d((6, 6))
        self.classifier = nn.Sequential(
            nn.Dropout(p=dropout), nn.Linear(e * 6 * 6, hidden, **m), nn.ReLU(inplace=True),
            nn.Dropout(p=dropout), nn.Linear(hidden, hidden, **m), nn.ReLU(inplace=True),
            nn.Linear(hidden, num_classes, **m))
        self.mesh = device_mesh

    def forward(self, images):
        x = self.avgpool(self.features(_as_input(images, self.mesh)))
        return self.classifier(x.flatten(1))


def _conv3x3(cin: int, cout: int, stride: int, m: dict) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel_size=3, stride=stride, padding=1, bias=False, **m)


def _conv1x1(cin: int, cout: int, stride: int, m: dict) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel_size=1, stride=stride, bias=False, **m)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, width: int, stride: int, downsample, m: dict) -> None:
        super().__init__()
        self.conv1, self.bn1 = _conv3x3(cin, width, stride, m), nn.BatchNorm2d(width, **m)
        self.relu = nn.ReLU(inplace=True)
        self.conv2, self.bn2 = _conv3x3(width, width, 1, m), nn.BatchNorm2d(width, **m)
        self.downsample = downsample

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int, downsample, m: dict) -> None:
        super().__init__()
        self.conv1, self.bn1 = _conv1x1(cin, width, 1, m), nn.BatchNorm2d(width, **m)
        self.conv2, self.bn2 = _conv3x3(width, width, stride, m), nn.BatchNorm2d(width, **m)
        self.conv3, self.bn3 = _conv1x1(width, width * 4, 1, m), nn.BatchNorm2d(width * 4, **m)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.relu(self.bn3(self.conv3(out)) + identity)


class ResNet(nn.Module):
    def __init__(self, block, layers: Sequence[int], num_classes: int = 1000, *, device_mesh: DeviceMesh,
                 widths: Sequence[int] = (64, 128, 256, 512), dtype=None) -> None:
        super().__init__()
        m = dict(device_mesh=device_mesh, dtype=dtype)
        self.mesh, self.inplanes = device_mesh, widths[0]
        self.conv1 = nn.Conv2d(3, widths[0], kernel_size=7, stride=2, padding=3, bias=False, **m)
        self.bn1, self.relu = nn.BatchNorm2d(widths[0], **m), nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._stage(block, widths[0], layers[0], 1, m)
        self.layer2 = self._stage(block, widths[1], layers[1], 2, m)
        self.layer3 = self._stage(block, widths[2], layers[2], 2, m)
        self.layer4 = self._stage(block, widths[3], layers[3], 2, m)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(widths[3] * block.expansion, num_classes, **m)

    def _stage(self, block, width: int, count: int, stride: int, m: dict) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != width * block.expansion:
            downsample = nn.Sequential(_conv1x1(self.inplanes, width * block.expansion, stride, m),
                                       nn.BatchNorm2d(width * block.expansion, **m))
        blocks = [block(self.inplanes, width, stride, downsample, m)]
        self.inplanes = width * block.expansion
        blocks += [block(self.inplanes, width, 1, None, m) for _ in range(1, count)]
        return nn.Sequential(*blocks)

    def forward(self, images):
        x = self.maxpool(self.relu(self.bn1(self.conv1(_as_input(images, self.mesh)))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.avgpool(x).flatten(1))


def resnet18(num_classes: int = 1000, **kwargs) -> ResNet:
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes, **kwargs)


def resnet50(num_classes: int = 1000, **kwargs) -> ResNet:
    return ResNet(Bottleneck, [3, 4, 6, 3], num_classes, **kwargs)

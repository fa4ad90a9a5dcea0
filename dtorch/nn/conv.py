"""Conv1d/2d/3d and ConvTranspose1d/2d/3d: torch's signatures and initialization, parameters
replicated (data parallel: the batch is what gets sharded). The ops' rule (dtorch/ops/vision.py)
also takes out-channel-sharded weights (tensor parallel) and in-channel-sharded inputs;
redistribute the parameters to use those."""
from __future__ import annotations

import math

import torch
from torch.nn.modules.utils import _ntuple

from ..spec.placements import DeviceMesh, Replicate
from ..dtensor.tensor import call_op
from ._layout import fan_in_bound, require_mesh, uniform
from .module import Module
from .parameter import Parameter

__all__ = ["Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d"]


class _ConvNd(Module):
    """What every conv layer shares; subclasses set `spatial_count` and give torch's signature."""
    spatial_count = 2
    transposed = False

    def _build(self, in_channels: int, out_channels: int, kernel_size, stride, padding, dilation, groups: int,
               bias: bool, padding_mode: str, dtype, device_mesh, output_padding=0) -> None:
        name = type(self).__name__
        if in_channels % groups or out_channels % groups:
            raise ValueError(f"in_channels ({in_channels}) and out_channels ({out_channels}) must be divisible "
                             f"by groups ({groups})")
        if padding_mode != "zeros":
            raise NotImplementedError(f"{name}(padding_mode={padding_mode!r}): only 'zeros' is supported")
        mesh = require_mesh(device_mesh, name)
        tuple_of = _ntuple(self.spatial_count)
        self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
        self.kernel_size, self.stride, self.dilation = tuple_of(kernel_size), tuple_of(stride), tuple_of(dilation)
        self.padding = padding if isinstance(padding, str) else tuple_of(padding)
        self.output_padding, self.padding_mode = tuple_of(output_padding), padding_mode
        # torch's layouts: a conv's weight is (out, in / groups, k...), a transposed conv's (in, out / groups, k...)
        channels = (in_channels, out_channels // groups) if self.transposed else (out_channels, in_channels // groups)
        bound = fan_in_bound(channels[1] * math.prod(self.kernel_size))
        replicated = [Replicate()] * mesh.ndim
        self.weight = Parameter(uniform(channels + self.kernel_size, bound, dtype=dtype, device_mesh=mesh,
                                        placements=replicated))
        self.register_parameter("bias", Parameter(uniform((out_channels,), bound, dtype=dtype, device_mesh=mesh,
                                                          placements=replicated)) if bias else None)

    def extra_repr(self) -> str:
        """torch's: padding, dilation, output_padding and groups only where not their defaults."""
        text = f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}"
        for name, default in (("padding", 0), ("dilation", 1), ("output_padding", 0)):
            value = getattr(self, name)
            if value != (default,) * self.spatial_count:
                text += f", {name}={value}"
        return text + (f", groups={self.groups}" if self.groups != 1 else "") + \
            ("" if self.bias is not None else ", bias=False")


class _Conv(_ConvNd):
    """torch.nn.Conv*d's signature."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, dilation=1,
                 groups: int = 1, bias: bool = True, padding_mode: str = "zeros", device=None,
                 dtype: torch.dtype | None = None, device_mesh: DeviceMesh | None = None) -> None:
        super().__init__()
        self._build(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, padding_mode,
                    dtype, device_mesh)

    def forward(self, input):
        return call_op(f"conv{self.spatial_count}d", (input, self.weight, self.bias, self.stride, self.padding,
                                                      self.dilation, self.groups), {})


class _ConvTransposeNd(_ConvNd):
    """torch.nn.ConvTranspose*d's signature, and output_size in forward."""
    transposed = True

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, output_padding=0,
                 groups: int = 1, bias: bool = True, dilation=1, padding_mode: str = "zeros", device=None,
                 dtype: torch.dtype | None = None, device_mesh: DeviceMesh | None = None) -> None:
        super().__init__()
        self._build(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, padding_mode,
                    dtype, device_mesh, output_padding)

    def forward(self, input, output_size=None):
        # the output_padding that reaches output_size: torch's own arithmetic (it reads only
        # self.output_padding, and the input's dim() and size())
        output_padding = torch.nn.modules.conv._ConvTransposeNd._output_padding(
            self, input, output_size, self.stride, self.padding, self.kernel_size, self.spatial_count, self.dilation)
        return call_op(f"conv_transpose{self.spatial_count}d", (input, self.weight, self.bias, self.stride,
                                                                self.padding, output_padding, self.groups,
                                                                self.dilation), {})


class Conv1d(_Conv):
    spatial_count = 1


class Conv2d(_Conv):
    spatial_count = 2


class Conv3d(_Conv):
    spatial_count = 3


class ConvTranspose1d(_ConvTransposeNd):
    spatial_count = 1


class ConvTranspose2d(_ConvTransposeNd):
    spatial_count = 2


class ConvTranspose3d(_ConvTransposeNd):
    spatial_count = 3

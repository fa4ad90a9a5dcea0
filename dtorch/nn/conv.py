"""Conv2d: torch's signature and initialization, parameters replicated (data parallel: the batch
is what gets sharded). The op's rule (dtorch/ops/vision.py) also takes out-channel-sharded
weights (tensor parallel) and in-channel-sharded inputs; redistribute the parameters to use those."""
from __future__ import annotations

import torch
from torch.nn.modules.utils import _pair

from ..distributed_spec import DeviceMesh, Replicate
from . import functional as F
from ._layout import fan_in_bound, require_mesh, uniform
from .module import Module
from .parameter import Parameter

__all__ = ["Conv2d"]


class Conv2d(Module):
    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, dilation=1,
                 groups: int = 1, bias: bool = True, padding_mode: str = "zeros", device=None,
                 dtype: torch.dtype | None = None, device_mesh: DeviceMesh | None = None) -> None:
        super().__init__()
        if in_channels % groups or out_channels % groups:
            raise ValueError(f"in_channels ({in_channels}) and out_channels ({out_channels}) must be divisible "
                             f"by groups ({groups})")
        if padding_mode != "zeros":
            raise NotImplementedError(f"Conv2d(padding_mode={padding_mode!r}): only 'zeros' is supported")
        mesh = require_mesh(device_mesh, "Conv2d")
        self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
        self.kernel_size, self.stride, self.dilation = _pair(kernel_size), _pair(stride), _pair(dilation)
        self.padding = padding if isinstance(padding, str) else _pair(padding)
        bound = fan_in_bound(in_channels // groups * self.kernel_size[0] * self.kernel_size[1])
        replicated = [Replicate()] * mesh.ndim
        self.weight = Parameter(uniform((out_channels, in_channels // groups, *self.kernel_size), bound, dtype=dtype,
                                        device_mesh=mesh, placements=replicated))
        self.register_parameter("bias", Parameter(uniform((out_channels,), bound, dtype=dtype, device_mesh=mesh,
                                                          placements=replicated)) if bias else None)

    def forward(self, input):
        return F.conv2d(input, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}" + (f", groups={self.groups}" if self.groups != 1 else "") +
                ("" if self.bias is not None else ", bias=False"))

"""LayerNorm, RMSNorm, GroupNorm: torch's initializations (weight 1, bias 0), parameters
replicated. A sharded input passes where the op's rule allows (dims outside the normalized
shape); the automatic redistribute moves it otherwise."""
from __future__ import annotations

import numbers

import torch

from ..spec.placements import DeviceMesh, Replicate
from ..dtensor.factories import ones, zeros
from . import functional as F
from ._layout import require_mesh
from .module import Module
from .parameter import Parameter

__all__ = ["LayerNorm", "RMSNorm", "GroupNorm"]


def _affine(shape, value_fn, dtype, mesh: DeviceMesh) -> Parameter:
    return Parameter(value_fn(*shape, dtype=dtype, device_mesh=mesh, placements=[Replicate()] * mesh.ndim))


def _shape(normalized_shape) -> tuple:
    return (normalized_shape,) if isinstance(normalized_shape, numbers.Integral) else tuple(normalized_shape)


class LayerNorm(Module):
    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 device=None, dtype: torch.dtype | None = None, device_mesh: DeviceMesh | None = None) -> None:
        super().__init__()
        mesh = require_mesh(device_mesh, "LayerNorm")
        self.normalized_shape, self.eps, self.elementwise_affine = _shape(normalized_shape), eps, elementwise_affine
        self.register_parameter("weight", _affine(self.normalized_shape, ones, dtype, mesh)
                                if elementwise_affine else None)
        self.register_parameter("bias", _affine(self.normalized_shape, zeros, dtype, mesh)
                                if elementwise_affine and bias else None)

    def forward(self, input):
        return F.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class RMSNorm(Module):
    def __init__(self, normalized_shape, eps: float | None = None, elementwise_affine: bool = True, device=None,
                 dtype: torch.dtype | None = None, device_mesh: DeviceMesh | None = None) -> None:
        super().__init__()
        mesh = require_mesh(device_mesh, "RMSNorm")
        self.normalized_shape, self.eps, self.elementwise_affine = _shape(normalized_shape), eps, elementwise_affine
        self.register_parameter("weight", _affine(self.normalized_shape, ones, dtype, mesh)
                                if elementwise_affine else None)

    def forward(self, input):
        return F.rms_norm(input, self.normalized_shape, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class GroupNorm(Module):
    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5, affine: bool = True, device=None,
                 dtype: torch.dtype | None = None, device_mesh: DeviceMesh | None = None) -> None:
        super().__init__()
        if num_channels % num_groups:
            raise ValueError(f"num_channels ({num_channels}) must be divisible by num_groups ({num_groups})")
        mesh = require_mesh(device_mesh, "GroupNorm")
        self.num_groups, self.num_channels, self.eps, self.affine = num_groups, num_channels, eps, affine
        self.register_parameter("weight", _affine((num_channels,), ones, dtype, mesh) if affine else None)
        self.register_parameter("bias", _affine((num_channels,), zeros, dtype, mesh) if affine else None)

    def forward(self, input):
        return F.group_norm(input, self.num_groups, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.num_groups}, {self.num_channels}, eps={self.eps}, affine={self.affine}"

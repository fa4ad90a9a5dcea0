"""Pooling layers: torch's own classes, made dtorch Modules; their forward reaches dtorch's
pooling ops through __torch_function__ (rules: dtorch/ops/vision.py; batch and channels may be
sharded, height and width are moved to Replicate when sharded). DTorch's GlobalAvgPool2d and
GlobalMaxPool2d are a mean and an amax over height and width, so those may stay sharded too
(the reduction gives a Partial)."""
from __future__ import annotations

import torch

from .module import Module

__all__ = ["MaxPool2d", "AvgPool2d", "AdaptiveAvgPool2d", "AdaptiveMaxPool2d", "GlobalAvgPool2d", "GlobalMaxPool2d"]


class MaxPool2d(torch.nn.MaxPool2d, Module):
    pass


class AvgPool2d(torch.nn.AvgPool2d, Module):
    pass


class AdaptiveAvgPool2d(torch.nn.AdaptiveAvgPool2d, Module):
    """AdaptiveAvgPool2d(1) is global average pooling."""


class AdaptiveMaxPool2d(torch.nn.AdaptiveMaxPool2d, Module):
    pass


class _GlobalPool2d(Module):
    """DTorch's global pooling: one value per image and channel, the spatial dims kept as size 1
    (no flatten: follow with torch.flatten(x, 1), as DTorch's ResNet does). `is_nchw=True`: (N, C, H, W)
    -> (N, C, 1, 1) (a 3-D (C, H, W) input gives (C, 1, 1), as torch's adaptive pooling);
    `is_nchw=False`: channels last, (N, H, W, C) -> (N, 1, 1, C)."""

    def __init__(self, is_nchw: bool = True) -> None:
        super().__init__()
        self.is_nchw = is_nchw

    def forward(self, input):
        if input.ndim not in (3, 4):
            raise ValueError(f"{type(self).__name__}: expected a 3-D or 4-D input (an image or a batch of them), "
                             f"got shape {tuple(input.shape)}")
        return self._pool(input, (-2, -1) if self.is_nchw else (-3, -2))

    def extra_repr(self) -> str:
        return "" if self.is_nchw else "is_nchw=False"


class GlobalAvgPool2d(_GlobalPool2d):
    """DTorch's nn.GlobalAvgPool2d(is_nchw=True): the mean over height and width, the values of
    torch.nn.AdaptiveAvgPool2d((1, 1)) (within rounding, as DTorch's own test allows)."""

    @staticmethod
    def _pool(input, dims):
        return input.mean(dim=dims, keepdim=True)


class GlobalMaxPool2d(_GlobalPool2d):
    """DTorch's nn.GlobalMaxPool2d(is_nchw=True): the maximum over height and width, as
    torch.nn.AdaptiveMaxPool2d((1, 1))."""

    @staticmethod
    def _pool(input, dims):
        return input.amax(dim=dims, keepdim=True)

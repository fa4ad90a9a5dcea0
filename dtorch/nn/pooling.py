"""Pooling layers: torch's own classes, made dtorch Modules; their forward reaches dtorch's
pooling ops through __torch_function__ (rules: dtorch/ops/vision.py; batch and channels may be
sharded, height and width are moved to Replicate when sharded)."""
from __future__ import annotations

import torch

from .module import Module

__all__ = ["MaxPool2d", "AvgPool2d", "AdaptiveAvgPool2d", "AdaptiveMaxPool2d"]


class MaxPool2d(torch.nn.MaxPool2d, Module):
    pass


class AvgPool2d(torch.nn.AvgPool2d, Module):
    pass


class AdaptiveAvgPool2d(torch.nn.AdaptiveAvgPool2d, Module):
    """AdaptiveAvgPool2d(1) is global average pooling."""


class AdaptiveMaxPool2d(torch.nn.AdaptiveMaxPool2d, Module):
    pass

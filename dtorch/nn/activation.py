"""Layers without tensors: torch's own classes, made dtorch Modules. Their forward calls
torch.nn.functional on a DTensor, which reaches the dtorch op through __torch_function__;
Dropout is dtorch's own (its mask comes from dtorch's layout-invariant random stream)."""
from __future__ import annotations

import torch

from . import functional as F
from .module import Module

__all__ = ["Identity", "ReLU", "GELU", "SiLU", "Sigmoid", "Tanh", "LeakyReLU", "ELU", "Softplus", "Softmax",
           "LogSoftmax", "Flatten", "Unflatten", "Dropout"]


class Identity(torch.nn.Identity, Module):
    pass


class ReLU(torch.nn.ReLU, Module):
    pass


class GELU(torch.nn.GELU, Module):
    pass


class SiLU(torch.nn.SiLU, Module):
    pass


class Sigmoid(torch.nn.Sigmoid, Module):
    pass


class Tanh(torch.nn.Tanh, Module):
    pass


class LeakyReLU(torch.nn.LeakyReLU, Module):
    pass


class ELU(torch.nn.ELU, Module):
    pass


class Softplus(torch.nn.Softplus, Module):
    pass


class Softmax(torch.nn.Softmax, Module):
    pass


class LogSoftmax(torch.nn.LogSoftmax, Module):
    pass


class Flatten(torch.nn.Flatten, Module):
    pass


class Unflatten(torch.nn.Unflatten, Module):
    pass


class Dropout(torch.nn.Dropout, Module):
    """Active in training mode (torch's default); the same mask on every layout for a seed."""

    def forward(self, input):
        return F.dropout(input, self.p, self.training, self.inplace)

"""Sequential, ModuleList, ModuleDict: torch's containers, made dtorch Modules (so they refuse a
torch submodule that holds local weights, and run redistribute_input/output hooks)."""
from __future__ import annotations

import torch

from .module import Module

__all__ = ["Sequential", "ModuleList", "ModuleDict"]


class Sequential(torch.nn.Sequential, Module):
    pass


class ModuleList(torch.nn.ModuleList, Module):
    pass


class ModuleDict(torch.nn.ModuleDict, Module):
    pass

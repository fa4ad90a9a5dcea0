"""Embedding, dim-parallel (DTorch's default: weight S(1) on tp, output S(-1) on tp) or
vocab-parallel (weight S(0) on tp: each rank looks up the rows it holds, the output is P(sum)
on tp until something reduces it)."""
from __future__ import annotations

from typing import Literal

import torch

from ..spec.placements import DeviceMesh, Placement, Replicate, Shard
from ..dtensor.factories import arange, randn
from . import functional as F
from ._layout import move_mesh_dim, placements_with, require_mesh, tp_mesh_dim
from .module import Module
from .parameter import Parameter

__all__ = ["Embedding", "EmbeddingWithReplicateOutput"]

_WEIGHT = {"dim": Shard(1), "vocab": Shard(0)}


class Embedding(Module):
    """Initialized as torch.nn.Embedding: N(0, 1), the padding_idx row zero."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None, device=None,
                 dtype: torch.dtype | None = None, device_mesh: DeviceMesh | None = None,
                 tp_dim: int | str | None = "tp", *, tp_shard_type: Literal["dim", "vocab"] = "dim") -> None:
        super().__init__()
        if tp_shard_type not in _WEIGHT:
            raise ValueError(f"tp_shard_type must be 'dim' or 'vocab', got {tp_shard_type!r}")
        mesh = require_mesh(device_mesh, type(self).__name__)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        if padding_idx is not None and padding_idx < 0:
            padding_idx += num_embeddings
        self.padding_idx, self.tp_shard_type = padding_idx, tp_shard_type
        self.tp_dim = tp_mesh_dim(mesh, tp_dim)
        placements = placements_with(mesh, self.tp_dim, _WEIGHT[tp_shard_type])
        weight = randn(num_embeddings, embedding_dim, dtype=dtype, device_mesh=mesh, placements=placements)
        if padding_idx is not None:
            rows = arange(num_embeddings, device_mesh=mesh, placements=[Replicate()] * mesh.ndim)
            weight = weight * (rows != padding_idx).unsqueeze(1).to(weight.dtype)
        self.weight = Parameter(weight)

    def redistribute_input(self, input, input_placement: Placement | None = None):
        """Token ids are replicated over tp (every rank looks up every token)."""
        return (move_mesh_dim(input, self.tp_dim, input_placement or Replicate()),), {}

    def redistribute_output(self, output, output_placement: Placement | None = None):
        return move_mesh_dim(output, self.tp_dim, output_placement)

    def forward(self, input):
        return F.embedding(input, self.weight, self.padding_idx)

    def extra_repr(self) -> str:
        tp = f", tp={self.tp_shard_type} on mesh dim {self.tp_dim}" if self.tp_dim is not None else ""
        pad = f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""
        return f"{self.num_embeddings}, {self.embedding_dim}{pad}{tp}"


class EmbeddingWithReplicateOutput(Embedding):
    def redistribute_output(self, output, output_placement=None):
        return super().redistribute_output(output, Replicate())

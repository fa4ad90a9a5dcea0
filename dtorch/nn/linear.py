"""Linear and its tensor-parallel variants, with DTorch's constructor signatures.

Megatron's two shardings over the mesh dim named by `tp_dim` (default "tp"; a mesh without that
name, or with it of size 1, gives a replicated layer):
  column  weight S(0), bias S(0): input R on tp, output S(-1) on tp (each rank holds some features)
  row     weight S(1), bias R:    input S(-1) on tp, output P(sum) on tp (the bias is added once)
The *WithReplicate* variants all-reduce / all-gather their output (and input) to R on tp.
Other mesh dims (dp, ...) keep whatever placement the input has.
"""
from __future__ import annotations

from typing import Literal

import torch

from ..spec.placements import DeviceMesh, Placement, Replicate, Shard
from . import functional as F
from ._layout import fan_in_bound, move_mesh_dim, placements_with, require_mesh, tp_mesh_dim, uniform
from .module import Module
from .parameter import Parameter

__all__ = ["Linear", "ColumnParallelLinear", "RowParallelLinear", "ColumnParallelLinearWithReplicateOutput",
           "ColumnParallelLinearWithReplicateInputOutput", "RowParallelLinearWithReplicateOutput",
           "ReplicateParallelLinear"]

RowOrCol = Literal["row", "col"]
_WEIGHT = {"col": Shard(0), "row": Shard(1)}
_BIAS = {"col": Shard(0), "row": Replicate()}


class Linear(Module):
    """y = x W^T + b, initialized as torch.nn.Linear (U(-1/sqrt(in), 1/sqrt(in)))."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 dtype: torch.dtype | None = None, device_mesh: DeviceMesh | None = None, *,
                 tp_dim: int | str | None = "tp", tp_shard_type: RowOrCol | None = None) -> None:
        super().__init__()
        if tp_shard_type not in (None, "row", "col"):
            raise ValueError(f"tp_shard_type must be 'row', 'col' or None, got {tp_shard_type!r}")
        mesh = require_mesh(device_mesh, type(self).__name__)
        self.in_features, self.out_features = in_features, out_features
        self.tp_shard_type = tp_shard_type
        self.tp_dim = tp_mesh_dim(mesh, tp_dim) if tp_shard_type else None
        bound = fan_in_bound(in_features)
        kind = tp_shard_type or "col"
        self.weight = Parameter(uniform((out_features, in_features), bound, dtype=dtype, device_mesh=mesh,
                                        placements=placements_with(mesh, self.tp_dim, _WEIGHT[kind])))
        if bias:
            self.bias = Parameter(uniform((out_features,), bound, dtype=dtype, device_mesh=mesh,
                                          placements=placements_with(mesh, self.tp_dim, _BIAS[kind])))
        else:
            self.register_parameter("bias", None)

    def expected_input_placement(self, input) -> Placement | None:
        """What forward needs on the tp mesh dim: R for a column layer, S(last) for a row layer."""
        if self.tp_dim is None:
            return None
        return Shard(input.ndim - 1) if self.tp_shard_type == "row" else Replicate()

    def redistribute_input(self, input, input_placement: Placement | None = None):
        """Move the input to `input_placement` on tp, or to what forward needs there."""
        target = input_placement or self.expected_input_placement(input)
        return (move_mesh_dim(input, self.tp_dim, target),), {}

    def redistribute_output(self, output, output_placement: Placement | None = None):
        return move_mesh_dim(output, self.tp_dim, output_placement)

    def forward(self, input):
        return F.linear(input, self.weight, self.bias)

    def extra_repr(self) -> str:
        tp = f", tp={self.tp_shard_type} on mesh dim {self.tp_dim}" if self.tp_dim is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}{tp}"


class ColumnParallelLinear(Linear):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs, tp_shard_type="col")


class RowParallelLinear(Linear):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs, tp_shard_type="row")


class ColumnParallelLinearWithReplicateOutput(ColumnParallelLinear):
    def redistribute_output(self, output, output_placement=None):
        return super().redistribute_output(output, Replicate())


class ColumnParallelLinearWithReplicateInputOutput(ColumnParallelLinearWithReplicateOutput):
    def redistribute_input(self, input, input_placement=None):
        return super().redistribute_input(input, Replicate())


class RowParallelLinearWithReplicateOutput(RowParallelLinear):
    def redistribute_output(self, output, output_placement=None):
        return super().redistribute_output(output, Replicate())


class ReplicateParallelLinear(Linear):
    def __init__(self, *args, **kwargs) -> None:
        kwargs.pop("tp_dim", None)
        super().__init__(*args, **kwargs, tp_dim=None)

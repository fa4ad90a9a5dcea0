"""What layers share: the tensor-parallel mesh dim, placements with one mesh dim set, moving a
tensor's placement on one mesh dim, and torch's default initializations as dtorch factories
(layout-invariant: the same values whatever the placements)."""
from __future__ import annotations

import math

import torch

from ..spec.placements import DeviceMesh, Placement, Replicate
from ..errors import MeshError
from ..dtensor.factories import rand
from ..dtensor.tensor import DTensor

__all__ = ["tp_mesh_dim", "placements_with", "move_mesh_dim", "uniform", "fan_in_bound", "require_mesh"]


def require_mesh(device_mesh: DeviceMesh | None, layer: str) -> DeviceMesh:
    if device_mesh is None:
        raise MeshError(f"{layer}: pass device_mesh= (e.g. dtorch.init_device_mesh('cpu', (2,), "
                        "mesh_dim_names=['tp'])): a layer's parameters live on a mesh's workers")
    return device_mesh


def tp_mesh_dim(mesh: DeviceMesh, tp_dim: int | str | None) -> int | None:
    """The mesh dim the layer shards over, as DTorch reads `tp_dim`: a name the mesh lacks, a
    mesh dim of size 1, or None mean no tensor parallelism (the layer is replicated)."""
    if tp_dim is None:
        return None
    if isinstance(tp_dim, str):
        if not mesh.mesh_dim_names or tp_dim not in mesh.mesh_dim_names:
            return None
    index = mesh.dim_index(tp_dim)
    return index if mesh.shape[index] > 1 else None


def placements_with(mesh: DeviceMesh, mesh_dim: int | None, placement: Placement) -> list[Placement]:
    """All Replicate except `placement` on `mesh_dim` (none when mesh_dim is None)."""
    placements: list[Placement] = [Replicate()] * mesh.ndim
    if mesh_dim is not None:
        placements[mesh_dim] = placement
    return placements


def move_mesh_dim(tensor, mesh_dim: int | None, placement: Placement | None):
    """`tensor` with `placement` on `mesh_dim`, other mesh dims kept (non-DTensors pass as given)."""
    if mesh_dim is None or placement is None or not isinstance(tensor, DTensor):
        return tensor
    if tensor.placements[mesh_dim] == placement:
        return tensor
    placements = list(tensor.placements)
    placements[mesh_dim] = placement
    return tensor.redistribute(placements=placements)


def uniform(shape, bound: float, *, dtype, device_mesh: DeviceMesh, placements) -> DTensor:
    """U(-bound, bound): torch's default for Linear and Conv weights (kaiming_uniform with
    a=sqrt(5) reduces to bound = 1/sqrt(fan_in)) and their biases."""
    unit = rand(*shape, dtype=dtype or torch.get_default_dtype(), device_mesh=device_mesh, placements=placements)
    return unit * (2 * bound) - bound


def fan_in_bound(fan_in: int) -> float:
    return 1 / math.sqrt(fan_in) if fan_in > 0 else 0.0

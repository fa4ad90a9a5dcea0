"""PURE: the one rule for ops whose inputs live on different meshes. An input on a ONE-device mesh
(dtorch.Tensor(data) without a mesh lands on one) is a constant to the others: it joins the one
mesh they share, moved there as Replicate by the mesh-to-mesh Transfer. Anything else on
different meshes is refused (MeshError), and so is every case in strict mode
(dtorch.set_strict(True)), where each move is spelled out.
"""
from __future__ import annotations

from ..spec.placements import DeviceMesh

__all__ = ["join_target"]


def join_target(metas) -> DeviceMesh | None:
    """The mesh the one-device inputs join, or None when the rule does not apply: the inputs not on
    a one-device mesh must share exactly one mesh (all on one-device meshes: nothing to join)."""
    meshes = {meta.mesh for meta in metas}
    larger = {mesh for mesh in meshes if mesh.size() > 1}
    if len(meshes) < 2 or len(larger) != 1:
        return None
    return larger.pop()

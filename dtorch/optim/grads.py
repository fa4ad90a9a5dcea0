"""Commands on many gradients at once, one per mesh: the global norm (GradNorm: each rank's
share, then one all-reduce) and in-place updates (UpdateGrads: scale, clamp, zero). Used by
Optimizer.zero_grad and dtorch.nn.utils' clipping."""
from __future__ import annotations

import math

from ..spec.placements import Partial, Replicate
from ..ops.tensor_meta import tensor_meta
from ..runtime.controller import session
from ..runtime.protocol import GradNorm, UpdateGrads
from ..dtensor.tensor import DTensor

__all__ = ["total_norm", "update_grads", "by_mesh"]


def by_mesh(tensors) -> dict:
    """mesh -> its tensors, in first-seen order (a model's pipeline stages live on several)."""
    groups: dict = {}
    for tensor in tensors:
        groups.setdefault(tensor.device_mesh, []).append(tensor)
    return groups


def total_norm(grads: list, norm_type: float) -> DTensor:
    """The norm of all `grads` together, 0-d, Replicate on the first grad's mesh: per mesh one
    GradNorm (each rank's share) and its all-reduce; several meshes' shares meet on the first."""
    norm_type = float(norm_type)
    if not (norm_type > 0 or math.isinf(norm_type)):
        raise ValueError(f"dtorch.nn.utils.clip_grad_norm_: norm_type must be positive or +-inf, got {norm_type}")
    reduce_op = "sum" if math.isfinite(norm_type) else "max" if norm_type > 0 else "min"
    shares = [_share(members, norm_type, reduce_op) for members in by_mesh(grads).values()]
    first = shares[0].device_mesh
    combined = shares[0]
    for share in shares[1:]:
        moved = share.redistribute(first, [Replicate()] * first.ndim)
        combined = (combined + moved if reduce_op == "sum" else
                    combined.maximum(moved) if reduce_op == "max" else combined.minimum(moved))
    return combined ** (1.0 / norm_type) if reduce_op == "sum" else combined


def _share(grads: list, norm_type: float, reduce_op: str) -> DTensor:
    """One GradNorm on these grads' mesh, all-reduced to Replicate."""
    controller = session.controller()
    mesh = grads[0].device_mesh
    whole = [g.reduce_partials() for g in grads]   # a pending sum is reduced before its norm is taken
    out_id = controller.new_id()
    seq = controller.submit(GradNorm, out_id, controller.define_mesh(mesh), norm_type,
                            tuple([controller.reference(g).id for g in whole]),
                            tuple([tuple(g.placements) for g in whole]))
    meta = tensor_meta((), grads[0].dtype, mesh, [Partial(reduce_op)] * mesh.ndim)
    return DTensor(out_id, meta, seq, controller).redistribute(mesh, [Replicate()] * mesh.ndim)


def update_grads(kind: str, grads: list, factor: DTensor | None = None, bound: float = 0.0) -> None:
    """One UpdateGrads per mesh: the grads changed in place on the workers (kind: zero_grad,
    clip_grad_value_, or clip_grad_norm_ scaling by `factor`, a 0-d Replicate DTensor)."""
    controller = session.controller()
    for mesh, members in by_mesh(grads).items():
        # held in a name until submitted: a dropped symbol's Free may precede the next command
        local_factor = None if factor is None else factor.redistribute(mesh, [Replicate()] * mesh.ndim)
        factor_id = -1 if local_factor is None else controller.reference(local_factor).id
        seq = controller.submit(UpdateGrads, controller.define_mesh(mesh), kind,
                                tuple([controller.reference(g).id for g in members]), factor_id, float(bound))
        for grad in members:
            grad._seq = seq   # a read after a failed update raises its RemoteError

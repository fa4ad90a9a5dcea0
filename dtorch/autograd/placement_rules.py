"""PURE: the placements a gradient has on the workers, as a function of its tensor's.

Each rank's autograd differentiates its local computation, so a gradient lives in the placements
that make every rank's local derivative a correct piece of the global one:

    tensor        gradient   why
    Shard(d)      Shard(d)   each rank's block of the gradient is the derivative w.r.t. its block
    Replicate     P(sum)     every rank's copy feeds its own local computations; the global
                             derivative is the sum of their contributions (a Replicate weight used
                             with a batch-sharded input: each rank holds its batch's part)
    P(sum)        Replicate  the value is the sum of the ranks' parts, so each part's derivative
                             is the whole gradient

Gradients of Replicate tensors are reduced inside the backward that makes them, as DDP does:
`reduction_buckets` packs the leaves into buckets that the workers all-reduce while the rest of
the backward runs. Under `dtorch.autograd.no_sync()` (gradient accumulation) and across pipeline
stages they accumulate unreduced instead, and are reduced when read in their tensor's own
placements (`param.grad`, an optimizer step).
"""
from __future__ import annotations

from ..spec.placements import Partial, Replicate, Shard, format_placements

__all__ = ["gradient_placements", "reduction_dims", "reduction_buckets", "BUCKET_BYTES"]

# Bucket sizes as DDP picks them: a small first bucket (the last layers' gradients, ready first, go
# out at once), then larger ones (fewer collectives). Bytes of the whole tensors.
FIRST_BUCKET_BYTES = 1 << 20
BUCKET_BYTES = 25 << 20

_SUM, _R = Partial("sum"), Replicate()


def gradient_placements(placements) -> tuple:
    """The workers' placements of the gradient of a tensor with `placements`."""
    return tuple([_dual(p, placements) for p in placements])


def _dual(placement, placements):
    if isinstance(placement, Shard):
        return placement
    if isinstance(placement, Replicate):
        return _SUM
    if placement.reduce_op == "sum":
        return _R
    raise NotImplementedError(f"gradients of a {format_placements(placements)} tensor: only P(sum) partials have "
                              f"gradients here (reduce P({placement.reduce_op}) with redistribute first)")


def reduction_dims(placements) -> tuple:
    """The mesh dims over which a tensor's gradient is a pending sum: where the tensor is Replicate."""
    return tuple([dim for dim, p in enumerate(placements) if isinstance(p, Replicate)])


def reduction_buckets(leaves, mesh_shape: tuple) -> list[tuple[tuple, list[int]]]:
    """[(dims, [leaf index, ...]), ...]: the leaves (each with .placements, .dtype, .numel()) whose
    gradients the backward all-reduces over `dims`, packed in launch order. Leaves of one bucket
    share their dims and dtype (one flat buffer, one group). Leaves are taken newest first
    (`leaves` in creation order, reversed): a model's last parameters get their gradients first.
    A bucket closes when it passes its byte budget; leaves with nothing to reduce (all Shard, or
    Replicate only over dims of size 1) are left out."""
    open_buckets: dict = {}
    closed = []
    for index in reversed(range(len(leaves))):
        leaf = leaves[index]
        dims = tuple([d for d in reduction_dims(leaf.placements) if mesh_shape[d] > 1])
        if not dims:
            continue
        key = (dims, leaf.dtype)
        bucket = open_buckets.setdefault(key, [dims, [], 0])
        bucket[1].append(index)
        bucket[2] += leaf.numel() * leaf.dtype.itemsize
        budget = FIRST_BUCKET_BYTES if not closed else BUCKET_BYTES
        if bucket[2] >= budget:
            closed.append((dims, bucket[1]))
            del open_buckets[key]
    closed += [(dims, members) for dims, members, _ in open_buckets.values()]
    return closed

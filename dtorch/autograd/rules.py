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

Gradients of Replicate tensors therefore accumulate unreduced; the reduction happens once, when
the gradient is read in its tensor's own placements (`param.grad`, an optimizer step): one
all-reduce per parameter per step, however many backward calls accumulated into it.
"""
from __future__ import annotations

from ..distributed_spec import Partial, Replicate, Shard, format_placements

__all__ = ["gradient_placements"]

_SUM, _R = Partial("sum"), Replicate()


def gradient_placements(placements) -> tuple:
    """The workers' placements of the gradient of a tensor with `placements`."""
    return tuple(_dual(p, placements) for p in placements)


def _dual(placement, placements):
    if isinstance(placement, Shard):
        return placement
    if isinstance(placement, Replicate):
        return _SUM
    if placement.reduce_op == "sum":
        return _R
    raise NotImplementedError(f"gradients of a {format_placements(placements)} tensor: only P(sum) partials have "
                              f"gradients here (reduce P({placement.reduce_op}) with redistribute first)")

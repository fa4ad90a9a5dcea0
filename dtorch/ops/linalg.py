"""PURE: batched matrix functions (det, inverse, cholesky, solve, eigh, qr, svd, matrix_exp, ...):
each takes whole matrices, the trailing two dims of its inputs (one for a solve's vector
right-hand side), and repeats over the leading batch dims, which every output starts with.

On one mesh dim:
  all R                          -> every output R
  S on a batch dim (inputs that  -> every output S on that batch dim; an input that has the dim
  have it; R ones are sliced)       only as a broadcast (size 1, or missing) stays R
  S on a matrix dim, or P        -> refused: a shard would hold part of each matrix, and none of
                                    these functions is linear in its matrix
solve(A, B) is linear in B, one column at a time: with A R, B's P(sum|avg) passes to X, and a
matrix B sharded on its columns (its last dim) gives X sharded there.
So a batch of matrices split over the ranks costs nothing, and a single matrix is gathered whole
(R) on every rank that computes it, as DTensor's replicate strategy does.
"""
from __future__ import annotations

import torch

from ..spec.placements import Placement, Shard
from .registry import OpRow, register_family
from .rules import Call, Decision, R, RuleRejected

__all__ = ["LINALG", "matrix_rule"]

_LEGAL = "R; S on a batch dim (a dim before the matrices' two)"


def _square(call: Call) -> tuple:
    """Each input is one matrix per batch entry."""
    return (2,) * len(call.inputs)


def _solve(call: Call) -> tuple:
    """torch.linalg.solve(A, B): B is a batch of vectors when it is 1-D or A's shape less its
    last dim (torch's rule), else of matrices."""
    a, b = call.inputs[0].shape, call.inputs[1].shape
    vector = len(b) == 1 or (len(b) == len(a) - 1 and tuple(b) == tuple(a[:-1]))
    return 2, 1 if vector else 2


def matrix_rule(trailing=_square):
    """The rule for ops that repeat over leading batch dims (module docstring)."""
    def rule(call: Call, placements) -> Decision:
        matrix_dims = trailing(call)
        batch = [len(spec.shape) - m for spec, m in zip(call.inputs, matrix_dims)]
        out_batch = max(batch)
        target = _sharded_batch_dim(call, placements, batch, out_batch)
        outputs = (R if target is None else Shard(target),) * len(call.outputs)
        if target is None:
            return Decision(tuple(placements), outputs)
        size = max(spec.shape[target - (out_batch - b)] for spec, b in zip(call.inputs, batch)
                   if target - (out_batch - b) >= 0)
        required: list[Placement] = []
        for index, (spec, p, b) in enumerate(zip(call.inputs, placements, batch)):
            dim = target - (out_batch - b)
            if dim >= 0 and spec.shape[dim] == size:
                required.append(Shard(dim))
            elif p.is_shard():
                raise RuleRejected(f"{call.op} with input {index} sharded on dim {dim}, which it broadcasts", _LEGAL)
            else:
                required.append(R)
        return Decision(tuple(required), outputs)
    return rule


def _sharded_batch_dim(call: Call, placements, batch: list, out_batch: int):
    """The output batch dim the Shard inputs agree on, or None when all are R."""
    targets = set()
    for index, (p, b) in enumerate(zip(placements, batch)):
        if p.is_partial():
            raise RuleRejected(f"{call.op} is not linear in its matrices: input {index} {p!r} is refused", _LEGAL)
        if p.is_shard():
            if p.dim >= b:
                raise RuleRejected(f"{call.op} with input {index} sharded on dim {p.dim}, one of its matrices' dims: "
                                   "a shard would hold part of each matrix", _LEGAL)
            targets.add(p.dim + out_batch - b)
    if len(targets) > 1:
        raise RuleRejected(f"{call.op} with inputs sharded on different batch dims", _LEGAL)
    return targets.pop() if targets else None


_SOLVE_LEGAL = _LEGAL + "; A R with B P(sum|avg), or with a matrix B sharded on its columns (last dim)"
_solve_batches = matrix_rule(_solve)


def _solve_rule(call: Call, placements) -> Decision:
    a, b = placements
    columns = len(call.inputs[1].shape) - 1
    if a.is_replicate() and b.is_partial() and b.reduce_op in ("sum", "avg"):
        return Decision((a, b), (b,))
    if a.is_replicate() and b == Shard(columns) and _solve(call)[1] == 2:
        return Decision((a, b), (Shard(len(call.out_shape) - 1),))
    try:
        return _solve_batches(call, placements)
    except RuleRejected as refused:
        raise RuleRejected(refused.reason, _SOLVE_LEGAL) from None


def _row(fn, trailing=_square, method: bool = True, doc: str = "") -> OpRow:
    return OpRow(fn, matrix_rule(trailing), method=method, doc=doc or _LEGAL)


LINALG = {
    "det": _row(torch.det), "logdet": _row(torch.logdet), "slogdet": _row(torch.slogdet),
    "inverse": _row(torch.inverse), "matrix_exp": _row(torch.matrix_exp), "matrix_power": _row(torch.matrix_power),
    "pinverse": _row(torch.pinverse),
    "linalg_det": _row(torch.linalg.det, method=False), "linalg_slogdet": _row(torch.linalg.slogdet, method=False),
    "linalg_inv": _row(torch.linalg.inv, method=False), "linalg_cholesky": _row(torch.linalg.cholesky, method=False),
    "linalg_solve": OpRow(torch.linalg.solve, _solve_rule, method=False, doc=_SOLVE_LEGAL),
    "linalg_eigh": _row(torch.linalg.eigh, method=False), "linalg_eigvalsh": _row(torch.linalg.eigvalsh, method=False),
    "linalg_qr": _row(torch.linalg.qr, method=False), "linalg_svd": _row(torch.linalg.svd, method=False),
    "linalg_svdvals": _row(torch.linalg.svdvals, method=False),
    "linalg_matrix_exp": _row(torch.linalg.matrix_exp, method=False),
    "linalg_matrix_power": _row(torch.linalg.matrix_power, method=False),
    "linalg_pinv": _row(torch.linalg.pinv, method=False),
}

register_family("linalg", LINALG)

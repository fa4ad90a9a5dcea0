"""PURE: sample calls of the matrix ops (products, their add- forms, contractions, cross); uneven
sizes leave remainders in the contracted dims too. Merged into samples.py's table."""
from __future__ import annotations

from collections.abc import Callable

from .sample_making import Make, Sample

__all__ = ["MATRIX"]


def _mm(m: Make):
    a, k, b = m.shape((8, 4, 4), (7, 5, 3))
    return [Sample((m.x(a, k), m.x(k, b)), {})]


def _bmm(m: Make):
    n, a, k, b = m.shape((4, 4, 8, 4), (3, 5, 2, 7))
    return [Sample((m.x(n, a, k), m.x(n, k, b)), {})]


def _matmul(m: Make):
    n, a, k, b = m.shape((4, 4, 8, 4), (3, 5, 2, 7))
    return [Sample((m.x(a, k), m.x(k, b)), {}), Sample((m.x(k), m.x(k, b)), {}),
            Sample((m.x(n, a, k), m.x(k, b)), {}), Sample((m.x(n, a, k), m.x(k)), {})]


def _linear(m: Make):
    n, a, k, b = m.shape((4, 4, 8, 4), (3, 5, 2, 7))
    return [Sample((m.x(a, k), m.x(b, k), m.x(b)), {}), Sample((m.x(n, a, k), m.x(b, k)), {})]


def _einsum(m: Make):
    n, a, k, b = m.shape((4, 4, 8, 4), (3, 5, 2, 7))
    return [Sample(("ij,jk->ik", m.x(a, k), m.x(k, b)), {}), Sample(("bij,bjk", m.x(n, a, k), m.x(n, k, b)), {}),
            Sample(("...j,j->...", m.x(n, a, k), m.x(k)), {}), Sample(("ii->i", m.x(a, a)), {}, True),
            Sample(("i,j->ij", m.x(a), m.x(b)), {}, True)]


def _outer(m: Make):
    a, b = m.shape((8, 4), (7, 5))
    return [Sample((m.x(a), m.x(b)), {}, True)]


def _baddbmm(m: Make):
    n, a, k, b = m.shape((4, 4, 8, 4), (3, 5, 2, 7))
    return [Sample((m.x(n, a, b), m.x(n, a, k), m.x(n, k, b)), {"beta": 0.5, "alpha": 2.0}),
            Sample((m.x(b), m.x(n, a, k), m.x(n, k, b)), {})]


def _addmm(m: Make):
    a, k, b = m.shape((8, 4, 4), (7, 5, 3))
    return [Sample((m.x(a, b), m.x(a, k), m.x(k, b)), {"beta": 0.5, "alpha": 2.0}),
            Sample((m.x(b), m.x(a, k), m.x(k, b)), {})]


def _addmv(m: Make):
    a, k = m.shape((8, 4), (7, 5))
    # a (1,) input: torch's addmv returned (1,) on a rank whose vec shard is empty (ops/matrix.py's _addmv)
    return [Sample((m.x(a), m.x(a, k), m.x(k)), {"beta": 0.5, "alpha": 2.0}), Sample((m.x(1), m.x(a, k), m.x(k)), {})]


def _addr(m: Make):
    a, b = m.shape((8, 4), (7, 5))
    return [Sample((m.x(a, b), m.x(a), m.x(b)), {"beta": 0.5, "alpha": 2.0}), Sample((m.x(b), m.x(a), m.x(b)), {})]


def _addbmm(m: Make):
    n, a, k, b = m.shape((4, 4, 8, 4), (3, 5, 2, 7))
    return [Sample((m.x(a, b), m.x(n, a, k), m.x(n, k, b)), {"beta": 0.5, "alpha": 2.0}),
            Sample((m.x(b), m.x(n, a, k), m.x(n, k, b)), {})]


def _mv(m: Make):
    a, k = m.shape((8, 4), (7, 5))
    return [Sample((m.x(a, k), m.x(k)), {})]


def _dot(m: Make):
    (k,) = m.shape((8,), (7,))
    return [Sample((m.x(k), m.x(k)), {})]


def _inner(m: Make):
    n, a, k = m.shape((4, 8, 4), (3, 5, 7))
    return [Sample((m.x(k), m.x(k)), {}), Sample((m.x(n, k), m.x(a, k)), {}), Sample((m.x(n, a, k), m.x(k)), {})]


def _tensordot(m: Make):
    n, a, k = m.shape((4, 8, 4), (3, 5, 7))
    return [Sample((m.x(n, a, k), m.x(a, k, n)), {"dims": 2}), Sample((m.x(n, k), m.x(k, a)), {"dims": 1}),
            Sample((m.x(n, a, k), m.x(k, n)), {"dims": ([2, 0], [0, 1])})]


def _trace(m: Make):
    (a,) = m.shape((8,), (7,))
    return [Sample((m.x(a, a),), {})]


def _cross(m: Make):
    n, a = m.shape((8, 4), (7, 5))
    return [Sample((m.x(n, 3), m.x(n, 3)), {"dim": 1}), Sample((m.x(3, n, a), m.x(3, 1, a)), {"dim": 0}),
            Sample((m.x(n, 3, a), m.x(n, 3, a)), {})]


def _linalg_cross(m: Make):
    n, a = m.shape((8, 4), (7, 5))
    return [Sample((m.x(n, a, 3), m.x(n, a, 3)), {}), Sample((m.x(3, n), m.x(3, n)), {"dim": 0})]


MATRIX: dict[str, Callable] = {
    "matmul": _matmul, "mm": _mm, "bmm": _bmm, "linear": _linear, "einsum": _einsum, "outer": _outer,
    "baddbmm": _baddbmm,
    "addmm": _addmm, "addmv": _addmv, "addr": _addr, "addbmm": _addbmm, "mv": _mv, "dot": _dot, "vdot": _dot,
    "inner": _inner, "tensordot": _tensordot, "trace": _trace, "cross": _cross, "linalg_cross": _linalg_cross,
}

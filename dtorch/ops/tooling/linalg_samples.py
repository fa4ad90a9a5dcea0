"""PURE: sample calls of the batched matrix functions (ops/linalg.py): a batch of matrices that
splits evenly over 4 ranks or not (then a rank holds none), and a single matrix. The matrices are
well conditioned, so that float32 results and gradients compare closely: general ones are a
random matrix plus 3I, symmetric positive definite ones X Xᵀ plus nI (distinct eigenvalues,
as eigh's gradient needs). Merged into samples.py's table."""
from __future__ import annotations

from collections.abc import Callable

import torch

from .sample_making import Make, Sample

__all__ = ["LINALG"]

N = 3


def _batch(m: Make) -> int:
    (b,) = m.shape((4,), (5,))
    return b


def _general(m: Make, *batch) -> torch.Tensor:
    return m.x(*batch, N, N) + 3 * torch.eye(N)


def _spd(m: Make, *batch) -> torch.Tensor:
    x = m.x(*batch, N, N)
    return x @ x.transpose(-1, -2) + N * torch.eye(N)


def _on(make):
    """One call on a batch of matrices and one on a single matrix."""
    def build(m: Make):
        return [Sample((make(m, _batch(m)),), {}), Sample((make(m),), {})]
    return build


def _small(m: Make, *batch) -> torch.Tensor:
    return m.x(*batch, N, N) * 0.3


def _power(m: Make):
    b = _batch(m)
    return [Sample((_general(m, b), 3), {}), Sample((_general(m), -2), {}), Sample((_general(m, b), 0), {})]


def _tall(m: Make, *batch) -> torch.Tensor:
    return m.x(*batch, N + 2, N)


def _solve(m: Make):
    b = _batch(m)
    return [Sample((_general(m, b), m.x(b, N, 2)), {}), Sample((_general(m, b), m.x(b, N)), {}),
            Sample((_general(m), m.x(b, N, 2)), {}), Sample((_general(m, 1, b), m.x(2, b, N, 1)), {})]


def _svd(m: Make):
    b = _batch(m)
    return [Sample((_tall(m, b),), {"full_matrices": False}), Sample((_tall(m).T,), {"full_matrices": False})]


def _qr(m: Make):
    b = _batch(m)
    return [Sample((_tall(m, b),), {}), Sample((_tall(m),), {"mode": "complete"})]


LINALG: dict[str, Callable] = {
    "det": _on(_general), "logdet": _on(_spd), "slogdet": _on(_general), "inverse": _on(_general),
    "matrix_exp": _on(_small), "matrix_power": _power, "pinverse": _on(_tall),
    "linalg_det": _on(_general), "linalg_slogdet": _on(_general), "linalg_inv": _on(_general),
    "linalg_cholesky": _on(_spd), "linalg_solve": _solve, "linalg_eigh": _on(_spd), "linalg_eigvalsh": _on(_spd),
    "linalg_qr": _qr, "linalg_svd": _svd, "linalg_svdvals": _on(_tall), "linalg_matrix_exp": _on(_small),
    "linalg_matrix_power": _power, "linalg_pinv": _on(_tall),
}

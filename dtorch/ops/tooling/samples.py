"""PURE: small sample calls per op, shared by the differential sweep (tests/test_ops_sweep.py),
the rule validator (dtorch.ops.tooling.validate) and the docs generator (dtorch.ops.tooling.docs).

A sample is one torch call on whole tensors (sample_making.py); the op's registered torch
function on the same arguments is the reference. Each op family's builders live in their own
module (pointwise_samples.py, reduction_samples.py, matrix_samples.py, nn_samples.py,
view_samples.py, indexing_samples.py, vision_samples.py, linalg_samples.py; what several share is in
sample_helpers.py) and are joined into one table here. `samples(op, uneven)` builds them:
`uneven=False` sizes every dim to divide by 4, `uneven=True` leaves remainders (and empty shards
on a 4-way split).
"""
from __future__ import annotations

from collections.abc import Callable

from .indexing_samples import INDEXING
from .linalg_samples import LINALG
from .matrix_samples import MATRIX
from .nn_samples import NN
from .pointwise_samples import POINTWISE
from .reduction_samples import REDUCTION
from .sample_making import Make, Sample
from .view_samples import VIEW
from .vision_samples import VISION

__all__ = ["Sample", "samples", "SAMPLED_FAMILIES", "covered_ops"]

SAMPLED_FAMILIES = ("pointwise", "reduction", "matrix", "nn", "view", "indexing", "vision", "linalg")

_BUILDERS: dict[str, Callable] = {**POINTWISE, **REDUCTION, **MATRIX, **NN, **VIEW, **INDEXING, **VISION, **LINALG}


def samples(op: str, uneven: bool = False, seed: int = 0) -> list[Sample]:
    """The sample calls of `op`, sized for an even or uneven split (KeyError: none yet)."""
    return _BUILDERS[op](Make(uneven, seed))


def covered_ops() -> frozenset:
    return frozenset(_BUILDERS)

"""PURE: sample calls of the reduction ops (whole and per dim, scans, softmax and its kin), on 2-D
inputs. Merged into samples.py's table."""
from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .sample_helpers import CUBE_SIZES, MATRIX_SIZES, both, call, matrix_shape, on, with_nans
from .sample_making import Make, Sample

__all__ = ["REDUCTION"]


def _reduce(*variants, kind="x", exact=False):
    """(args after the input, kwargs) variants over one 2-D input of `kind` x / ints / bools."""
    def build(m: Make):
        shape = matrix_shape(m)
        value = {"x": lambda: m.x(*shape), "ints": lambda: m.ints(*shape), "bools": lambda: m.bools(*shape),
                 "zeros": lambda: m.x(*shape, zeros=True), "sparse": lambda: m.bools(*shape, density=0.1),
                 "dense": lambda: m.bools(*shape, density=0.9), "zero row": lambda: _zero_row(m.x(*shape)),
                 "all": lambda: torch.ones(shape, dtype=torch.bool),
                 "none": lambda: torch.zeros(shape, dtype=torch.bool)}[kind]
        return [Sample((value(),) + tuple(args), dict(kwargs), exact) for args, kwargs in variants]
    return build


def _zero_row(value: torch.Tensor) -> torch.Tensor:
    value[0] = 0.0
    return value


_ALL_DIMS = [((), {}), ((0,), {}), ((1,), {"keepdim": True}), (((0, 1),), {})]
_ONE_DIM = [((0,), {}), ((1,), {"keepdim": True}), ((-1,), {})]


def _max_like(m: Make):
    shape = matrix_shape(m)
    return [Sample((m.x(*shape),), {}, True), Sample((m.x(*shape), 1), {}, True),
            Sample((m.x(*shape), 0, True), {}, True), Sample((m.x(*shape), m.x(*shape)), {}, True)]


REDUCTION: dict[str, Callable] = {
    "sum": both(_reduce(*_ALL_DIMS), _reduce(((1,), {}), ((), {}), kind="ints", exact=True),
                _reduce(((0,), {"dtype": torch.float64}),)),
    "mean": _reduce(*_ALL_DIMS),
    "amax": both(_reduce(*_ALL_DIMS, exact=True), _reduce(((0,), {}), kind="sparse", exact=True)),
    "amin": _reduce(*_ALL_DIMS, exact=True),
    "prod": _reduce(((), {}), ((1,), {}), ((0,), {"keepdim": True})),
    "var": _reduce(((), {}), ((1,), {}), ((0,), {"correction": 0}), ((1, True, True), {})),
    "std": _reduce(((1,), {"keepdim": True}), ((0,), {})),
    "logsumexp": _reduce(((1,), {}), ((0, True), {})),
    "argmax": _reduce(((), {}), ((1,), {}), ((0, True), {}), exact=True),
    "argmin": _reduce(((1,), {}), exact=True),
    "norm": _reduce(((), {}), ((1, 1), {}), ((math.inf, 0), {}), ((0, (0, 1)), {}), (("fro", 1), {}),
                    kind="zeros"),
    # Reducing every dim of random booleans almost always gives the same answer: whole
    # reductions get the one input that decides them (all True / all False) instead.
    "any": both(_reduce(*_ONE_DIM, kind="sparse", exact=True), _reduce(((1,), {}), kind="zero row", exact=True),
                _reduce(((), {}), (((0, 1),), {}), kind="none", exact=True)),
    "all": both(_reduce(*_ONE_DIM, kind="dense", exact=True),
                _reduce(((), {}), (((0, 1),), {}), kind="all", exact=True)),
    "max": _max_like, "min": _max_like,
    "cumsum": both(_reduce(((0,), {}), ((1,), {})), _reduce(((1,), {}), kind="ints", exact=True)),
    "cumprod": both(_reduce(((0,), {}), ((1,), {})), _reduce(((1,), {}), kind="ints", exact=True)),
    **{name: both(on(MATRIX_SIZES, lambda x: call(x, 0), lambda x: call(x, dim=1)),
                  on(CUBE_SIZES, lambda x: call(x, -1)))
       for name in ("cummax", "cummin")},
    "logcumsumexp": _reduce(((0,), {}), ((-1,), {})),
    "softmax": _reduce(((1,), {}), ((0,), {}), ((-1,), {"dtype": torch.float64})),
    "log_softmax": _reduce(((-1,), {}), ((0,), {})),
    "softmin": _reduce(((1,), {}), ((0,), {}), ((-1,), {"dtype": torch.float64})),
    "glu": lambda m: [Sample((m.x(*m.shape((8, 4), (6, 10))),) + args, {}) for args in ((), (0,), (-1,))],
    "nansum": with_nans(*MATRIX_SIZES, calls=(lambda x: call(x), lambda x: call(x, 0), lambda x: call(x, 1, True),
                                              lambda x: call(x, (0, 1)))),
    "nanmean": with_nans(*MATRIX_SIZES, calls=(lambda x: call(x), lambda x: call(x, 0),
                                               lambda x: call(x, -1, True))),
}

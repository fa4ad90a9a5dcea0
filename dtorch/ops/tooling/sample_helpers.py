"""PURE: what more than one family's sample table builds with: the 2-D input's shape, one input
of distinct values sized (even, uneven) and the calls made on it, and builders joined into one."""
from __future__ import annotations

import math

from .sample_making import Make, Sample

__all__ = ["matrix_shape", "MATRIX_SIZES", "CUBE_SIZES", "SIZE_ONE_SIZES", "VECTOR_SIZES", "call", "on", "with_nans",
           "both"]


def matrix_shape(m: Make):
    return m.shape((8, 4), (7, 5))


# (even, uneven) sizes of the one distinct-valued input of on() and with_nans()
MATRIX_SIZES, CUBE_SIZES = ((8, 4), (6, 5)), ((2, 4, 3), (3, 2, 5))
SIZE_ONE_SIZES, VECTOR_SIZES = ((4, 1, 4), (3, 1, 5)), ((24,), (9,))


def call(*args, **kwargs):
    return args, kwargs


def on(sizes, *calls):
    """Each call(x) -> (args, kwargs) on one input of distinct values of the even or uneven shape."""
    def build(m: Make):
        x = m.distinct(*m.shape(*sizes))
        return [Sample(args, kwargs, True) for args, kwargs in (call(x) for call in calls)]
    return build


def with_nans(*sizes, calls=()):
    """nansum, nanmean, nanmedian: distinct values with a nan in some rows (never a whole row), so
    that skipping them matters."""
    def build(m: Make):
        x = m.distinct(*m.shape(*sizes))
        x.view(-1)[::7] = math.nan
        return [Sample(*call(x)) for call in calls]
    return build


def both(*builders):
    return lambda m: [sample for build in builders for sample in build(m)]


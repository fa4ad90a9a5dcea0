"""PURE: sample calls of the view and shape ops, each on inputs of distinct values (exact through
any rearrangement). Merged into samples.py's table."""
from __future__ import annotations

from collections.abc import Callable

from .sample_helpers import CUBE_SIZES, MATRIX_SIZES, SIZE_ONE_SIZES, VECTOR_SIZES, both, call, on
from .sample_making import Make, Sample

__all__ = ["VIEW"]


def _pair(*calls):
    """cat / stack: calls(x, y) -> (args, kwargs) on two distinct-valued matrices."""
    def build(m: Make):
        x, y = m.distinct(*m.shape(*MATRIX_SIZES)), m.distinct(*m.shape(*MATRIX_SIZES))
        return [Sample(args, kwargs, True) for args, kwargs in (call(x, y) for call in calls)]
    return build


VIEW: dict[str, Callable] = {
    "view": both(on(MATRIX_SIZES, lambda x: call(x, (x.shape[1], x.shape[0])),
                    lambda x: call(x, (2, -1, x.shape[1]))),
                 on(CUBE_SIZES, lambda x: call(x, (-1, x.shape[2]))),
                 on(SIZE_ONE_SIZES, lambda x: call(x, (x.shape[0], x.shape[2]))),
                 on(VECTOR_SIZES, lambda x: call(x, (-1, 3)), lambda x: call(x, (3, -1)))),
    "reshape": both(on(MATRIX_SIZES, lambda x: call(x, (-1,)), lambda x: call(x, (x.shape[0], x.shape[1], 1)),
                       lambda x: call(x, (1, -1))),
                    on(CUBE_SIZES, lambda x: call(x, (x.shape[0], -1)))),
    "flatten": both(on(MATRIX_SIZES, lambda x: call(x)), on(CUBE_SIZES, lambda x: call(x, 1))),
    "unflatten": both(on(MATRIX_SIZES, lambda x: call(x, 0, (2, -1))), on(CUBE_SIZES, lambda x: call(x, 2, (1, -1))),
                      on(VECTOR_SIZES, lambda x: call(x, 0, (-1, 3)))),
    "squeeze": both(on(MATRIX_SIZES, lambda x: call(x)), on(SIZE_ONE_SIZES, lambda x: call(x), lambda x: call(x, 1))),
    "unsqueeze": both(on(MATRIX_SIZES, lambda x: call(x, 1)), on(VECTOR_SIZES, lambda x: call(x, 0))),
    "transpose": both(on(MATRIX_SIZES, lambda x: call(x, 0, 1), lambda x: call(x, -2, -1)),      # x.mT
                      on(CUBE_SIZES, lambda x: call(x, 0, 2), lambda x: call(x, -2, -1))),
    "permute": both(on(MATRIX_SIZES, lambda x: call(x, (1, 0))), on(CUBE_SIZES, lambda x: call(x, (2, 0, 1)))),
    "expand": both(on(MATRIX_SIZES, lambda x: call(x, 3, *x.shape)), on(SIZE_ONE_SIZES, lambda x: call(x, -1, 3, -1)),
                   on(VECTOR_SIZES, lambda x: call(x, 2, -1))),
    "repeat": both(on(MATRIX_SIZES, lambda x: call(x, 1, 2), lambda x: call(x, 2, 1, 1)),
                   on(SIZE_ONE_SIZES, lambda x: call(x, 1, 2, 1))),
    "repeat_interleave": both(on(MATRIX_SIZES, lambda x: call(x, 2, dim=1), lambda x: call(x, 3, 0),
                                 lambda x: call(x, 2), lambda x: call(x, repeats=2, dim=-1)),
                              on(VECTOR_SIZES, lambda x: call(x, 2))),
    "contiguous": on(MATRIX_SIZES, lambda x: call(x)),
    "clone": on(MATRIX_SIZES, lambda x: call(x)),
    "detach": on(MATRIX_SIZES, lambda x: call(x)),
    "cat": both(_pair(lambda x, y: call([x, y]), lambda x, y: call([x, y], 1), lambda x, y: call([x, x]),
                      lambda x, y: call([x, x], dim=1)),
                on(CUBE_SIZES, lambda x: call([x, x], 2))),
    "stack": both(_pair(lambda x, y: call([x, x]), lambda x, y: call((x, x), -1), lambda x, y: call([x, y], 1)),
                  on(VECTOR_SIZES, lambda x: call([x, x], 1))),
    "split": on(MATRIX_SIZES, lambda x: call(x, 3), lambda x: call(x, [1, x.shape[1] - 1], 1),
                lambda x: call(x, 2, dim=1)),
    "chunk": on(MATRIX_SIZES, lambda x: call(x, 2, 1)),
    "unbind": on(MATRIX_SIZES, lambda x: call(x, 0), lambda x: call(x, 1)),
    "diagonal": both(on(MATRIX_SIZES, lambda x: call(x), lambda x: call(x, 1)),
                     on(CUBE_SIZES, lambda x: call(x, 0, 1, 2), lambda x: call(x, -1, 0, 2),
                        lambda x: call(x, offset=1, dim1=2, dim2=0))),
    "diagonal_scatter": both(on(MATRIX_SIZES, lambda x: call(x, x.diagonal() * -3),
                                lambda x: call(x, x.diagonal(1) * -3, 1)),
                             on(CUBE_SIZES, lambda x: call(x, x.diagonal(0, 1, 2) * -3, 0, 1, 2),
                                lambda x: call(x, x.diagonal(1, 2, 0) * -3, offset=1, dim1=2, dim2=0))),
    "diag_embed": both(on(MATRIX_SIZES, lambda x: call(x), lambda x: call(x, 1, 0, 2)),
                       on(CUBE_SIZES, lambda x: call(x, dim1=0, dim2=-1))),
    "diag": both(on(VECTOR_SIZES, lambda x: call(x), lambda x: call(x, 1)),
                 on(MATRIX_SIZES, lambda x: call(x), lambda x: call(x, -1))),
    "unfold": both(on(MATRIX_SIZES, lambda x: call(x, 0, 2, 1), lambda x: call(x, 1, 2, 2)),
                   on(CUBE_SIZES, lambda x: call(x, -1, 2, 1))),
}

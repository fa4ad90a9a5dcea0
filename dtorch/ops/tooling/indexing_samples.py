"""PURE: sample calls of the indexing ops: getitem / setitem, gather / scatter and the index_*
writes, advanced indexing with index tensors, and sort / topk / median; on inputs of distinct
values. Merged into samples.py's table."""
from __future__ import annotations

from collections.abc import Callable

import torch

from ..indexing import canonical_index
from .sample_helpers import (CUBE_SIZES, MATRIX_SIZES, SIZE_ONE_SIZES, VECTOR_SIZES, both, call, matrix_shape, on,
                             with_nans)
from .sample_making import Make, Sample

__all__ = ["INDEXING"]


def _index(*indices, sizes=MATRIX_SIZES):
    """x[index] for each index, in the canonical form DTensor.__getitem__ sends."""
    return on(sizes, *[lambda x, i=index: call(x, canonical_index(i, tuple(x.shape))) for index in indices])


def _with_positions(*calls):
    """index_select / gather / scatter on (x, positions): calls(x, positions) -> (args, kwargs)."""
    def build(m: Make):
        shape = m.shape((4, 4), (6, 5))
        x, positions = m.distinct(*shape), m.permutations(*shape)
        return [Sample(args, kwargs, True) for args, kwargs in (call(x, positions) for call in calls)]
    return build


def _index_select(m: Make):
    x, index = m.distinct(*m.shape(*MATRIX_SIZES)), torch.tensor([3, 0, 2, 2, 1])
    return [Sample((x, dim, index), {}, True) for dim in (0, 1, -1)]


def _index_writes(*calls):
    """index_add / index_copy / index_fill: calls(x, dim, index, values shaped for them) on distinct
    values, along each dim, never every row (overwriting all would hide a wrong R / Partial mix)."""
    def build(m: Make):
        x = m.distinct(*m.shape(*MATRIX_SIZES))
        out = []
        for dim, index in ((0, torch.tensor([3, 0, 2])), (1, torch.tensor([2, 0]))):
            values = m.x(*[len(index) if d == dim else size for d, size in enumerate(x.shape)])
            out += [Sample(*call(x, dim, index, values)) for call in calls]
        return out
    return build


_SCATTER_REDUCTIONS = (("sum", True), ("prod", True), ("mean", False), ("mean", True), ("amax", True),
                       ("amin", False))


def _scatter_reduce(m: Make):
    """Positions repeated within a row (i % 2), so that each reduction combines several values."""
    shape = m.shape((4, 4), (6, 5))
    x, positions = m.distinct(*shape), m.permutations(*shape)[:, :3] % 2
    values = lambda *size: m.x(*size) * 6 + 8   # noqa: E731  (among x's: neither always wins a max)
    return [Sample((x, 1, positions, values(shape[0], 3)), {"reduce": reduce, "include_self": include_self})
            for reduce, include_self in _SCATTER_REDUCTIONS] + \
        [Sample((x.T.contiguous(), 0, positions.T.contiguous(), values(3, shape[0])), {"reduce": "amax"})]


# --- advanced indexing: canonical indices with index tensors (dtorch/ops/advanced_indexing.py) -------
_W = (None, None, None)   # indexing.WHOLE: `:`


def _tensor_index(m: Make):
    """x[t] forms on distinct values: one dim, the second dim, two broadcast together, a 0-d select,
    and tensors separated by a slice on a cube (their broadcast dims go to the front)."""
    x, cube = m.distinct(*m.shape(*MATRIX_SIZES)), m.distinct(*m.shape(*CUBE_SIZES))
    rows, pair = torch.tensor([3, 0, -1, 2, 2]), torch.tensor([[0, 1, 3], [2, 2, 0]])
    return [Sample((x, (rows,)), {}, True), Sample((x, (_W, torch.tensor([1, -1, 0, 1]))), {}, True),
            Sample((x, (pair, torch.tensor([1, 0, 2]))), {}, True), Sample((x, (_W, torch.tensor(1))), {}, True),
            Sample((cube, (torch.tensor([1, 0]), _W, torch.tensor([2, 0]))), {}, True)]


def _index_put(m: Make):
    """x[t] = v with distinct positions (torch leaves the winner of repeated ones unspecified), a
    broadcast value and a scalar; accumulate=True with repeated positions."""
    x = m.distinct(*m.shape(*MATRIX_SIZES))
    rows, columns = torch.tensor([3, 0, -1]), torch.tensor([2, 0])
    return [Sample((x, (rows,), m.x(3, x.shape[1])), {}, True),
            Sample((x, (_W, columns), m.x(columns.shape[0])), {}, True),
            Sample((x, (rows, columns[:1]), 5.5), {}, True),   # between x's values: no P(min) by chance
            Sample((x, (torch.tensor([1, 0, 1]),), m.x(3, x.shape[1])), {"accumulate": True})]


def _masked_scatter(m: Make):
    shape = matrix_shape(m)
    return [Sample((m.x(*shape), m.bools(*shape), m.x(shape[0] * shape[1])), {}, True),
            Sample((m.x(*shape), m.bools(shape[1]), m.x(shape[0] * shape[1] + 3)), {}, True)]


def _repeated(*calls):
    """mode: a few small values repeated along each row, so that the most frequent one is not
    every value alike."""
    def build(m: Make):
        x = m.ints(*m.shape(*MATRIX_SIZES), low=0, high=3).to(torch.float32)
        return [Sample(args, kwargs, True) for args, kwargs in (call(x) for call in calls)]
    return build


_ALL = slice(None)


INDEXING: dict[str, Callable] = {
    "getitem": both(_index(1, (_ALL, 1), slice(1, 3), (_ALL, slice(None, None, 2)), (None, ..., None), (..., -1),
                           (_ALL, _ALL), (slice(None, None, 2), None), (-1, slice(1, None))),
                    _index((_ALL, 1), (..., slice(1, None)), sizes=CUBE_SIZES), _index((_ALL, 0), sizes=SIZE_ONE_SIZES),
                    _index((None, slice(2, None)), sizes=VECTOR_SIZES)),
    "setitem": on(MATRIX_SIZES, *[lambda x, i=index, v=value: call(x, canonical_index(i, tuple(x.shape)),
                                                                   v(x[i]) if callable(v) else v)
                                  for index, value in (((_ALL, 1), -2.0), (1, lambda r: r * -1), (slice(1, 3), 5.0),
                                                       ((_ALL, slice(None, None, 2)), lambda r: r[..., :1] + 100),
                                                       ((slice(None), slice(1, None)), lambda r: -r))]),
    # never the whole tensor: overwriting every element would make any placement look right
    "narrow": on(MATRIX_SIZES, lambda x: call(x, 0, 1, 2), lambda x: call(x, 1, 1, 2)),
    "index_select": _index_select,
    "gather": _with_positions(lambda x, i: call(x, 1, i), lambda x, i: call(x, 0, i),
                              lambda x, i: call(x, 1, i[:, :2].contiguous())),
    # three positions per row, not all: an index that overwrites every element would make
    # R-input / Partial-src combinations the rule rightly refuses look correct to the validator
    "scatter": _with_positions(lambda x, i: call(x, 1, i[:, :3], x[:, :3] * -3),
                               lambda x, i: call(x.T.contiguous(), 0, i[:, :3].T.contiguous(), x[:, :3].T * -3),
                               lambda x, i: call(x, 1, i[:, :3], -1.0),
                               lambda x, i: call(x, 1, i[:, :3], i[:, :3].to(torch.float32))),
    # positions repeat (an addition may add two values at one place): a P(max) source must not pass
    "index_add": _index_writes(lambda x, d, i, v: call(x, d, i.index_fill(0, torch.tensor([0]), i[-1]), v),
                               lambda x, d, i, v: call(x, d, torch.tensor([1, 1, 0])[:len(i)], v, alpha=2.0)),
    "index_copy": _index_writes(lambda x, d, i, v: call(x, d, i, v)),
    # values between x's: no P(min) by chance
    "index_fill": _index_writes(lambda x, d, i, v: call(x, d, i, 5.5), lambda x, d, i, v: call(x, d, i, v[0, 0] + 7)),
    # positions repeat within a row (i % 2) and values of both signs are added: see index_add
    "scatter_add": _with_positions(lambda x, i: call(x, 1, i[:, :3] % 2, x[:, :3] - 5),
                                   lambda x, i: call(x.T.contiguous(), 0, (i[:, :3] % 2).T.contiguous(),
                                                     x[:, :3].T - 5)),
    "scatter_reduce": _scatter_reduce,
    "select_scatter": both(on(MATRIX_SIZES, lambda x: call(x, x[:, 1] * -3, 1, 1), lambda x: call(x, x[2] * -3, 0, 2)),
                           on(CUBE_SIZES, lambda x: call(x, x[:, :, -1] * -3, -1, -1))),
    "slice_scatter": both(on(MATRIX_SIZES, lambda x: call(x, x[1:3] * -3, 0, 1, 3),
                             lambda x: call(x, x[:, 0:4:3] * -3, dim=1, end=4, step=3)),
                          on(CUBE_SIZES, lambda x: call(x, x[:, 1:] * -3, 1, 1))),
    "topk": on(MATRIX_SIZES, lambda x: call(x, 2, dim=1), lambda x: call(x, 1, 0, largest=False)),
    "sort": both(on(MATRIX_SIZES, lambda x: call(x, 0), lambda x: call(x, descending=True)),
                 on(CUBE_SIZES, lambda x: call(x, 1))),
    "kthvalue": both(on(MATRIX_SIZES, lambda x: call(x, 2), lambda x: call(x, 1, 0, True),
                        lambda x: call(x, 3, dim=-1)),
                     on(CUBE_SIZES, lambda x: call(x, 2, 1))),
    # median without a dim (the last calls) takes R only: every element is compared
    "median": both(on(MATRIX_SIZES, lambda x: call(x, 0), lambda x: call(x, 1, True), lambda x: call(x)),
                   on(CUBE_SIZES, lambda x: call(x, dim=-1))),
    "nanmedian": with_nans(*MATRIX_SIZES, calls=(lambda x: call(x, 1), lambda x: call(x, 0, keepdim=True),
                                                 lambda x: call(x))),
    "mode": _repeated(lambda x: call(x), lambda x: call(x, 0, True)),
    "index": _tensor_index, "index_put": _index_put, "masked_scatter": _masked_scatter,
}

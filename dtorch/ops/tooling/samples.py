"""PURE: small sample calls per op, shared by the differential sweep (tests/test_ops_sweep.py),
the rule validator (dtorch.ops.tooling.validate) and the docs generator (dtorch.ops.tooling.docs).

A sample is one torch call on whole tensors (sample_making.py); the op's registered torch
function on the same arguments is the reference. The vision ops' samples live in
vision_samples.py and join this table. `samples(op, uneven)` builds them: `uneven=False` sizes every dim
to divide by 4, `uneven=True` leaves remainders (and empty shards on a 4-way split).
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from ..indexing import canonical_index
from .sample_making import Make, Sample
from .vision_samples import VISION

__all__ = ["Sample", "samples", "SAMPLED_FAMILIES", "covered_ops"]

SAMPLED_FAMILIES = ("pointwise", "reduction", "matrix", "nn", "view", "indexing", "vision")


def _matrix(m: Make):
    return m.shape((8, 4), (7, 5))


def _one(*kwargs_variants, positive=False, exact=False, extra=()):
    """A unary op on a 2-D float input, once per kwargs variant."""
    def build(m: Make):
        x = m.x(*_matrix(m), positive=positive)
        return [Sample((x,) + tuple(extra), dict(kw), exact) for kw in (kwargs_variants or ({},))]
    return build


def _two(broadcast=False, positive=False, exact=False, kwargs=(), dtype=torch.float32, high=16):
    """A binary op on two same-shape inputs (and a row broadcast against a matrix)."""
    def build(m: Make):
        shape = _matrix(m)
        make = (lambda s: m.bools(*s)) if dtype == torch.bool else \
               (lambda s: m.ints(*s, low=0, high=high)) if dtype == torch.int64 else \
               (lambda s: m.x(*s, positive=positive))
        out = [Sample((make(shape), make(shape)), dict(kw), exact) for kw in (kwargs or ({},))]
        if broadcast:
            out.append(Sample((make(shape), make(shape[-1:])), {}, exact))
        return out
    return build


def _with_scalar(scalar, positive=False, nonzero=False, exact=True):
    return lambda m: [Sample((m.x(*_matrix(m), positive=positive, nonzero=nonzero), scalar), {}, exact)]


def _divide(m: Make):
    shape = _matrix(m)
    return [Sample((m.x(*shape), m.x(*shape, nonzero=True)), kw, True) for kw in ({}, {"rounding_mode": "floor"})]


def _power(m: Make):
    shape = _matrix(m)
    return [Sample((m.x(*shape, positive=True), m.x(*shape)), {})]


def _where(m: Make):
    shape = _matrix(m)
    return [Sample((m.bools(*shape), m.x(*shape), m.x(*shape)), {}, True),
            Sample((m.bools(*shape), m.x(*shape), 0.0), {}, True),
            Sample((m.bools(*shape), 1.0, m.x(*shape)), {}, True)]


def _masked_fill(m: Make):
    shape = _matrix(m)
    return [Sample((m.x(*shape), m.bools(*shape), 0.5), {}, True),
            Sample((m.x(*shape), m.bools(shape[-1]), -1.0), {}, True)]


def _clamp(m: Make):
    shape = _matrix(m)
    return [Sample((m.x(*shape), -0.5, 0.5), {}, True), Sample((m.x(*shape),), {"min": m.x(shape[-1])}, True)]


def _casts(m: Make):
    x, n = m.x(*_matrix(m), zeros=True), m.ints(*_matrix(m))
    return [Sample((x, dtype), {}, True) for dtype in (torch.float16, torch.bfloat16, torch.int64, torch.bool)] + \
           [Sample((n, torch.float32), {}, True)]


def _logical_not(m: Make):
    return [Sample((m.bools(*_matrix(m)),), {}, True), Sample((m.x(*_matrix(m), zeros=True),), {}, True)]


def _bitwise_not(m: Make):
    return [Sample((m.ints(*_matrix(m)),), {}, True), Sample((m.bools(*_matrix(m)),), {}, True)]


def _special_values(m: Make):
    x = m.x(*_matrix(m))
    x[0, 0], x[-1, -1], x[1, 0] = math.nan, math.inf, -math.inf
    return [Sample((x,), {}, True)]


def _unary(transform, exact=False, kwargs=({},)):
    """A unary op on transform(a random 2-D float input): into the op's domain."""
    def build(m: Make):
        x = transform(m.x(*_matrix(m)))
        return [Sample((x,), dict(kw), exact) for kw in kwargs]
    return build


def _divisions(exact=False):
    """fmod, remainder, floor_divide: by a nonzero tensor, by a broadcast row and by a scalar."""
    def build(m: Make):
        shape = _matrix(m)
        x = m.x(*shape) * 4
        return [Sample((x, m.x(*shape, nonzero=True)), {}, exact), Sample((x, m.x(shape[-1], nonzero=True)), {}, exact),
                Sample((x, 1.5), {}, exact)]
    return build


def _isclose(m: Make):
    x = m.x(*_matrix(m))
    y = torch.where(m.bools(*x.shape), x + 1e-3, x)
    return [Sample((x, y), {}, True), Sample((x, y), {"rtol": 1e-2}, True)]


def _lerp(m: Make):
    shape = _matrix(m)
    return [Sample((m.x(*shape), m.x(*shape), 0.3), {}), Sample((m.x(*shape), m.x(*shape), m.x(*shape)), {})]


def _addc(m: Make):
    """addcmul, addcdiv: input + value * tensor1 (* or /) tensor2 (nonzero)."""
    shape = _matrix(m)
    return [Sample((m.x(*shape), m.x(*shape), m.x(*shape, nonzero=True)), {}),
            Sample((m.x(*shape), m.x(*shape), m.x(shape[-1], nonzero=True)), {"value": 0.5})]


def _clamp_one_side(m: Make):
    shape = _matrix(m)
    return [Sample((m.x(*shape), 0.1), {}, True), Sample((m.x(*shape), m.x(shape[-1])), {}, True)]


def _nan_to_num(m: Make):
    x = _special_values(m)[0].args[0]
    return [Sample((x,), {}, True), Sample((x,), {"nan": 1.0, "posinf": 2.0}, True),
            Sample((x, 0.0, None, -3.0), {}, True)]


def _infinities(m: Make):
    """isposinf, isneginf: +-inf among finite values (no nan: a max carrying nan is nan)."""
    x = m.x(*_matrix(m))
    x[0, 0], x[-1, -1], x[1, 0], x[-1, 0] = math.inf, math.inf, -math.inf, -math.inf
    return [Sample((x,), {}, True)]


def _with_nan_values(m: Make):
    """fmax, fmin: nan in either operand (fmax(nan, b) is b, which no Partial law keeps)."""
    shape = _matrix(m)
    x, y, row = m.x(*shape), m.x(*shape), m.x(shape[-1])
    x.view(-1)[::5], y.view(-1)[2::5], row[1] = math.nan, math.nan, math.nan   # never both: nan out compares unequal
    return [Sample((x, y), {}, True), Sample((x.index_fill(1, torch.tensor([1]), 0.5), row), {}, True)]


def _nextafter(m: Make):
    """From 0, so that the one-ulp step is the whole result (from other values it is lost in
    any tolerance, and nextafter would look like the identity)."""
    shape = _matrix(m)
    return [Sample((torch.zeros(shape), m.x(*shape)), {}, True), Sample((torch.zeros(shape), m.x(shape[-1])), {}, True)]


def _polygamma(m: Make):
    return [Sample((n, m.x(*_matrix(m))), {}) for n in (1, 2)]


def _mvlgamma(m: Make):
    """mvlgamma(x, p) is defined for x > (p - 1) / 2."""
    return [Sample((m.x(*_matrix(m), positive=True) + 1.0, p), {}) for p in (1, 3)]


def _heaviside(m: Make):
    """Exact zeros in the input, where `values` is taken."""
    shape = _matrix(m)
    return [Sample((m.x(*shape, zeros=True), m.x(*shape)), {}, True),
            Sample((m.x(*shape, zeros=True), m.x(shape[-1])), {}, True)]


def _ldexp(m: Make):
    shape = _matrix(m)
    return [Sample((m.x(*shape), m.ints(*shape, low=-3, high=4)), {}, True),
            Sample((m.x(*shape), m.ints(shape[-1], low=-3, high=4)), {}, True)]


def _xlogy(m: Make):
    """Zeros in x where y < 0 (x log y is 0 there, a nonzero contribution's is nan). No zeros in
    y: d/dy = x / y would be inf, and a rank's zero share of the output gradient times inf is nan."""
    shape = _matrix(m)
    return [Sample((m.x(*shape, zeros=True), m.x(*shape, nonzero=True)), {}),
            Sample((m.x(*shape, zeros=True), 2.0), {})]


def _threshold(m: Make):
    """value above the threshold (a step down: no order law) and below it."""
    x = m.x(*_matrix(m))
    return [Sample((x, 0.1, 20.0), {}, True), Sample((x, 0.5, -1.0), {}, True)]


# --- reductions -------------------------------------------------------------------------------------
def _reduce(*variants, kind="x", exact=False):
    """(args after the input, kwargs) variants over one 2-D input of `kind` x / ints / bools."""
    def build(m: Make):
        shape = _matrix(m)
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
    shape = _matrix(m)
    return [Sample((m.x(*shape),), {}, True), Sample((m.x(*shape), 1), {}, True),
            Sample((m.x(*shape), 0, True), {}, True), Sample((m.x(*shape), m.x(*shape)), {}, True)]


# --- matrix -----------------------------------------------------------------------------------------
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


# --- nn.functional ----------------------------------------------------------------------------------
def _layer_norm(m: Make):
    n, a, d = m.shape((4, 4, 8), (3, 5, 6))
    return [Sample((m.x(n, a, d), [d], m.x(d), m.x(d)), {}), Sample((m.x(n, a, d), [a, d]), {"eps": 1e-3})]


def _rms_norm(m: Make):
    n, a, d = m.shape((4, 4, 8), (3, 5, 6))
    return [Sample((m.x(n, a, d), [d], m.x(d)), {}), Sample((m.x(n, a, d), [a, d]), {"eps": 1e-6})]


def _embedding(m: Make):
    vocab, width, n, a = m.shape((8, 4, 4, 4), (7, 5, 3, 5))
    return [Sample((m.ints(n, a, low=0, high=vocab), m.x(vocab, width)), {}, True),
            Sample((m.ints(n, low=0, high=vocab), m.x(vocab, width)), {"padding_idx": 0}, True)]


def _dropout(m: Make):
    x = m.x(*m.shape((8, 4, 4), (7, 5, 3)))
    return [Sample((x, 0.5, True, False, 1234, 7), {}, True), Sample((x, 0.25, False, False, 0, 0), {}, True)]


def _attention(m: Make):
    n, h, length, keys, e, f = m.shape((4, 4, 4, 4, 4, 4), (2, 3, 5, 6, 3, 2))
    q, k, v = m.x(n, h, length, e), m.x(n, h, keys, e), m.x(n, h, keys, f)
    return [Sample((q, k, v), {}), Sample((q, k, v), {"is_causal": True}),
            Sample((q, k, v, m.x(length, keys)), {})]


def _cross_entropy(m: Make):
    n, c, d = m.shape((8, 4, 4), (7, 5, 3))
    x, target = m.x(n, c), m.ints(n, low=0, high=c)
    ignored = target.clone()
    ignored[1] = -100
    probabilities = torch.softmax(m.x(n, c), 1)
    return [Sample((x, target), {"reduction": reduction}) for reduction in ("none", "sum", "mean")] + [
        Sample((x, ignored, m.x(c, positive=True)), {"reduction": "sum"}),
        Sample((x, probabilities), {"label_smoothing": 0.1}),
        Sample((m.x(n, c, d), m.ints(n, d, low=0, high=c)), {"reduction": "none"})]


def _nll_loss(m: Make):
    n, c, d = m.shape((8, 4, 4), (7, 5, 3))
    log_probabilities, target = torch.log_softmax(m.x(n, c), 1), m.ints(n, low=0, high=c)
    ignored = target.clone()
    ignored[1] = -100
    return [Sample((log_probabilities, target), {"reduction": reduction}) for reduction in ("none", "sum", "mean")] + [
        Sample((log_probabilities, ignored, m.x(c, positive=True)), {"reduction": "sum"}),
        Sample((torch.log_softmax(m.x(n, c, d), 1), m.ints(n, d, low=0, high=c)), {"reduction": "none"})]


def _pointwise_loss(*variants, probabilities=False, log_input=False, weight=None,
                    reductions=("none", "sum", "mean")):
    """A loss of two same-shape inputs, once per reduction and kwargs variant. probabilities:
    input and target in (0, 1); log_input: log-probabilities against probabilities (kl_div);
    weight "full" (shaped like the input, `weight=`) or "row" (its last dim, `pos_weight=`): one
    more call with it."""
    def build(m: Make):
        shape = _matrix(m)
        if log_input:
            x, target = torch.log_softmax(m.x(*shape), -1), torch.softmax(m.x(*shape), -1)
        elif probabilities:
            x, target = torch.sigmoid(m.x(*shape)), torch.rand(shape, generator=m.g)
        else:
            x, target = m.x(*shape), m.x(*shape)
        out = [Sample((x, target), dict(kw, reduction=r)) for r in reductions for kw in (variants or ({},))]
        if weight is not None:
            name = "pos_weight" if weight == "row" else "weight"
            made = m.x(*(shape if weight == "full" else shape[-1:]), positive=True)
            out.append(Sample((x, target), {"reduction": "sum", name: made}))
        return out
    return build


def _pad(m: Make):
    shape = _matrix(m)
    return [Sample((m.x(*shape), (1, 2)), {}, True),
            Sample((m.x(*shape), (0, 0, 1, 1), "constant", 0.5), {}, True),
            Sample((m.x(2, *shape), (1, 1)), {"mode": "reflect"}, True)]


# --- view and indexing: one distinct-valued input, sized (even, uneven) ------------------------------
_MATRIX, _CUBE, _SIZE_ONE, _VECTOR = ((8, 4), (6, 5)), ((2, 4, 3), (3, 2, 5)), ((4, 1, 4), (3, 1, 5)), ((24,), (9,))


def _call(*args, **kwargs):
    return args, kwargs


def _on(sizes, *calls):
    """Each call(x) -> (args, kwargs) on one input of distinct values of the even or uneven shape."""
    def build(m: Make):
        x = m.distinct(*m.shape(*sizes))
        return [Sample(*call(x), True) for call in calls]
    return build


def _index(*indices, sizes=_MATRIX):
    """x[index] for each index, in the canonical form DTensor.__getitem__ sends."""
    return _on(sizes, *(lambda x, i=index: _call(x, canonical_index(i, tuple(x.shape))) for index in indices))


def _with_positions(*calls):
    """index_select / gather / scatter on (x, positions): calls(x, positions) -> (args, kwargs)."""
    def build(m: Make):
        shape = m.shape((4, 4), (6, 5))
        x, positions = m.distinct(*shape), m.permutations(*shape)
        return [Sample(*call(x, positions), True) for call in calls]
    return build


def _index_select(m: Make):
    x, index = m.distinct(*m.shape(*_MATRIX)), torch.tensor([3, 0, 2, 2, 1])
    return [Sample((x, dim, index), {}, True) for dim in (0, 1, -1)]


def _index_writes(*calls):
    """index_add / index_copy / index_fill: calls(x, dim, index, values shaped for them) on distinct
    values, along each dim, never every row (overwriting all would hide a wrong R / Partial mix)."""
    def build(m: Make):
        x = m.distinct(*m.shape(*_MATRIX))
        out = []
        for dim, index in ((0, torch.tensor([3, 0, 2])), (1, torch.tensor([2, 0]))):
            values = m.x(*(len(index) if d == dim else size for d, size in enumerate(x.shape)))
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


def _pair(*calls):
    """cat / stack: calls(x, y) -> (args, kwargs) on two distinct-valued matrices."""
    def build(m: Make):
        x, y = m.distinct(*m.shape(*_MATRIX)), m.distinct(*m.shape(*_MATRIX))
        return [Sample(*call(x, y), True) for call in calls]
    return build


# --- advanced indexing: canonical indices with index tensors (dtorch/ops/advanced_indexing.py) -------
_W = (None, None, None)   # indexing.WHOLE: `:`


def _tensor_index(m: Make):
    """x[t] forms on distinct values: one dim, the second dim, two broadcast together, a 0-d select,
    and tensors separated by a slice on a cube (their broadcast dims go to the front)."""
    x, cube = m.distinct(*m.shape(*_MATRIX)), m.distinct(*m.shape(*_CUBE))
    rows, pair = torch.tensor([3, 0, -1, 2, 2]), torch.tensor([[0, 1, 3], [2, 2, 0]])
    return [Sample((x, (rows,)), {}, True), Sample((x, (_W, torch.tensor([1, -1, 0, 1]))), {}, True),
            Sample((x, (pair, torch.tensor([1, 0, 2]))), {}, True), Sample((x, (_W, torch.tensor(1))), {}, True),
            Sample((cube, (torch.tensor([1, 0]), _W, torch.tensor([2, 0]))), {}, True)]


def _index_put(m: Make):
    """x[t] = v with distinct positions (torch leaves the winner of repeated ones unspecified), a
    broadcast value and a scalar; accumulate=True with repeated positions."""
    x = m.distinct(*m.shape(*_MATRIX))
    rows, columns = torch.tensor([3, 0, -1]), torch.tensor([2, 0])
    return [Sample((x, (rows,), m.x(3, x.shape[1])), {}, True),
            Sample((x, (_W, columns), m.x(columns.shape[0])), {}, True),
            Sample((x, (rows, columns[:1]), 5.5), {}, True),   # between x's values: no P(min) by chance
            Sample((x, (torch.tensor([1, 0, 1]),), m.x(3, x.shape[1])), {"accumulate": True})]


def _masked_scatter(m: Make):
    shape = _matrix(m)
    return [Sample((m.x(*shape), m.bools(*shape), m.x(shape[0] * shape[1])), {}, True),
            Sample((m.x(*shape), m.bools(shape[1]), m.x(shape[0] * shape[1] + 3)), {}, True)]


def _with_nans(*sizes, calls=()):
    """nanmedian: distinct values with a nan in some rows (never a whole row), so that skipping
    them matters."""
    def build(m: Make):
        x = m.distinct(*m.shape(*sizes))
        x.view(-1)[::7] = math.nan
        return [Sample(*call(x)) for call in calls]
    return build


def _repeated(*calls):
    """mode: a few small values repeated along each row, so that the most frequent one is not
    every value alike."""
    def build(m: Make):
        x = m.ints(*m.shape(*_MATRIX), low=0, high=3).to(torch.float32)
        return [Sample(*call(x), True) for call in calls]
    return build


_ALL = slice(None)


def _both(*builders):
    return lambda m: [sample for build in builders for sample in build(m)]


_EXACT_UNARY = ("neg", "abs", "square", "relu")
_CLOSE_UNARY = ("exp", "sin", "cos", "tanh", "sigmoid", "erf", "silu", "softplus")
_POSITIVE = ("log", "log1p", "sqrt", "rsqrt")
_COMPARISONS = ("eq", "ne", "lt", "le", "gt", "ge", "minimum", "maximum")
_BOOLEAN = ("logical_and", "logical_or", "logical_xor")
_BITWISE = ("bitwise_and", "bitwise_or", "bitwise_xor")

_BUILDERS: dict[str, Callable] = {
    **{name: _one(exact=True) for name in _EXACT_UNARY},
    **{name: _one() for name in _CLOSE_UNARY},
    **{name: _one(positive=True, exact=name == "sqrt") for name in _POSITIVE},
    "erfinv": lambda m: [Sample((torch.tanh(m.x(*_matrix(m))) * 0.9,), {})],   # its domain is (-1, 1)
    **{name: _two(broadcast=name in ("maximum", "lt"), exact=True) for name in _COMPARISONS},
    "eq": _two(dtype=torch.int64, high=4, exact=True), "ne": _two(dtype=torch.int64, high=4, exact=True),
    **{name: _two(dtype=torch.bool, exact=True) for name in _BOOLEAN},
    **{name: _both(_two(dtype=torch.int64, exact=True), _two(dtype=torch.bool, exact=True)) for name in _BITWISE},
    "add": _both(_two(broadcast=True, exact=True, kwargs=({}, {"alpha": -1.5})), _with_scalar(1.5)),
    "sub": _both(_two(exact=True, kwargs=({}, {"alpha": 2.0})), _with_scalar(0.5)),
    "mul": _both(_two(broadcast=True, exact=True), _with_scalar(2.5)),
    "div": _both(_divide, _with_scalar(4.0)),
    "pow": _both(_power, _with_scalar(2.0, exact=False)),
    "gelu": _one({}, {"approximate": "tanh"}),
    "leaky_relu": _one(exact=True, extra=(0.2,)),
    "elu": _one(extra=(0.5,)),
    "clamp": _clamp, "where": _where, "masked_fill": _masked_fill, "to_dtype": _casts,
    "logical_not": _logical_not, "bitwise_not": _bitwise_not,
    "isnan": _special_values, "isinf": _special_values, "isfinite": _special_values,
    **{name: _one(exact=True) for name in ("floor", "ceil", "trunc", "frac", "sign", "sgn")},
    "round": _unary(lambda x: x * 3, exact=True, kwargs=({}, {"decimals": 1})),
    **{name: _one() for name in ("atan", "sinh", "cosh", "asinh", "exp2", "expm1")},
    **{name: _one(positive=True) for name in ("log2", "log10")},
    **{name: _unary(torch.tanh) for name in ("asin", "acos", "atanh")},
    "acosh": _unary(lambda x: x.abs() + 1),
    "reciprocal": _unary(lambda x: x.sign() * (x.abs() + 0.25)),
    "atan2": _two(broadcast=True), "hypot": _two(broadcast=True), "logaddexp": _two(broadcast=True),
    "fmod": _divisions(exact=True), "remainder": _divisions(), "floor_divide": _divisions(),
    "isclose": _isclose, "lerp": _lerp, "addcmul": _addc, "addcdiv": _addc,
    "clamp_min": _clamp_one_side, "clamp_max": _clamp_one_side, "nan_to_num": _nan_to_num,
    "rsub": _with_scalar(2.0), "rdiv": _with_scalar(2.0, nonzero=True), "rpow": _with_scalar(2.0, exact=False),
    "rfloor_divide": _with_scalar(7.0, nonzero=True), "rremainder": _with_scalar(7.0, nonzero=True),
    "tan": _unary(torch.tanh), "erfc": _one(), "lgamma": _one(), "digamma": _one(), "i0": _one(), "sinc": _one(),
    "signbit": _one(exact=True), "deg2rad": _one(), "rad2deg": _one(), "isreal": _one(exact=True),
    "logit": _unary(torch.sigmoid, kwargs=({}, {"eps": 0.1})),
    "isposinf": _infinities, "isneginf": _infinities, "polygamma": _polygamma, "mvlgamma": _mvlgamma,
    "copysign": _two(broadcast=True, exact=True), "float_power": _power, "nextafter": _nextafter,
    "fmax": _with_nan_values, "fmin": _with_nan_values, "logaddexp2": _two(broadcast=True),
    "gcd": _two(dtype=torch.int64, broadcast=True, exact=True), "lcm": _two(dtype=torch.int64, exact=True),
    "heaviside": _heaviside, "ldexp": _ldexp, "xlogy": _xlogy,
    # torch.nn.functional's activations
    "hardtanh": _one({}, {"min_val": -0.5, "max_val": 2.0}, exact=True),
    "relu6": _unary(lambda x: x * 4, exact=True), "hardsigmoid": _unary(lambda x: x * 4),
    "hardswish": _unary(lambda x: x * 4), "mish": _one(), "selu": _one(), "celu": _one({}, {"alpha": 0.5}),
    "logsigmoid": _one(), "softsign": _one(), "tanhshrink": _one(), "threshold": _threshold,
    "hardshrink": _one({}, {"lambd": 0.3}, exact=True), "softshrink": _one({}, {"lambd": 0.3}, exact=True),
    "rrelu": _one({}, {"lower": 0.1, "upper": 0.3}, exact=True),
    # reductions
    "sum": _both(_reduce(*_ALL_DIMS), _reduce(((1,), {}), ((), {}), kind="ints", exact=True),
                 _reduce(((0,), {"dtype": torch.float64}),)),
    "mean": _reduce(*_ALL_DIMS),
    "amax": _both(_reduce(*_ALL_DIMS, exact=True), _reduce(((0,), {}), kind="sparse", exact=True)),
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
    "any": _both(_reduce(*_ONE_DIM, kind="sparse", exact=True), _reduce(((1,), {}), kind="zero row", exact=True),
                 _reduce(((), {}), (((0, 1),), {}), kind="none", exact=True)),
    "all": _both(_reduce(*_ONE_DIM, kind="dense", exact=True),
                 _reduce(((), {}), (((0, 1),), {}), kind="all", exact=True)),
    "max": _max_like, "min": _max_like,
    "cumsum": _both(_reduce(((0,), {}), ((1,), {})), _reduce(((1,), {}), kind="ints", exact=True)),
    "cumprod": _both(_reduce(((0,), {}), ((1,), {})), _reduce(((1,), {}), kind="ints", exact=True)),
    **{name: _both(_on(_MATRIX, lambda x: _call(x, 0), lambda x: _call(x, dim=1)), _on(_CUBE, lambda x: _call(x, -1)))
       for name in ("cummax", "cummin")},
    "logcumsumexp": _reduce(((0,), {}), ((-1,), {})),
    "softmax": _reduce(((1,), {}), ((0,), {}), ((-1,), {"dtype": torch.float64})),
    "log_softmax": _reduce(((-1,), {}), ((0,), {})),
    "softmin": _reduce(((1,), {}), ((0,), {}), ((-1,), {"dtype": torch.float64})),
    "glu": lambda m: [Sample((m.x(*m.shape((8, 4), (6, 10))),) + args, {}) for args in ((), (0,), (-1,))],
    "nansum": _with_nans(*_MATRIX, calls=(lambda x: _call(x), lambda x: _call(x, 0), lambda x: _call(x, 1, True),
                                          lambda x: _call(x, (0, 1)))),
    "nanmean": _with_nans(*_MATRIX, calls=(lambda x: _call(x), lambda x: _call(x, 0), lambda x: _call(x, -1, True))),
    # matrix
    "matmul": _matmul, "mm": _mm, "bmm": _bmm, "linear": _linear, "einsum": _einsum, "outer": _outer,
    "baddbmm": _baddbmm,
    "addmm": _addmm, "addmv": _addmv, "addr": _addr, "addbmm": _addbmm, "mv": _mv, "dot": _dot, "vdot": _dot,
    "inner": _inner, "tensordot": _tensordot, "trace": _trace, "cross": _cross, "linalg_cross": _linalg_cross,
    # nn
    "layer_norm": _layer_norm, "rms_norm": _rms_norm, "embedding": _embedding, "dropout": _dropout,
    "scaled_dot_product_attention": _attention, "cross_entropy": _cross_entropy, "nll_loss": _nll_loss,
    "mse_loss": _pointwise_loss(weight="full"), "l1_loss": _pointwise_loss(weight="full"),
    "smooth_l1_loss": _pointwise_loss({}, {"beta": 0.5}), "huber_loss": _pointwise_loss({}, {"delta": 0.7}),
    "binary_cross_entropy": _pointwise_loss(probabilities=True, weight="full"),
    "binary_cross_entropy_with_logits": _pointwise_loss(weight="row"),
    "kl_div": _pointwise_loss(log_input=True, reductions=("none", "sum", "batchmean")),
    "pad": _pad,
    # view (the cases tests/test_ops_view.py swept on its own before)
    "view": _both(_on(_MATRIX, lambda x: _call(x, (x.shape[1], x.shape[0])), lambda x: _call(x, (2, -1, x.shape[1]))),
                  _on(_CUBE, lambda x: _call(x, (-1, x.shape[2]))),
                  _on(_SIZE_ONE, lambda x: _call(x, (x.shape[0], x.shape[2]))),
                  _on(_VECTOR, lambda x: _call(x, (-1, 3)), lambda x: _call(x, (3, -1)))),
    "reshape": _both(_on(_MATRIX, lambda x: _call(x, (-1,)), lambda x: _call(x, (x.shape[0], x.shape[1], 1)),
                         lambda x: _call(x, (1, -1))),
                     _on(_CUBE, lambda x: _call(x, (x.shape[0], -1)))),
    "flatten": _both(_on(_MATRIX, lambda x: _call(x)), _on(_CUBE, lambda x: _call(x, 1))),
    "unflatten": _both(_on(_MATRIX, lambda x: _call(x, 0, (2, -1))), _on(_CUBE, lambda x: _call(x, 2, (1, -1))),
                       _on(_VECTOR, lambda x: _call(x, 0, (-1, 3)))),
    "squeeze": _both(_on(_MATRIX, lambda x: _call(x)), _on(_SIZE_ONE, lambda x: _call(x), lambda x: _call(x, 1))),
    "unsqueeze": _both(_on(_MATRIX, lambda x: _call(x, 1)), _on(_VECTOR, lambda x: _call(x, 0))),
    "transpose": _both(_on(_MATRIX, lambda x: _call(x, 0, 1), lambda x: _call(x, -2, -1)),      # x.mT
                       _on(_CUBE, lambda x: _call(x, 0, 2), lambda x: _call(x, -2, -1))),
    "permute": _both(_on(_MATRIX, lambda x: _call(x, (1, 0))), _on(_CUBE, lambda x: _call(x, (2, 0, 1)))),
    "expand": _both(_on(_MATRIX, lambda x: _call(x, 3, *x.shape)), _on(_SIZE_ONE, lambda x: _call(x, -1, 3, -1)),
                    _on(_VECTOR, lambda x: _call(x, 2, -1))),
    "repeat": _both(_on(_MATRIX, lambda x: _call(x, 1, 2), lambda x: _call(x, 2, 1, 1)),
                    _on(_SIZE_ONE, lambda x: _call(x, 1, 2, 1))),
    "repeat_interleave": _both(_on(_MATRIX, lambda x: _call(x, 2, dim=1), lambda x: _call(x, 3, 0),
                                   lambda x: _call(x, 2), lambda x: _call(x, repeats=2, dim=-1)),
                               _on(_VECTOR, lambda x: _call(x, 2))),
    "contiguous": _on(_MATRIX, lambda x: _call(x)),
    "clone": _on(_MATRIX, lambda x: _call(x)),
    "detach": _on(_MATRIX, lambda x: _call(x)),
    "cat": _both(_pair(lambda x, y: _call([x, y]), lambda x, y: _call([x, y], 1), lambda x, y: _call([x, x]),
                       lambda x, y: _call([x, x], dim=1)),
                 _on(_CUBE, lambda x: _call([x, x], 2))),
    "stack": _both(_pair(lambda x, y: _call([x, x]), lambda x, y: _call((x, x), -1), lambda x, y: _call([x, y], 1)),
                   _on(_VECTOR, lambda x: _call([x, x], 1))),
    "split": _on(_MATRIX, lambda x: _call(x, 3), lambda x: _call(x, [1, x.shape[1] - 1], 1),
                 lambda x: _call(x, 2, dim=1)),
    "chunk": _on(_MATRIX, lambda x: _call(x, 2, 1)),
    "unbind": _on(_MATRIX, lambda x: _call(x, 0), lambda x: _call(x, 1)),
    "diagonal": _both(_on(_MATRIX, lambda x: _call(x), lambda x: _call(x, 1)),
                      _on(_CUBE, lambda x: _call(x, 0, 1, 2), lambda x: _call(x, -1, 0, 2),
                          lambda x: _call(x, offset=1, dim1=2, dim2=0))),
    "diagonal_scatter": _both(_on(_MATRIX, lambda x: _call(x, x.diagonal() * -3), lambda x: _call(x, x.diagonal(1) * -3, 1)),
                              _on(_CUBE, lambda x: _call(x, x.diagonal(0, 1, 2) * -3, 0, 1, 2),
                                  lambda x: _call(x, x.diagonal(1, 2, 0) * -3, offset=1, dim1=2, dim2=0))),
    "diag_embed": _both(_on(_MATRIX, lambda x: _call(x), lambda x: _call(x, 1, 0, 2)),
                        _on(_CUBE, lambda x: _call(x, dim1=0, dim2=-1))),
    "diag": _both(_on(_VECTOR, lambda x: _call(x), lambda x: _call(x, 1)),
                  _on(_MATRIX, lambda x: _call(x), lambda x: _call(x, -1))),
    "unfold": _both(_on(_MATRIX, lambda x: _call(x, 0, 2, 1), lambda x: _call(x, 1, 2, 2)),
                    _on(_CUBE, lambda x: _call(x, -1, 2, 1))),
    # indexing
    "getitem": _both(_index(1, (_ALL, 1), slice(1, 3), (_ALL, slice(None, None, 2)), (None, ..., None), (..., -1),
                            (_ALL, _ALL), (slice(None, None, 2), None), (-1, slice(1, None))),
                     _index((_ALL, 1), (..., slice(1, None)), sizes=_CUBE), _index((_ALL, 0), sizes=_SIZE_ONE),
                     _index((None, slice(2, None)), sizes=_VECTOR)),
    "setitem": _on(_MATRIX, *(lambda x, i=index, v=value: _call(x, canonical_index(i, tuple(x.shape)),
                                                                 v(x[i]) if callable(v) else v)
                               for index, value in (((_ALL, 1), -2.0), (1, lambda r: r * -1), (slice(1, 3), 5.0),
                                                    ((_ALL, slice(None, None, 2)), lambda r: r[..., :1] + 100),
                                                    ((slice(None), slice(1, None)), lambda r: -r)))),
    # never the whole tensor: overwriting every element would make any placement look right
    "narrow": _on(_MATRIX, lambda x: _call(x, 0, 1, 2), lambda x: _call(x, 1, 1, 2)),
    "index_select": _index_select,
    "gather": _with_positions(lambda x, i: _call(x, 1, i), lambda x, i: _call(x, 0, i),
                              lambda x, i: _call(x, 1, i[:, :2].contiguous())),
    # three positions per row, not all: an index that overwrites every element would make
    # R-input / Partial-src combinations the rule rightly refuses look correct to the validator
    "scatter": _with_positions(lambda x, i: _call(x, 1, i[:, :3], x[:, :3] * -3),
                               lambda x, i: _call(x.T.contiguous(), 0, i[:, :3].T.contiguous(), x[:, :3].T * -3),
                               lambda x, i: _call(x, 1, i[:, :3], -1.0),
                               lambda x, i: _call(x, 1, i[:, :3], i[:, :3].to(torch.float32))),
    # positions repeat (an addition may add two values at one place): a P(max) source must not pass
    "index_add": _index_writes(lambda x, d, i, v: _call(x, d, i.index_fill(0, torch.tensor([0]), i[-1]), v),
                               lambda x, d, i, v: _call(x, d, torch.tensor([1, 1, 0])[:len(i)], v, alpha=2.0)),
    "index_copy": _index_writes(lambda x, d, i, v: _call(x, d, i, v)),
    # values between x's: no P(min) by chance
    "index_fill": _index_writes(lambda x, d, i, v: _call(x, d, i, 5.5), lambda x, d, i, v: _call(x, d, i, v[0, 0] + 7)),
    # positions repeat within a row (i % 2) and values of both signs are added: see index_add
    "scatter_add": _with_positions(lambda x, i: _call(x, 1, i[:, :3] % 2, x[:, :3] - 5),
                                   lambda x, i: _call(x.T.contiguous(), 0, (i[:, :3] % 2).T.contiguous(),
                                                      x[:, :3].T - 5)),
    "scatter_reduce": _scatter_reduce,
    "select_scatter": _both(_on(_MATRIX, lambda x: _call(x, x[:, 1] * -3, 1, 1), lambda x: _call(x, x[2] * -3, 0, 2)),
                            _on(_CUBE, lambda x: _call(x, x[:, :, -1] * -3, -1, -1))),
    "slice_scatter": _both(_on(_MATRIX, lambda x: _call(x, x[1:3] * -3, 0, 1, 3),
                               lambda x: _call(x, x[:, 0:4:3] * -3, dim=1, end=4, step=3)),
                           _on(_CUBE, lambda x: _call(x, x[:, 1:] * -3, 1, 1))),
    "topk": _on(_MATRIX, lambda x: _call(x, 2, dim=1), lambda x: _call(x, 1, 0, largest=False)),
    "sort": _both(_on(_MATRIX, lambda x: _call(x, 0), lambda x: _call(x, descending=True)),
                  _on(_CUBE, lambda x: _call(x, 1))),
    "kthvalue": _both(_on(_MATRIX, lambda x: _call(x, 2), lambda x: _call(x, 1, 0, True),
                          lambda x: _call(x, 3, dim=-1)),
                      _on(_CUBE, lambda x: _call(x, 2, 1))),
    # median without a dim (the last calls) takes R only: every element is compared
    "median": _both(_on(_MATRIX, lambda x: _call(x, 0), lambda x: _call(x, 1, True), lambda x: _call(x)),
                    _on(_CUBE, lambda x: _call(x, dim=-1))),
    "nanmedian": _with_nans(*_MATRIX, calls=(lambda x: _call(x, 1), lambda x: _call(x, 0, keepdim=True),
                                              lambda x: _call(x))),
    "mode": _repeated(lambda x: _call(x), lambda x: _call(x, 0, True)),
    "index": _tensor_index, "index_put": _index_put, "masked_scatter": _masked_scatter,
    **VISION,
}


def samples(op: str, uneven: bool = False, seed: int = 0) -> list[Sample]:
    """The sample calls of `op`, sized for an even or uneven split (KeyError: none yet)."""
    return _BUILDERS[op](Make(uneven, seed))


def covered_ops() -> frozenset:
    return frozenset(_BUILDERS)

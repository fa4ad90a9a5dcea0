"""PURE: sample calls of the pointwise ops (unary, binary, with a scalar, special functions and
torch.nn.functional's activations), on 2-D inputs. Merged into samples.py's table."""
from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .sample_helpers import both, matrix_shape
from .sample_making import Make, Sample

__all__ = ["POINTWISE"]


def _one(*kwargs_variants, positive=False, exact=False, extra=()):
    """A unary op on a 2-D float input, once per kwargs variant."""
    def build(m: Make):
        x = m.x(*matrix_shape(m), positive=positive)
        return [Sample((x,) + tuple(extra), dict(kw), exact) for kw in (kwargs_variants or ({},))]
    return build


def _two(broadcast=False, positive=False, exact=False, kwargs: tuple = (), dtype=torch.float32, high=16):
    """A binary op on two same-shape inputs (and a row broadcast against a matrix)."""
    def build(m: Make):
        shape = matrix_shape(m)
        make = (lambda s: m.bools(*s)) if dtype == torch.bool else \
               (lambda s: m.ints(*s, low=0, high=high)) if dtype == torch.int64 else \
               (lambda s: m.x(*s, positive=positive))
        out = [Sample((make(shape), make(shape)), dict(kw), exact) for kw in (kwargs or ({},))]
        if broadcast:
            out.append(Sample((make(shape), make(shape[-1:])), {}, exact))
        return out
    return build


def _with_scalar(scalar, positive=False, nonzero=False, exact=True):
    return lambda m: [Sample((m.x(*matrix_shape(m), positive=positive, nonzero=nonzero), scalar), {}, exact)]


def _divide(m: Make):
    shape = matrix_shape(m)
    return [Sample((m.x(*shape), m.x(*shape, nonzero=True)), kw, True) for kw in ({}, {"rounding_mode": "floor"})]


def _power(m: Make):
    shape = matrix_shape(m)
    return [Sample((m.x(*shape, positive=True), m.x(*shape)), {})]


def _where(m: Make):
    shape = matrix_shape(m)
    return [Sample((m.bools(*shape), m.x(*shape), m.x(*shape)), {}, True),
            Sample((m.bools(*shape), m.x(*shape), 0.0), {}, True),
            Sample((m.bools(*shape), 1.0, m.x(*shape)), {}, True)]


def _masked_fill(m: Make):
    shape = matrix_shape(m)
    return [Sample((m.x(*shape), m.bools(*shape), 0.5), {}, True),
            Sample((m.x(*shape), m.bools(shape[-1]), -1.0), {}, True)]


def _clamp(m: Make):
    shape = matrix_shape(m)
    return [Sample((m.x(*shape), -0.5, 0.5), {}, True), Sample((m.x(*shape),), {"min": m.x(shape[-1])}, True)]


def _casts(m: Make):
    x, n = m.x(*matrix_shape(m), zeros=True), m.ints(*matrix_shape(m))
    return [Sample((x, dtype), {}, True) for dtype in (torch.float16, torch.bfloat16, torch.int64, torch.bool)] + \
           [Sample((n, torch.float32), {}, True)]


def _logical_not(m: Make):
    return [Sample((m.bools(*matrix_shape(m)),), {}, True), Sample((m.x(*matrix_shape(m), zeros=True),), {}, True)]


def _bitwise_not(m: Make):
    return [Sample((m.ints(*matrix_shape(m)),), {}, True), Sample((m.bools(*matrix_shape(m)),), {}, True)]


def _special_values(m: Make):
    x = m.x(*matrix_shape(m))
    x[0, 0], x[-1, -1], x[1, 0] = math.nan, math.inf, -math.inf
    return [Sample((x,), {}, True)]


def _unary(transform, exact=False, kwargs=({},)):
    """A unary op on transform(a random 2-D float input): into the op's domain."""
    def build(m: Make):
        x = transform(m.x(*matrix_shape(m)))
        return [Sample((x,), dict(kw), exact) for kw in kwargs]
    return build


def _divisions(exact=False):
    """fmod, remainder, floor_divide: by a nonzero tensor, by a broadcast row and by a scalar."""
    def build(m: Make):
        shape = matrix_shape(m)
        x = m.x(*shape) * 4
        return [Sample((x, m.x(*shape, nonzero=True)), {}, exact), Sample((x, m.x(shape[-1], nonzero=True)), {}, exact),
                Sample((x, 1.5), {}, exact)]
    return build


def _isclose(m: Make):
    x = m.x(*matrix_shape(m))
    y = torch.where(m.bools(*x.shape), x + 1e-3, x)
    return [Sample((x, y), {}, True), Sample((x, y), {"rtol": 1e-2}, True)]


def _lerp(m: Make):
    shape = matrix_shape(m)
    return [Sample((m.x(*shape), m.x(*shape), 0.3), {}), Sample((m.x(*shape), m.x(*shape), m.x(*shape)), {})]


def _addc(m: Make):
    """addcmul, addcdiv: input + value * tensor1 (* or /) tensor2 (nonzero)."""
    shape = matrix_shape(m)
    return [Sample((m.x(*shape), m.x(*shape), m.x(*shape, nonzero=True)), {}),
            Sample((m.x(*shape), m.x(*shape), m.x(shape[-1], nonzero=True)), {"value": 0.5})]


def _clamp_one_side(m: Make):
    shape = matrix_shape(m)
    return [Sample((m.x(*shape), 0.1), {}, True), Sample((m.x(*shape), m.x(shape[-1])), {}, True)]


def _nan_to_num(m: Make):
    x = _special_values(m)[0].args[0]
    return [Sample((x,), {}, True), Sample((x,), {"nan": 1.0, "posinf": 2.0}, True),
            Sample((x, 0.0, None, -3.0), {}, True)]


def _infinities(m: Make):
    """isposinf, isneginf: +-inf among finite values (no nan: a max carrying nan is nan)."""
    x = m.x(*matrix_shape(m))
    x[0, 0], x[-1, -1], x[1, 0], x[-1, 0] = math.inf, math.inf, -math.inf, -math.inf
    return [Sample((x,), {}, True)]


def _with_nan_values(m: Make):
    """fmax, fmin: nan in either operand (fmax(nan, b) is b, which no Partial law keeps)."""
    shape = matrix_shape(m)
    x, y, row = m.x(*shape), m.x(*shape), m.x(shape[-1])
    x.view(-1)[::5], y.view(-1)[2::5], row[1] = math.nan, math.nan, math.nan   # never both: nan out compares unequal
    return [Sample((x, y), {}, True), Sample((x.index_fill(1, torch.tensor([1]), 0.5), row), {}, True)]


def _nextafter(m: Make):
    """From 0, so that the one-ulp step is the whole result (from other values it is lost in
    any tolerance, and nextafter would look like the identity)."""
    shape = matrix_shape(m)
    return [Sample((torch.zeros(shape), m.x(*shape)), {}, True), Sample((torch.zeros(shape), m.x(shape[-1])), {}, True)]


def _polygamma(m: Make):
    return [Sample((n, m.x(*matrix_shape(m))), {}) for n in (1, 2)]


def _mvlgamma(m: Make):
    """mvlgamma(x, p) is defined for x > (p - 1) / 2."""
    return [Sample((m.x(*matrix_shape(m), positive=True) + 1.0, p), {}) for p in (1, 3)]


def _heaviside(m: Make):
    """Exact zeros in the input, where `values` is taken."""
    shape = matrix_shape(m)
    return [Sample((m.x(*shape, zeros=True), m.x(*shape)), {}, True),
            Sample((m.x(*shape, zeros=True), m.x(shape[-1])), {}, True)]


def _ldexp(m: Make):
    shape = matrix_shape(m)
    return [Sample((m.x(*shape), m.ints(*shape, low=-3, high=4)), {}, True),
            Sample((m.x(*shape), m.ints(shape[-1], low=-3, high=4)), {}, True)]


def _xlogy(m: Make):
    """Zeros in x where y < 0 (x log y is 0 there, a nonzero contribution's is nan). No zeros in
    y: d/dy = x / y would be inf, and a rank's zero share of the output gradient times inf is nan."""
    shape = matrix_shape(m)
    return [Sample((m.x(*shape, zeros=True), m.x(*shape, nonzero=True)), {}),
            Sample((m.x(*shape, zeros=True), 2.0), {})]


def _threshold(m: Make):
    """value above the threshold (a step down: no order law) and below it."""
    x = m.x(*matrix_shape(m))
    return [Sample((x, 0.1, 20.0), {}, True), Sample((x, 0.5, -1.0), {}, True)]


_EXACT_UNARY = ("neg", "abs", "square", "relu")
_CLOSE_UNARY = ("exp", "sin", "cos", "tanh", "sigmoid", "erf", "silu", "softplus")
_POSITIVE = ("log", "log1p", "sqrt", "rsqrt")
_COMPARISONS = ("eq", "ne", "lt", "le", "gt", "ge", "minimum", "maximum")
_BOOLEAN = ("logical_and", "logical_or", "logical_xor")
_BITWISE = ("bitwise_and", "bitwise_or", "bitwise_xor")


POINTWISE: dict[str, Callable] = {
    **{name: _one(exact=True) for name in _EXACT_UNARY},
    **{name: _one() for name in _CLOSE_UNARY},
    **{name: _one(positive=True, exact=name == "sqrt") for name in _POSITIVE},
    "erfinv": lambda m: [Sample((torch.tanh(m.x(*matrix_shape(m))) * 0.9,), {})],   # its domain is (-1, 1)
    **{name: _two(broadcast=name in ("maximum", "lt"), exact=True) for name in _COMPARISONS},
    "eq": _two(dtype=torch.int64, high=4, exact=True), "ne": _two(dtype=torch.int64, high=4, exact=True),
    **{name: _two(dtype=torch.bool, exact=True) for name in _BOOLEAN},
    **{name: both(_two(dtype=torch.int64, exact=True), _two(dtype=torch.bool, exact=True)) for name in _BITWISE},
    "add": both(_two(broadcast=True, exact=True, kwargs=({}, {"alpha": -1.5})), _with_scalar(1.5)),
    "sub": both(_two(exact=True, kwargs=({}, {"alpha": 2.0})), _with_scalar(0.5)),
    "mul": both(_two(broadcast=True, exact=True), _with_scalar(2.5)),
    "div": both(_divide, _with_scalar(4.0)),
    "pow": both(_power, _with_scalar(2.0, exact=False)),
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
}

"""torch's tensor methods and functions that are compositions of dtorch's ops: `x.t()`,
`x.swapaxes(0, 1)`, `x.movedim(0, -1)`, `x.view_as(y)`, `x.new_zeros(4)`, `x.clip(0, 1)`,
`x.tril()`, `x.flip(0)`, `x.rot90()`, `x.roll(1, 0)`, `x.select(1, 0)`, `x.aminmax()`, `torch.var_mean(x)`,
torch's aliases (`torch.arccos`, `x.divide`), `F.rrelu(x, training=True)`...

Each is written with the registry's ops (so placement rules, automatic redistributes, autograd
and dtorch.compile apply as to the ops it uses) and installed on DTensor; the torch.* spellings
reach the same code through __torch_function__ (dtensor/api.py's TORCH_FUNCTIONS). tests/test_torch_methods.py
checks each against torch on sharded, replicated and uneven inputs."""
from __future__ import annotations

import torch

from ..spec.placements import Replicate
from ..dtensor.factories import arange, empty, full, ones, rand_like, zeros
from ..dtensor.inplace import assign
from ..ops.conversions import check_new_device
from ..ops.unsupported import unsupported_op
from ..dtensor import api
from ..dtensor.tensor import DTensor, call_op

__all__ = ["t", "movedim", "tril", "triu", "flip", "rot90", "roll", "select", "aminmax", "count_nonzero", "var_mean",
           "std_mean", "ALIASES", "positive", "polygamma", "threshold", "rrelu"]


# --- transposes and dim moves -------------------------------------------------------------------
def t(input: DTensor) -> DTensor:
    """torch.t: a matrix transposed; a 0-d or 1-d tensor as it is."""
    if input.ndim > 2:
        raise RuntimeError(f"t() expects a tensor with <= 2 dimensions, but self is {input.ndim}D")
    return input if input.ndim < 2 else call_op("transpose", (input, 0, 1), {})


def adjoint(input: DTensor) -> DTensor:
    """The last two dims swapped (and conjugated: refused for complex tensors, which dtorch's
    conjugate views do not cover)."""
    if input.dtype.is_complex:
        raise TypeError("adjoint() of a complex DTensor is not supported; use x.mT.conj()")
    return call_op("transpose", (input, -2, -1), {})


def movedim(input: DTensor, source, destination) -> DTensor:
    """torch.movedim: the dims `source` (an int or a sequence) go to `destination`; the others
    keep their order."""
    sources = [source] if isinstance(source, int) else list(source)
    targets = [destination] if isinstance(destination, int) else list(destination)
    if len(sources) != len(targets):
        raise RuntimeError(f"movedim: Invalid source or destination dims: source ({sources} dims) should "
                           f"contain the same number of dims as destination ({targets} dims)")
    ndim = max(input.ndim, 1)
    sources, targets = [s % ndim for s in sources], [d % ndim for d in targets]
    order = [None] * input.ndim
    for s, d in zip(sources, targets):
        order[d] = s
    rest = iter(d for d in range(input.ndim) if d not in sources)
    return call_op("permute", (input, tuple([next(rest) if o is None else o for o in order])), {})


# --- shapes and dtypes of another tensor --------------------------------------------------------
def _view_as(input: DTensor, other) -> DTensor:
    return input.view(tuple(other.shape))


def _reshape_as(input: DTensor, other) -> DTensor:
    return input.reshape(tuple(other.shape))


def _expand_as(input: DTensor, other) -> DTensor:
    return input.expand(tuple(other.shape))


def _type_as(input: DTensor, other) -> DTensor:
    return input.to(other.dtype)


def _replicated(mesh) -> list:
    return [Replicate()] * mesh.ndim


def _new_factory(factory):
    """x.new_zeros(size) and its kin: x's dtype (unless given), on x's mesh, Replicate (as
    x.new_tensor)."""
    def make(self: DTensor, *size, dtype=None, device=None, requires_grad=False, layout=None, pin_memory=False):
        check_new_device(device, self.device_mesh, f"x.new_{factory.__name__}(..., device={str(device)!r})",
                         f"dtorch.{factory.__name__}")
        return factory(*size, dtype=dtype or self.dtype, device_mesh=self.device_mesh,
                       placements=_replicated(self.device_mesh), requires_grad=requires_grad)
    make.__name__ = f"new_{factory.__name__}"
    return make


def _new_full(self: DTensor, size, fill_value, dtype=None, device=None, requires_grad=False, layout=None,
              pin_memory=False) -> DTensor:
    check_new_device(device, self.device_mesh, f"x.new_full(..., device={str(device)!r})", "dtorch.full")
    size = (size,) if isinstance(size, int) else tuple(size)
    return full(size, fill_value, dtype=dtype or self.dtype, device_mesh=self.device_mesh,
                placements=_replicated(self.device_mesh), requires_grad=requires_grad)


# --- triangles, flips, rolls, selections --------------------------------------------------------
def _triangle(input: DTensor, diagonal: int, lower: bool) -> DTensor:
    """Zeros above (tril) or below (triu) the `diagonal`-th diagonal of the last two dims: a mask
    made on the workers from two aranges (no upload), applied with masked_fill."""
    name = "tril" if lower else "triu"
    if input.ndim < 2:
        raise RuntimeError(f"{name}: input tensor must have at least 2 dimensions")
    rows, cols = input.shape[-2], input.shape[-1]
    mesh = input.device_mesh
    offset = (arange(cols, device_mesh=mesh, placements=_replicated(mesh))
              - arange(rows, device_mesh=mesh, placements=_replicated(mesh)).unsqueeze(-1))
    dropped = offset > diagonal if lower else offset < diagonal
    return input.masked_fill(dropped, 0)


def tril(input: DTensor, diagonal: int = 0) -> DTensor:
    return _triangle(input, diagonal, lower=True)


def triu(input: DTensor, diagonal: int = 0) -> DTensor:
    return _triangle(input, diagonal, lower=False)


def flip(input: DTensor, *dims, **keyword) -> DTensor:
    """torch.flip(x, dims), x.flip(0, 1), x.flip(dims=(0,)): each dim read backwards (an
    index_select of a reversed arange)."""
    dims = keyword.pop("dims", dims[0] if len(dims) == 1 and not isinstance(dims[0], int) else dims)
    if keyword:
        raise TypeError(f"flip() got unexpected keyword arguments {sorted(keyword)}")
    mesh = input.device_mesh
    for dim in (dims,) if isinstance(dims, int) else dims:
        size = input.shape[dim]
        reversed_index = arange(size - 1, -1, -1, device_mesh=mesh, placements=_replicated(mesh))
        input = input.index_select(dim, reversed_index)
    return input


def rot90(input: DTensor, k: int = 1, dims=(0, 1)) -> DTensor:
    """torch.rot90: a quarter turn k times in the plane of `dims`, from dims[0] towards dims[1];
    torch's own composition (flips and a transpose). Refusals in torch's words."""
    dims = tuple(dims)
    if len(dims) != 2:
        raise RuntimeError(f"expected total rotation dims == 2, but got dims = {len(dims)}")
    if input.ndim < 2:
        raise RuntimeError(f"expected total dims >= 2, but got total dims = {input.ndim}")
    for dim in dims:
        if not -input.ndim <= dim < input.ndim:
            raise IndexError(f"Dimension out of range (expected to be in range of [{-input.ndim}, "
                             f"{input.ndim - 1}], but got {dim})")
    first, second = (d % input.ndim for d in dims)
    if first == second:
        raise RuntimeError(f"expected rotation dims to be different, but got dim0 = {dims[0]} and dim1 = {dims[1]}")
    turns = k % 4
    if turns == 0:
        return call_op("clone", (input,), {})
    if turns == 2:
        return flip(input, (first, second))
    flipped = flip(input, second if turns == 1 else first)
    return call_op("transpose", (flipped, first, second), {})


def _unfold_spelled(input, *args, **kwargs) -> DTensor:
    """torch's functions named unfold that reach __torch_function__: F.unfold (im2col: it always
    passes dilation=, padding=, stride=) is refused, never run as the registry's Tensor.unfold."""
    if {"dilation", "padding", "stride"} & kwargs.keys():
        raise unsupported_op("unfold", "torch.nn.functional.unfold")
    return call_op("unfold", (input,) + args, kwargs)


def roll(input: DTensor, shifts, dims=None) -> DTensor:
    """torch.roll: elements shifted along `dims` (the flattened tensor when None), wrapping
    around: two narrows joined with cat per dim."""
    shifts = (shifts,) if isinstance(shifts, int) else tuple(shifts)
    if dims is None:
        if len(shifts) != 1:
            raise RuntimeError(f"roll: shifts must be one int when dims is not given, got {shifts}")
        return roll(input.flatten(), shifts, 0).view(tuple(input.shape))
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    if len(shifts) != len(dims):
        raise RuntimeError(f"roll: shifts and dimensions must align. shifts: {len(shifts)}, dims:{len(dims)}")
    for shift, dim in zip(shifts, dims):
        size = input.shape[dim]
        moved = shift % size if size else 0
        if moved:
            pieces = [input.narrow(dim, size - moved, moved), input.narrow(dim, 0, size - moved)]
            input = call_op("cat", (pieces, dim), {})
    return input


def select(input: DTensor, dim: int, index: int) -> DTensor:
    """torch.select: the slice at `index` of `dim`, that dim removed (x[:, index] for dim 1)."""
    dim = dim % input.ndim
    return input[(slice(None),) * dim + (index,)]


# --- reductions -----------------------------------------------------------------------------------
def aminmax(input: DTensor, *, dim=None, keepdim: bool = False):
    """torch.aminmax: (min, max) as torch.return_types.aminmax."""
    if dim is None:
        low, high = input.amin(), input.amax()
        if keepdim:
            low, high = low.view((1,) * input.ndim), high.view((1,) * input.ndim)
    else:
        low, high = input.amin(dim, keepdim=keepdim), input.amax(dim, keepdim=keepdim)
    return torch.return_types.aminmax((low, high))


def count_nonzero(input: DTensor, dim=None) -> DTensor:
    nonzero = input != 0
    return nonzero.sum() if dim is None else nonzero.sum(dim)


def _with_mean(spread: str):
    """torch.var_mean / std_mean: (spread, mean) over the same dims, as a tuple."""
    def both(input: DTensor, *args, **kwargs):
        dim = kwargs.get("dim", args[0] if args else None)
        keepdim = kwargs.get("keepdim", args[2] if len(args) > 2 else False)
        mean = input.mean() if dim is None else input.mean(dim, keepdim=keepdim)
        if dim is None and keepdim:
            mean = mean.view((1,) * input.ndim)
        return getattr(input, spread)(*args, **kwargs), mean
    both.__name__ = f"{spread}_mean"
    return both


var_mean, std_mean = _with_mean("var"), _with_mean("std")


# --- torch's other names for registry ops -----------------------------------------------------------
# alias -> the op it names (as clip is clamp): x.arccos(), torch.arccos(x) and x.arccos_() run acos
ALIASES = {"arccos": "acos", "arcsin": "asin", "arctan": "atan", "arctan2": "atan2", "arccosh": "acosh",
           "arcsinh": "asinh", "arctanh": "atanh", "absolute": "abs", "negative": "neg", "fix": "trunc",
           "multiply": "mul", "divide": "div", "true_divide": "div", "subtract": "sub", "greater": "gt",
           "greater_equal": "ge", "less": "lt", "less_equal": "le", "not_equal": "ne", "ger": "outer"}
# torch.nn.functional functions whose __name__ is not the op's name
FUNCTIONAL_NAMES = {"log_sigmoid": "logsigmoid"}   # F.logsigmoid is torch._C._nn.log_sigmoid


def _alias(op: str):
    def function(input, *args, **kwargs):
        return call_op(op, (input,) + tuple(args), kwargs)
    function.__name__ = op
    return function


def positive(input: DTensor) -> DTensor:
    """torch.positive: the input itself (torch refuses bool tensors, in its words)."""
    if input.dtype == torch.bool:
        raise TypeError("The `+` operator, on a bool tensor is not supported.")
    return input


def polygamma(n: int, input: DTensor) -> DTensor:
    return call_op("polygamma", (n, input), {})


def _polygamma_method(self: DTensor, n: int) -> DTensor:
    """x.polygamma(n): torch's method takes the order after the tensor; the op takes it first."""
    return polygamma(n, self)


def _polygamma_(self: DTensor, n: int) -> DTensor:
    return assign(self, polygamma(n, self), "polygamma_")


def threshold(input: DTensor, threshold, value, inplace: bool = False) -> DTensor:
    """F.threshold (its __name__ is _threshold) and torch.threshold: the op, inplace rebinding x."""
    result = call_op("threshold", (input, threshold, value), {})
    return assign(input, result, "threshold(inplace=True)") if inplace else result


def rrelu(input: DTensor, lower: float = 1.0 / 8, upper: float = 1.0 / 3, training: bool = False, generator=None,
          inplace: bool = False) -> DTensor:
    """F.rrelu / torch.rrelu. Evaluation is the rrelu op (leaky_relu with the mean slope); training
    draws each element's negative slope from U(lower, upper) with dtorch's random stream (rand_like,
    the same on every layout), as torch draws from its own."""
    if not training:
        result = call_op("rrelu", (input, lower, upper), {})
    else:
        slopes = rand_like(input, generator=generator) * (upper - lower) + lower
        result = call_op("where", (input >= 0, input, input * slopes), {})
    return assign(input, result, "rrelu(inplace=True)") if inplace else result


def _install() -> None:
    methods = {
        "t": t, "adjoint": adjoint, "swapaxes": DTensor.transpose, "swapdims": DTensor.transpose, "movedim": movedim,
        "moveaxis": movedim,
        "view_as": _view_as, "reshape_as": _reshape_as, "expand_as": _expand_as, "type_as": _type_as,
        "new_zeros": _new_factory(zeros), "new_ones": _new_factory(ones), "new_empty": _new_factory(empty),
        "new_full": _new_full,
        "is_contiguous": lambda self, memory_format=None: True,   # results never share storage visibly
        "element_size": lambda self: self.dtype.itemsize,
        "nelement": lambda self: self.numel(),
        "clip": DTensor.clamp, "clip_": DTensor.clamp_,
        "where": lambda self, condition, other: call_op("where", (condition, self, other), {}),
        "tril": tril, "triu": triu, "flip": flip, "fliplr": lambda self: flip(self, 1),
        "flipud": lambda self: flip(self, 0), "rot90": rot90, "roll": roll, "select": select, "aminmax": aminmax,
        "count_nonzero": count_nonzero,
    }
    methods.update({alias: _alias(op) for alias, op in ALIASES.items()}, positive=positive,
                   polygamma=_polygamma_method, polygamma_=_polygamma_)
    methods.update({alias + "_": getattr(DTensor, op + "_") for alias, op in ALIASES.items()
                    if api.has_method(op + "_") and hasattr(torch.Tensor, alias + "_")})
    api.register_methods({name: method for name, method in methods.items() if not api.in_class_body(name)})
    api.register_method("mH", property(adjoint, doc="The last two dims swapped (x.mT for a real tensor)."))
    api.register_method("H", property(t, doc="A matrix transposed (real tensors: torch's conjugate transpose)."))
    api.register_functions(dict(
        t=t, adjoint=adjoint, swapaxes=DTensor.transpose, swapdims=DTensor.transpose, movedim=movedim,
        moveaxis=movedim, clip=DTensor.clamp, tril=tril, triu=triu, flip=flip, fliplr=methods["fliplr"],
        flipud=methods["flipud"], rot90=rot90, unfold=_unfold_spelled, roll=roll, select=select,
        aminmax=aminmax, count_nonzero=count_nonzero, var_mean=var_mean, std_mean=std_mean,
        positive=positive, polygamma=polygamma, threshold=threshold, _threshold=threshold, rrelu=rrelu))
    api.register_functions({alias: _alias(op) for alias, op in {**ALIASES, **FUNCTIONAL_NAMES}.items()})


_install()

"""torch functions that are compositions of dtorch's ops: shapes (`torch.broadcast_to`, `tile`,
`ravel`, `hstack`, `tensor_split`, `diff`, `take_along_dim`...), matrix chains (`chain_matmul`,
`linalg.multi_dot`, `kron`) and torch.nn.functional's `normalize`, `cosine_similarity`,
`pairwise_distance`, `one_hot`, `prelu`, `pixel_shuffle` and three margin losses.

Each is written with the registry's ops, so placement rules, automatic redistributes, autograd,
dtorch.compile and aliasing apply as to the ops it uses: `broadcast_to` is an expand, `ravel` a
reshape and `tensor_split`'s pieces are narrows, all views as in torch (dtorch/dtensor/aliasing.py).
They reach dtorch through __torch_function__ (dtensor/api.py's TORCH_FUNCTIONS) and, where torch.Tensor has
the method, as DTensor methods. tests/test_composites.py checks each against torch.
"""
from __future__ import annotations

import functools

import torch
from torch.nn import _reduction

from ..spec.placements import Replicate
from ..errors import UnsupportedOpError, user_site
from ..dtensor.factories import arange
from ..dtensor import api
from ..dtensor.tensor import DTensor, call_op

__all__ = ["broadcast_to", "tile", "ravel", "atleast_1d", "atleast_2d", "atleast_3d", "hstack", "vstack", "dstack",
           "column_stack", "tensor_split", "hsplit", "vsplit", "dsplit", "diff", "take_along_dim", "chain_matmul",
           "multi_dot", "kron", "normalize", "cosine_similarity", "pairwise_distance", "one_hot", "prelu",
           "pixel_shuffle", "pixel_unshuffle", "margin_ranking_loss", "cosine_embedding_loss", "triplet_margin_loss",
           "is_floating_point", "is_complex", "is_signed", "is_same_size"]


# --- shapes -----------------------------------------------------------------------------------------
def broadcast_to(input: DTensor, size) -> DTensor:
    return input.expand(tuple(size))


def tile(input: DTensor, dims) -> DTensor:
    """torch.tile: repeat, with dims padded by leading 1s when shorter than the input's rank."""
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    return input.repeat((1,) * (input.ndim - len(dims)) + dims)


def ravel(input: DTensor) -> DTensor:
    return input.reshape(-1)


def _at_least(rank: int, shape_of):
    """torch.atleast_1d/2d/3d: one tensor, or a tuple of them for several (or a sequence)."""
    def raise_rank(*tensors):
        if len(tensors) == 1 and isinstance(tensors[0], (list, tuple)):
            tensors = tuple(tensors[0])
        raised = tuple([t if t.ndim >= rank else t.reshape(shape_of(tuple(t.shape))) for t in tensors])
        return raised[0] if len(raised) == 1 else raised
    raise_rank.__name__ = f"atleast_{rank}d"
    return raise_rank


atleast_1d = _at_least(1, lambda shape: (1,))
atleast_2d = _at_least(2, lambda shape: (1,) + shape + (1,) * (1 - len(shape)))
atleast_3d = _at_least(3, lambda shape: {0: (1, 1, 1), 1: (1,) + shape + (1,), 2: shape + (1,)}[len(shape)])


def hstack(tensors) -> DTensor:
    tensors = [atleast_1d(t) for t in tensors]
    return call_op("cat", (tensors, 0 if tensors[0].ndim == 1 else 1), {})


def vstack(tensors) -> DTensor:
    return call_op("cat", ([atleast_2d(t) for t in tensors], 0), {})


def dstack(tensors) -> DTensor:
    return call_op("cat", ([atleast_3d(t) for t in tensors], 2), {})


def column_stack(tensors) -> DTensor:
    """1-D (and 0-d) tensors become columns, the rest join along dim 1."""
    columns = [t.reshape(t.numel(), 1) if t.ndim < 2 else t for t in tensors]
    return call_op("cat", (columns, 1), {})


def _split_points(size: int, indices_or_sections) -> list[int]:
    """The boundaries of tensor_split's pieces: n sections (the first size % n one longer) or the
    given indices, clamped to the dim as torch's slicing does."""
    if isinstance(indices_or_sections, int):
        sections = indices_or_sections
        if sections <= 0:
            raise RuntimeError(f"number of sections must be larger than 0, got {sections}")
        small, extra = divmod(size, sections)
        return [k * small + min(k, extra) for k in range(1, sections)]
    return [min(max(i + size if i < 0 else i, 0), size) for i in indices_or_sections]


def tensor_split(input: DTensor, indices_or_sections=None, dim: int = 0, *, sections=None, indices=None,
                 tensor_indices_or_sections=None) -> tuple:
    """torch.tensor_split: narrows (views, as torch's pieces are), so a sharded `dim` needs the
    same move a narrow does."""
    given = next(v for v in (indices_or_sections, sections, indices, tensor_indices_or_sections) if v is not None)
    if isinstance(given, (torch.Tensor, DTensor)):
        given = given.tolist()
    dim = dim % max(input.ndim, 1)
    size = input.shape[dim]
    bounds = [0] + _split_points(size, given) + [size]
    return tuple([input.narrow(dim, start, max(stop - start, 0)) for start, stop in zip(bounds, bounds[1:])])


def _split_along(name: str, dim_of, least_rank: int):
    """hsplit / vsplit / dsplit: tensor_split along one dim, where an int must divide it evenly."""
    def split(input: DTensor, indices_or_sections) -> tuple:
        if input.ndim < least_rank:
            raise RuntimeError(f"torch.{name} requires a tensor with at least {least_rank} dimension, but got a "
                               f"tensor with {input.ndim} dimensions!")
        dim = dim_of(input)
        if isinstance(indices_or_sections, int) and (indices_or_sections == 0 or
                                                     input.shape[dim] % indices_or_sections):
            raise RuntimeError(f"torch.{name} attempted to split along dimension {dim}, but the size of the "
                               f"dimension {input.shape[dim]} is not divisible by the split_size "
                               f"{indices_or_sections}!")
        return tensor_split(input, indices_or_sections, dim)
    split.__name__ = name
    return split


hsplit = _split_along("hsplit", lambda x: 0 if x.ndim == 1 else 1, 1)
vsplit = _split_along("vsplit", lambda x: 0, 2)
dsplit = _split_along("dsplit", lambda x: 2, 3)


def split_with_sizes(input: DTensor, split_sizes, dim: int = 0) -> tuple:
    return input.split(list(split_sizes), dim)


def narrow_copy(input: DTensor, dim: int, start: int, length: int) -> DTensor:
    return input.narrow(dim, start, length).clone()


def diff(input: DTensor, n: int = 1, dim: int = -1, prepend=None, append=None) -> DTensor:
    """torch.diff: x[1:] - x[:-1] along `dim`, n times, after joining prepend and append (bools
    differ by xor). Two narrows of the dim: a sharded `dim` is moved as a narrow's is."""
    dim = dim % max(input.ndim, 1)
    pieces = [p for p in (prepend, input, append) if p is not None]
    if len(pieces) > 1:
        input = call_op("cat", ([p if p.ndim else p.expand(_with_size(input, dim, 1)) for p in pieces], dim), {})
    for _ in range(n):
        length = max(input.shape[dim] - 1, 0)
        later, earlier = input.narrow(dim, 1 if length else 0, length), input.narrow(dim, 0, length)
        input = later != earlier if input.dtype == torch.bool else later - earlier
    return input


def _with_size(input, dim: int, size: int) -> tuple:
    return tuple([size if d == dim else s for d, s in enumerate(input.shape)])


def take_along_dim(input: DTensor, indices, dim=None) -> DTensor:
    """torch.take_along_dim: gather after broadcasting every dim but `dim`; without a dim, of the
    flattened input."""
    if dim is None:
        return input.reshape(-1).gather(0, indices.reshape(-1))
    if input.ndim != indices.ndim:
        raise RuntimeError(f"torch.take_along_dim(): input and indices should have the same number of dimensions, "
                           f"but got {input.ndim} dimensions for input, and {indices.ndim} dimensions for indices")
    dim = dim % input.ndim
    common = [max(a, b) for a, b in zip(input.shape, indices.shape)]
    source = input.expand(tuple([s if d != dim else input.shape[d] for d, s in enumerate(common)]))
    positions = indices.expand(tuple([s if d != dim else indices.shape[d] for d, s in enumerate(common)]))
    return source.gather(dim, positions)


# --- matrix chains ---------------------------------------------------------------------------------
def chain_matmul(*matrices) -> DTensor:
    if len(matrices) == 1 and isinstance(matrices[0], (list, tuple)):
        matrices = tuple(matrices[0])
    return functools.reduce(lambda a, b: call_op("mm", (a, b), {}), matrices)


def multi_dot(tensors) -> DTensor:
    """torch.linalg.multi_dot: a chain of matmuls, left to right (torch picks the cheapest order;
    the values agree to rounding); a 1-D first or last tensor is a row or column vector."""
    tensors = list(tensors)
    if len(tensors) < 2:
        raise RuntimeError(f"multi_dot(): expected at least 2 tensors but got {len(tensors)}")
    first_is_vector, last_is_vector = tensors[0].ndim == 1, tensors[-1].ndim == 1
    if first_is_vector:
        tensors[0] = tensors[0].unsqueeze(0)
    if last_is_vector:
        tensors[-1] = tensors[-1].unsqueeze(1)
    result = chain_matmul(*tensors)
    if first_is_vector:
        result = result.squeeze(0)
    return result.squeeze(-1) if last_is_vector else result


def kron(input: DTensor, other: DTensor) -> DTensor:
    """torch.kron: input's dims interleaved with other's (each padded to the same rank), multiplied
    by broadcast and merged pairwise: a reshape of an outer product."""
    rank = max(input.ndim, other.ndim)
    a = (1,) * (rank - input.ndim) + tuple(input.shape)
    b = (1,) * (rank - other.ndim) + tuple(other.shape)
    spread = input.reshape(tuple([s for size in a for s in (size, 1)])) * \
        other.reshape(tuple([s for size in b for s in (1, size)]))
    return spread.reshape(tuple([x * y for x, y in zip(a, b)]))


# --- torch.nn.functional -----------------------------------------------------------------------------
def normalize(input: DTensor, p: float = 2.0, dim: int = 1, eps: float = 1e-12, out=None) -> DTensor:
    if out is not None:
        raise UnsupportedOpError(f"normalize(out=...) at {user_site()}: dtorch ops return new DTensors; "
                                 "write y = F.normalize(x)")
    return input / input.norm(p, dim, keepdim=True).clamp_min(eps).expand_as(input)


def cosine_similarity(x1: DTensor, x2: DTensor, dim: int = 1, eps: float = 1e-8) -> DTensor:
    """torch's form: each input divided by its norm (at least eps) first, then the dot product."""
    shape = tuple(torch.broadcast_shapes(tuple(x1.shape), tuple(x2.shape)))
    x1, x2 = x1.expand(shape), x2.expand(shape)
    unit1 = x1 / x1.norm(2, dim, keepdim=True).clamp_min(eps)
    unit2 = x2 / x2.norm(2, dim, keepdim=True).clamp_min(eps)
    return (unit1 * unit2).sum(dim)


def pairwise_distance(x1, x2, p: float = 2.0, eps: float = 1e-6, keepdim: bool = False) -> DTensor:
    """torch's form: the p-norm of x1 - x2 + eps over the last dim."""
    last = max(x1.ndim, x2.ndim) - 1
    return (x1 - x2 + eps).norm(p, last, keepdim=keepdim)


def one_hot(tensor: DTensor, num_classes: int = -1) -> DTensor:
    """Each class index compared with arange(num_classes), made on the workers. Without
    num_classes torch counts max + 1 classes, a number only the values know: refused."""
    if num_classes < 0:
        raise UnsupportedOpError(f"one_hot without num_classes at {user_site()}: torch takes the class count from "
                                 "the values (max + 1), which no rank knows alone; pass num_classes=")
    mesh = tensor.device_mesh
    classes = arange(num_classes, device_mesh=mesh, placements=[Replicate()] * mesh.ndim)
    return (tensor.unsqueeze(-1) == classes).to(torch.int64)


def prelu(input: DTensor, weight: DTensor) -> DTensor:
    """x where x > 0, else weight * x, one weight per channel (dim 1) or one for all."""
    if weight.numel() > 1 and input.ndim >= 2:
        weight = weight.reshape((weight.numel(),) + (1,) * (input.ndim - 2))
    return call_op("where", (input > 0, input, weight * input), {})


def pixel_shuffle(input: DTensor, upscale_factor: int) -> DTensor:
    """(*, C r², H, W) -> (*, C, H r, W r): a reshape, a permute and a reshape."""
    r, lead = upscale_factor, tuple(input.shape[:-3])
    channels, height, width = input.shape[-3:]
    n = len(lead)
    split = input.reshape(lead + (channels // (r * r), r, r, height, width))
    moved = split.permute(tuple(range(n)) + tuple([n + d for d in (0, 3, 1, 4, 2)]))
    return moved.reshape(lead + (channels // (r * r), height * r, width * r))


def pixel_unshuffle(input: DTensor, downscale_factor: int) -> DTensor:
    """pixel_shuffle's inverse: (*, C, H r, W r) -> (*, C r², H, W)."""
    r, lead = downscale_factor, tuple(input.shape[:-3])
    channels, height, width = input.shape[-3:]
    n = len(lead)
    split = input.reshape(lead + (channels, height // r, r, width // r, r))
    moved = split.permute(tuple(range(n)) + tuple([n + d for d in (0, 2, 4, 1, 3)]))
    return moved.reshape(lead + (channels * r * r, height // r, width // r))


def reduced_loss(losses: DTensor, size_average, reduce, reduction: str) -> DTensor:
    if size_average is not None or reduce is not None:
        reduction = _reduction.legacy_get_string(size_average, reduce)
    if reduction == "none":
        return losses
    if reduction not in ("mean", "sum"):
        raise ValueError(f"{reduction} is not a valid value for reduction")
    return losses.mean() if reduction == "mean" else losses.sum()


def margin_ranking_loss(input1, input2, target, margin: float = 0.0, size_average=None, reduce=None,
                        reduction: str = "mean") -> DTensor:
    return reduced_loss((-target * (input1 - input2) + margin).clamp_min(0), size_average, reduce, reduction)


_COSINE_EPSILON = 1e-12   # torch's, added to each squared magnitude


def cosine_embedding_loss(input1, input2, target, margin: float = 0.0, size_average=None, reduce=None,
                          reduction: str = "mean") -> DTensor:
    """torch's form: 1 - cos for target 1, max(cos - margin, 0) for target -1, over dim target.ndim."""
    dim = target.ndim
    products = (input1 * input2).sum(dim)
    magnitudes = ((input1 * input1).sum(dim) + _COSINE_EPSILON) * ((input2 * input2).sum(dim) + _COSINE_EPSILON)
    cosine = products / magnitudes.sqrt()
    similar = call_op("where", (target == 1, 1 - cosine, 0.0), {})
    dissimilar = call_op("where", (target == -1, (cosine - margin).clamp_min(0), 0.0), {})
    return reduced_loss(similar + dissimilar, size_average, reduce, reduction)


def triplet_margin_loss(anchor, positive, negative, margin: float = 1.0, p: float = 2, eps: float = 1e-6,
                        swap: bool = False, size_average=None, reduce=None, reduction: str = "mean") -> DTensor:
    to_positive = pairwise_distance(anchor, positive, p, eps)
    to_negative = pairwise_distance(anchor, negative, p, eps)
    if swap:
        to_negative = call_op("minimum", (to_negative, pairwise_distance(positive, negative, p, eps)), {})
    return reduced_loss((margin + to_positive - to_negative).clamp_min(0), size_average, reduce, reduction)


# --- installation --------------------------------------------------------------------------------------
_FUNCTIONS = {
    "broadcast_to": broadcast_to, "tile": tile, "ravel": ravel, "atleast_1d": atleast_1d, "atleast_2d": atleast_2d,
    "atleast_3d": atleast_3d, "hstack": hstack, "vstack": vstack, "row_stack": vstack, "dstack": dstack,
    "column_stack": column_stack, "tensor_split": tensor_split, "hsplit": hsplit, "vsplit": vsplit, "dsplit": dsplit,
    "split_with_sizes": split_with_sizes, "unsafe_split": lambda input, size, dim=0: input.split(size, dim),
    "unsafe_chunk": lambda input, chunks, dim=0: input.chunk(chunks, dim), "narrow_copy": narrow_copy,
    "diff": diff, "take_along_dim": take_along_dim, "chain_matmul": chain_matmul, "linalg_multi_dot": multi_dot,
    "kron": kron, "normalize": normalize, "cosine_similarity": cosine_similarity,
    "pairwise_distance": pairwise_distance, "one_hot": one_hot, "prelu": prelu,
    "pixel_shuffle": pixel_shuffle, "pixel_unshuffle": pixel_unshuffle, "margin_ranking_loss": margin_ranking_loss,
    "cosine_embedding_loss": cosine_embedding_loss, "triplet_margin_loss": triplet_margin_loss,
}


# --- metadata: answered on the controller, from the tensor's dtype and shape ----------------------------
def is_floating_point(input: DTensor) -> bool:
    return input.dtype.is_floating_point


def is_complex(input: DTensor) -> bool:
    return input.dtype.is_complex


def is_signed(input: DTensor) -> bool:
    return input.dtype.is_signed


def is_same_size(input: DTensor, other) -> bool:
    return tuple(input.shape) == tuple(other.shape)


def equal(input: DTensor, other) -> bool:
    """torch.equal: the same shape and values. A read (as .item()): the workers compare, and one
    bool comes back."""
    return tuple(input.shape) == tuple(other.shape) and bool(call_op("eq", (input, other), {}).all().item())


def allclose(input: DTensor, other, rtol: float = 1e-05, atol: float = 1e-08, equal_nan: bool = False) -> bool:
    """torch.allclose: a read, like equal."""
    return bool(call_op("isclose", (input, other, rtol, atol, equal_nan), {}).all().item())


def _no_conjugate_view(input: DTensor) -> DTensor:
    """resolve_conj / resolve_neg: dtorch has no lazy conjugate or negative views, so nothing to resolve."""
    return input


_FUNCTIONS.update(is_floating_point=is_floating_point, is_complex=is_complex, is_signed=is_signed,
                  is_same_size=is_same_size, numel=lambda input: input.numel(), equal=equal, allclose=allclose,
                  is_conj=lambda input: False, is_neg=lambda input: False, resolve_conj=_no_conjugate_view,
                  resolve_neg=_no_conjugate_view)

# Attributes torch code asks a tensor (x.is_cuda before a kernel choice, x.nbytes for a budget).
# Global, as every other answer here: nbytes is the logical tensor's, not one shard's.
api.register_methods({
    "is_cuda": property(lambda self: self.device_mesh.device_type == "cuda"),
    "is_cpu": property(lambda self: self.device_mesh.device_type == "cpu"),
    "itemsize": property(lambda self: self.dtype.itemsize),
    "nbytes": property(lambda self: self.numel() * self.dtype.itemsize),
    "layout": property(lambda self: torch.strided),
})


api.register_torch_spellings(_FUNCTIONS)

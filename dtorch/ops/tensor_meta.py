"""PURE: TensorMeta, what the controller knows about a tensor without its data (a DTensor's
`_meta`), interned so the hot path can key caches on one small integer instead of hashing shapes
and placements every call. ("spec" now names only spec.placements, the seed's module path.)"""
from __future__ import annotations

import itertools
import math
import threading
from typing import NamedTuple, cast

import torch

from ..spec.placements import (DeviceMesh, Placement, Shard, distinct_shard_ranks, format_placements,
                               local_shape)
from ..errors import PlacementError, user_site

__all__ = ["TensorMeta", "tensor_meta", "check_placements", "parse_shape", "is_local_tensor", "refuse_unordered"]


class TensorMeta(NamedTuple):
    shape: tuple
    dtype: torch.dtype
    mesh: DeviceMesh
    placements: tuple
    key: int          # unique per (shape, dtype, mesh, placements): the plan cache's key for it
    block_bytes: int  # bytes of one rank's block (the global size over the shard count): what a
                      # dropped symbol holds on each worker until its Free

    def describe(self) -> str:
        return f"{format_placements(self.placements)} shape={tuple(self.shape)} {str(self.dtype)[6:]}"

    def local_shape(self, rank: int) -> tuple:
        found = _local_shapes.get((self.key, rank))   # interned metas: reads ask for the same few
        if found is None:
            found = _local_shapes[self.key, rank] = local_shape(self.shape, self.mesh, self.placements, rank)
        return found

    def senders(self) -> tuple:
        """One rank per distinct shard (distinct_shard_ranks): the ranks a read fetches from."""
        found = _senders.get(self.key)
        if found is None:
            found = _senders[self.key] = distinct_shard_ranks(self.mesh, self.placements)
        return found

    def meta(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device="meta")


_interned: dict[tuple, TensorMeta] = {}
_local_shapes: dict[tuple, tuple] = {}   # (meta key, rank) -> TensorMeta.local_shape
_senders: dict[int, tuple] = {}   # meta key -> TensorMeta.senders
_keys = itertools.count()
_lock = threading.Lock()


def is_local_tensor(value) -> bool:
    """A torch tensor this process holds. A DTensor answers isinstance(x, torch.Tensor) too (as
    torch's DTensor does), so the symbol test comes first: a symbol carries a _meta."""
    return isinstance(value, torch.Tensor) and not hasattr(value, "_meta")


def tensor_meta(shape, dtype: torch.dtype, mesh: DeviceMesh, placements) -> TensorMeta:
    shape, placements = tuple(shape), tuple(placements)
    # meshes over the same ranks are equal whatever their dim names, but a tensor reports the
    # names of the mesh it was placed on ("tp" must not read back as another mesh's "dp")
    identity = (shape, dtype, mesh, mesh.mesh_dim_names, placements)
    found = _interned.get(identity)
    if found is None:
        if dtype.is_complex:
            refuse_unordered(dtype, mesh, placements)
        with _lock:
            found = _interned.setdefault(identity, TensorMeta(shape, dtype, mesh, placements, next(_keys),
                                                               _block_bytes(shape, dtype, mesh, placements)))
    return found


def refuse_unordered(dtype: torch.dtype, mesh: DeviceMesh, placements: tuple, what: str = "") -> None:
    """PlacementError for a complex tensor that is P(max) or P(min), at the call: a rank's part
    of such a tensor is reduced by ordering values, and complex numbers have no order (torch.amax
    refuses them; the workers' collectives would too, comm.reducible). Checked once per distinct
    meta; `what` names the op where the caller knows it."""
    unordered = [p for p in placements if p.is_partial() and p.reduce_op in ("max", "min")]
    if unordered:
        raise PlacementError(f"{what or 'a DTensor'}: a {str(dtype)[6:]} tensor cannot be "
                             f"{format_placements(placements)} on {mesh} at {user_site()}: {unordered[0]!r} keeps "
                             "the largest or smallest part, and "
                             "complex numbers have no order (torch.amax and torch.max refuse complex tensors too). "
                             "Complex tensors take S(d), R, P(sum) and P(avg): order by x.abs() instead, or "
                             "redistribute a real P(max) / P(min) tensor to R before it becomes complex")


def _block_bytes(shape: tuple, dtype: torch.dtype, mesh: DeviceMesh, placements: tuple) -> int:
    shards = math.prod(mesh.shape[dim] for dim, p in enumerate(placements) if p.is_shard())
    return -(-math.prod(shape) * dtype.itemsize // shards)


def check_placements(placements, ndim: int, mesh: DeviceMesh) -> tuple:
    """Validate user-given placements against a tensor rank and a mesh; return them as a tuple."""
    placements = tuple(placements)
    if len(placements) != mesh.ndim:
        raise PlacementError(f"placements {format_placements(placements)} has {len(placements)} entries "
                             f"but {mesh} has {mesh.ndim} dim(s): give one placement per mesh dim")
    for p in placements:
        if not isinstance(p, Placement):
            raise PlacementError(f"{p!r} is not a placement: use Shard(dim), Replicate() or Partial()")
        if p.is_shard() and not -ndim <= cast(Shard, p).dim < ndim:
            raise PlacementError(f"{p!r} names a dim outside a {ndim}-D tensor")
    return tuple([Shard(cast(Shard, p).dim % ndim) if p.is_shard() and cast(Shard, p).dim < 0 else p
                  for p in placements])


def parse_shape(sizes) -> tuple:
    """torch's two spellings of a shape, `f(4, 6)` and `f((4, 6))` (or a list, or a torch.Size),
    as one hashable tuple of ints: `sizes` is the tuple of positional arguments."""
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list, torch.Size)):
        sizes = sizes[0]
    return tuple([int(size) for size in sizes])


def shape_argument(op: str, sizes: tuple, given: dict, keyword: str) -> tuple:
    """parse_shape, plus torch's keyword spelling: reshape(x, shape=(4, 6)), x.view(size=(4, 6))."""
    if set(given) - {keyword} or bool(sizes) == (keyword in given):
        raise TypeError(f"{op}() takes its shape as sizes, as one sequence or as {keyword}=; "
                        f"got {sizes} and keywords {sorted(given)}")
    return parse_shape(sizes or (given[keyword],))

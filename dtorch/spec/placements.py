"""PURE: device meshes, placements and the local-shape arithmetic every other layer shares.

Nothing here imports zmq, asyncio or the runtime. The one exception to "pure" is
`init_device_mesh`, which STARTS worker processes (or grows the pool) when the mesh needs them: it
calls the worker starter that dtorch/__init__.py installs with `set_worker_starter`
(runtime.session.acquire_workers). DeviceMesh itself is pure, so tests build meshes without it.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from collections.abc import Callable, Sequence

from ..errors import MeshError, PlacementError

__all__ = [
    "Placement", "Shard", "Replicate", "Partial", "DeviceMesh", "init_device_mesh", "set_worker_starter",
    "chunk_bounds", "local_shape", "local_offset", "local_region", "format_placements", "nest_ranks", "narrow_to_box",
    "distinct_shard_ranks", "holds_partial_sum_value", "REDUCE_OPS", "ShardRegion", "PeerGroup", "Placements",
]


class Placement:
    """How a tensor lives along ONE mesh dimension."""

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self) -> bool:
        return False


@dataclass(frozen=True)
class Shard(Placement):
    """Tensor dim `dim` is split in torch.chunk order over this mesh dim (uneven tails allowed)."""
    dim: int

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def __repr__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True)
class Replicate(Placement):
    """Every rank along this mesh dim holds the whole tensor."""

    def is_replicate(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "R"


REDUCE_OPS = ("sum", "avg", "max", "min")


@dataclass(frozen=True)
class Partial(Placement):
    """Each rank holds a contribution; the logical value is their reduction by `reduce_op`."""
    reduce_op: str = "sum"

    def __post_init__(self):
        if self.reduce_op not in REDUCE_OPS:
            raise PlacementError(f"Partial(reduce_op={self.reduce_op!r}): legal ops are {REDUCE_OPS}")

    def is_partial(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"P({self.reduce_op})"


def format_placements(placements: Sequence[Placement]) -> str:
    return "[" + ", ".join(map(repr, placements)) + "]"


class Placements(tuple):
    """A DTensor's placements: a tuple that also equals a list of the same placements
    (x.placements == [Shard(0)], as in DTorch); hashes like the tuple."""
    __slots__ = ()

    def __eq__(self, other) -> bool:
        return tuple.__eq__(self, tuple(other) if isinstance(other, list) else other)

    def __ne__(self, other) -> bool:
        return not self == other

    __hash__ = tuple.__hash__


class DeviceMesh:
    """An N-D grid of worker ranks with optional dim names. Pure: it holds rank numbers only."""

    def __init__(self, device_type: str, ranks, mesh_dim_names: Sequence[str] | None = None):
        self.device_type = device_type
        self.shape, self._flat = _flatten_nested(ranks)
        if len(set(self._flat)) != len(self._flat):
            raise MeshError(f"DeviceMesh ranks must be distinct, got {self._flat}")
        names = tuple(mesh_dim_names) if mesh_dim_names else None
        if names is not None and len(names) != len(self.shape):
            raise MeshError(f"mesh_dim_names {names} do not match mesh shape {self.shape}")
        self.mesh_dim_names = names
        self._key = (device_type, self.shape, tuple(self._flat))
        self._hash = hash(self._key)   # meshes key dicts on the per-op path

    # --- identity -------------------------------------------------------------------------
    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, DeviceMesh) and self._key == other._key)

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        names = f", mesh_dim_names={self.mesh_dim_names}" if self.mesh_dim_names else ""
        return f"DeviceMesh('{self.device_type}', shape={self.shape}, ranks={self._flat}{names})"

    # --- geometry -------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    def size(self, mesh_dim: int | str | None = None) -> int:
        if mesh_dim is None:
            return len(self._flat)
        return self.shape[self.dim_index(mesh_dim)]

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(self._flat)

    def dim_index(self, mesh_dim: int | str) -> int:
        if isinstance(mesh_dim, int):
            if not -self.ndim <= mesh_dim < self.ndim:
                raise MeshError(f"mesh dim {mesh_dim} out of range for {self}")
            return mesh_dim % self.ndim
        if not self.mesh_dim_names or mesh_dim not in self.mesh_dim_names:
            raise MeshError(f"no mesh dim named {mesh_dim!r} in {self}")
        return self.mesh_dim_names.index(mesh_dim)

    def coordinate_of(self, rank: int) -> tuple[int, ...]:
        index = self._flat.index(rank)
        coordinate = []
        for extent in reversed(self.shape):
            coordinate.append(index % extent)
            index //= extent
        return tuple(reversed(coordinate))

    def rank_at(self, coordinate: Sequence[int]) -> int:
        index = 0
        for c, extent in zip(coordinate, self.shape):
            index = index * extent + c
        return self._flat[index]

    def group_along(self, rank: int, mesh_dim: int) -> tuple[int, ...]:
        """The ranks that differ from `rank` only along `mesh_dim`, in coordinate order."""
        return self.group_over(rank, (mesh_dim,))

    def group_over(self, rank: int, mesh_dims: Sequence[int]) -> tuple[int, ...]:
        """The ranks that differ from `rank` only along `mesh_dims`, in coordinate order
        (workers ask on every redistribute step: one rank_at per member, no scan of the mesh)."""
        mine = self.coordinate_of(rank)
        ranges = [range(extent) if dim in mesh_dims else (mine[dim],) for dim, extent in enumerate(self.shape)]
        return tuple([self.rank_at(coordinate) for coordinate in itertools.product(*ranges)])

    # --- torch's DeviceMesh API -----------------------------------------------------------
    # Where torch asks "which rank am I?" for the user's own branches (rank-0 logging, saving),
    # the controller answers as the mesh's first rank, coordinate (0, ..., 0): such a branch runs
    # once, as in one process. What torch's per-rank library code needs to build the calling
    # rank's own shard (its coordinate, a process group) has no meaning with a single controller
    # and raises, naming dtorch's call with the same arguments (docs/design/models.md).
    @property
    def mesh(self):
        """The ranks as a torch int tensor of the mesh's shape, as torch's DeviceMesh.mesh."""
        import torch   # here, not at the top: the pure layer is importable without torch
        return torch.tensor(self._flat, dtype=torch.int).reshape(self.shape)

    def get_rank(self) -> int:
        """The rank at coordinate (0, ..., 0): the controller's part in `if mesh.get_rank() == 0:`."""
        return self._flat[0]

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        """0: the controller's coordinate on every mesh dim (see get_rank)."""
        if mesh_dim is None and self.ndim != 1:
            raise MeshError(f"get_local_rank() on {self}: name the mesh dim, as torch requires on an N-D mesh")
        if mesh_dim is not None:
            self.dim_index(mesh_dim)
        return 0

    def get_coordinate(self):
        raise MeshError(_per_rank_refusal("get_coordinate()", self))

    def get_group(self, mesh_dim: int | str | None = None):
        raise MeshError(_per_rank_refusal(f"get_group({'' if mesh_dim is None else repr(mesh_dim)})", self))

    def get_all_groups(self):
        raise MeshError(_per_rank_refusal("get_all_groups()", self))

    @staticmethod
    def from_group(*args, **kwargs):
        raise MeshError("DeviceMesh.from_group(): dtorch's workers have no process group in this process; "
                        "make the mesh with dtorch.init_device_mesh(device_type, shape, mesh_dim_names=...)")

    # --- sub-meshes -----------------------------------------------------------------------
    def __getitem__(self, index) -> DeviceMesh:
        """mesh[i] / mesh[a:b] select along dim 0; mesh["name"] keeps only that dim at index 0
        of the others: on a ("dp", "tp") mesh, mesh["dp"] holds the ranks with tp index 0.
        torch's DeviceMesh answers with the calling rank's own slice instead; a single controller
        has no calling rank. mesh.unbind("tp") gives every "dp" slice, one per tp index."""
        if isinstance(index, str):
            return self._only_dims((self.dim_index(index),))
        if isinstance(index, tuple) and index and all(isinstance(i, str) for i in index):
            return self._only_dims(tuple([self.dim_index(i) for i in index]))
        nested = self._nested()[index]
        names = self.mesh_dim_names
        if isinstance(index, int):
            names = names[1:] if names else None
            if self.ndim == 1:
                nested = [nested]
                names = self.mesh_dim_names
        return DeviceMesh(self.device_type, nested, names)

    def unbind(self, mesh_dim: int | str | Sequence[int | str] | None = None, *,
               dims: int | str | Sequence[int | str] | None = None) -> list[DeviceMesh]:
        """One sub-mesh per index of `mesh_dim` (e.g. one per pipeline stage). Several dims
        (a list, or DTorch's dims=[...]) give one sub-mesh per combination of their indices, in
        row-major order, each over the dims not listed."""
        given = dims if mesh_dim is None else mesh_dim
        if given is None:
            raise MeshError("unbind needs the mesh dim(s) to split along: mesh.unbind('pp') or dims=[...]")
        listed = sorted({self.dim_index(d) for d in ([given] if isinstance(given, (int, str)) else given)})
        kept = [d for d in range(self.ndim) if d not in listed]
        names = tuple([self.mesh_dim_names[d] for d in kept]) if self.mesh_dim_names and kept else None
        shape = tuple([self.shape[d] for d in kept]) or (1,)
        out = []
        for index in itertools.product(*[range(self.shape[d]) for d in listed]):
            ranks = [r for r in self._flat if tuple([self.coordinate_of(r)[d] for d in listed]) == index]
            out.append(DeviceMesh(self.device_type, nest_ranks(ranks, shape), names))
        return out

    def _only_dims(self, dims: tuple[int, ...]) -> DeviceMesh:
        """The sub-mesh over `dims` (torch's order: as they are in this mesh) at index 0 of the rest."""
        if list(dims) != sorted(set(dims)):
            raise MeshError(f"mesh[{self._names_of(dims)}]: name the dims in the mesh's order, once each "
                            f"({self.mesh_dim_names}), as torch requires")
        ranks = [r for r in self._flat if all(c == 0 for i, c in enumerate(self.coordinate_of(r)) if i not in dims)]
        names = self._names_of(dims) if self.mesh_dim_names else None
        return DeviceMesh(self.device_type, nest_ranks(ranks, [self.shape[d] for d in dims]), names)

    def _names_of(self, dims: Sequence[int]) -> tuple:
        return tuple([self.mesh_dim_names[d] for d in dims]) if self.mesh_dim_names else tuple(dims)

    def _nested(self):
        return nest_ranks(self._flat, self.shape)


def _per_rank_refusal(call: str, mesh: DeviceMesh) -> str:
    return (f"DeviceMesh.{call} on {mesh}: this process is the single controller, no rank of the mesh and "
            "no member of a process group, so torch.distributed.tensor's per-rank code (distribute_tensor, "
            "distribute_module, parallelize_module, DTensor.from_local), which builds the calling rank's own "
            "shard, cannot run on a dtorch mesh. Write dtorch's calls with the same arguments: "
            "dtorch.distribute_tensor(t, mesh, placements), dtorch.distribute_module(model, mesh, ...), "
            "dtorch.nn.parallelize_module(model, mesh, plan) (which takes torch's ColwiseParallel, "
            "RowwiseParallel, SequenceParallel, PrepareModuleInput/Output plans as they are); a collective "
            "of your own is x.redistribute(placements=...)")


def _flatten_nested(ranks) -> tuple[tuple[int, ...], list[int]]:
    if hasattr(ranks, "tolist"):
        ranks = ranks.tolist()
    if isinstance(ranks, int):
        return (), [ranks]
    shape, flat = None, []
    for item in ranks:
        sub_shape, sub_flat = _flatten_nested(item)
        if shape is not None and sub_shape != shape:
            raise MeshError(f"ragged DeviceMesh ranks: {ranks}")
        shape = sub_shape
        flat += sub_flat
    return (len(ranks),) + (shape or ()), flat


def nest_ranks(flat: Sequence[int], shape: Sequence[int]) -> list:
    """Flat ranks as nested lists of `shape` (row-major), the form DeviceMesh takes."""
    if len(shape) <= 1:
        return list(flat)
    step = len(flat) // shape[0]
    return [nest_ranks(flat[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]


# --- starting workers: this module's one seam to the runtime ------------------------------------
# (device_type, count) -> ranks of running workers, starting or growing the pool as needed.
_start_workers: Callable[[str, int], Sequence[int]] | None = None


def set_worker_starter(start_workers: Callable[[str, int], Sequence[int]] | None) -> None:
    """Install what init_device_mesh calls to start workers (dtorch/__init__.py installs
    runtime.session.acquire_workers; a test may install a fake)."""
    global _start_workers
    _start_workers = start_workers


def init_device_mesh(device_type: str, mesh_shape: int | Sequence[int],
                     mesh_dim_names: Sequence[str] | None = None) -> DeviceMesh:
    """Make a mesh over running workers. Not pure: the first mesh STARTS worker processes and a
    larger one grows the local pool, through the installed worker starter."""
    given = tuple(mesh_shape) if isinstance(mesh_shape, (tuple, list)) else (mesh_shape,)
    # an integral value of any type (numpy's, a torch scalar) is a size; 2.7 is refused, not cut to 2
    if not given or any(isinstance(s, bool) or not hasattr(s, "__index__") or s < 1 for s in given):
        raise MeshError(f"init_device_mesh: mesh_shape must be positive integers, got {mesh_shape!r}")
    mesh_shape = tuple([s.__index__() for s in given])
    if _start_workers is None:
        raise MeshError("no dtorch runtime is installed: `import dtorch` first")
    ranks = list(_start_workers(device_type, math.prod(mesh_shape)))
    return DeviceMesh(device_type, nest_ranks(ranks, mesh_shape), mesh_dim_names)


# --- local shape arithmetic ------------------------------------------------------------------
def chunk_bounds(size: int, parts: int, index: int) -> tuple[int, int]:
    """(start, length) of chunk `index` when `size` is split torch.chunk-style into `parts`."""
    chunk = -(-size // parts) if size else 0
    start = min(chunk * index, size)
    return start, max(0, min(chunk, size - start))


class ShardRegion:
    """An op argument meaning "where this rank's block of a (shape, placements) tensor sits": a rule
    puts one in a kernel's keyword arguments, and each rank (a worker, or the rule simulator)
    replaces it with its own (offset, shape) from local_region. It travels as its own msgpack
    extension type, so a kernel's kwargs carry no magic names. (Not a tuple: msgpack would pack a
    tuple subclass as a plain array.)"""
    __slots__ = ("shape", "placements")

    def __init__(self, shape: Sequence[int], placements: Sequence[Placement]):
        self.shape, self.placements = tuple(shape), tuple(placements)

    def at(self, mesh: DeviceMesh, coordinate: Sequence[int]) -> tuple[list[int], list[int]]:
        return local_region(self.shape, mesh, self.placements, coordinate)

    def __eq__(self, other) -> bool:
        return type(other) is ShardRegion and (other.shape, other.placements) == (self.shape, self.placements)

    def __hash__(self) -> int:
        return hash((ShardRegion, self.shape, self.placements))

    def __repr__(self) -> str:
        return f"ShardRegion({self.shape}, {format_placements(self.placements)})"


class PeerGroup:
    """An op argument meaning "the ranks along one mesh dim, and where each of them holds its
    block of some tensors": a kernel that exchanges data with its peers (ring attention) takes
    one. Each rank (a worker, or the rule simulator) replaces it with a peers object: its
    `index` and `size` along the dim, `blocks[i][member]` = (offset, shape) of layout i at each
    member, and `pass_along(payload, incoming)`, which sends `payload` to the next member and
    returns the `incoming` elements the previous one sent. Its own msgpack extension type."""
    __slots__ = ("mesh_dim", "layouts")

    def __init__(self, mesh_dim: int, layouts: Sequence[ShardRegion] = ()):
        self.mesh_dim, self.layouts = int(mesh_dim), tuple(layouts)

    def blocks(self, mesh: DeviceMesh, coordinate: Sequence[int]) -> list[list[tuple]]:
        """For each layout, every member's (offset, shape), members in order along the dim."""
        members = []
        for member in range(mesh.shape[self.mesh_dim]):
            at = list(coordinate)
            at[self.mesh_dim] = member
            members.append(at)
        return [[tuple(layout.at(mesh, at)) for at in members] for layout in self.layouts]

    def __eq__(self, other) -> bool:
        return type(other) is PeerGroup and (other.mesh_dim, other.layouts) == (self.mesh_dim, self.layouts)

    def __hash__(self) -> int:
        return hash((PeerGroup, self.mesh_dim, self.layouts))

    def __repr__(self) -> str:
        return f"PeerGroup(mesh dim {self.mesh_dim}, {list(self.layouts)})"


def local_region(global_shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement],
                 coordinate: Sequence[int]) -> tuple[list[int], list[int]]:
    """(offset, shape) of the block of the global tensor held at `coordinate` of `mesh`.

    Mesh dims apply in order, so sharding one tensor dim over two mesh dims nests: the second
    mesh dim splits the chunk the first one produced."""
    offset, shape = [0] * len(global_shape), list(global_shape)
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            start, length = chunk_bounds(shape[placement.dim], mesh.shape[mesh_dim], coordinate[mesh_dim])
            offset[placement.dim] += start
            shape[placement.dim] = length
    return offset, shape


def local_shape(global_shape, mesh: DeviceMesh, placements, rank: int) -> tuple[int, ...]:
    return tuple(local_region(global_shape, mesh, placements, mesh.coordinate_of(rank))[1])


def local_offset(global_shape, mesh: DeviceMesh, placements, rank: int) -> tuple[int, ...]:
    return tuple(local_region(global_shape, mesh, placements, mesh.coordinate_of(rank))[0])


def narrow_to_box(tensor, offset: Sequence[int], shape: Sequence[int], origin: Sequence[int] | None = None):
    """The view of `tensor` covering the global box (offset, shape); `tensor` holds the block
    that starts at global `origin` (default: it is the whole tensor)."""
    origin = origin or (0,) * len(offset)
    for dim, (start, held_start, length) in enumerate(zip(offset, origin, shape)):
        tensor = tensor.narrow(dim, start - held_start, length)
    return tensor


def distinct_shard_ranks(mesh: DeviceMesh, placements: Sequence[Placement]) -> tuple[int, ...]:
    """One rank per distinct shard: coordinate 0 on every mesh dim that does not shard. Reads
    fetch from these ranks only, and moves between meshes send from them."""
    return tuple([r for r in mesh.ranks
                 if all(c == 0 for c, p in zip(mesh.coordinate_of(r), placements) if p == Replicate())])


def holds_partial_sum_value(placements: Sequence[Placement], coordinate: Sequence[int]) -> bool:
    """Where a tensor made whole (a factory, an upload) is placed P(sum), the value lives on
    coordinate 0 of each P(sum) mesh dim and every other coordinate holds zeros: False there."""
    return all(c == 0 for c, p in zip(coordinate, placements) if isinstance(p, Partial) and p.reduce_op == "sum")

"""PURE: ranks simulated on this CPU, for the validator and the docs: no worker processes.

Each rank's local inputs are cut with the same local-shape math the workers use
(placements.local_region); Partial inputs are split into random contributions, including
the awkward ones real programs make (-inf in a max from an empty shard, nan only as inf + -inf);
each rank runs the same kernel the workers would (registry.KERNELS); `matches` reads the ranks'
results back through output placements the way a read or redistribute would.
"""
from __future__ import annotations

import itertools
import math
import queue
import threading
import warnings

import torch

from ...spec.placements import (REDUCE_OPS, DeviceMesh, Partial, PeerGroup, Placement, Replicate, Shard, ShardRegion,
                                local_region, narrow_to_box, nest_ranks)
from ..dispatch import map_tensors
from .samples import Sample

__all__ = ["placement_options", "tensor_inputs", "with_inputs", "Symbol", "split_partial", "contributions",
           "matches", "run_ranks", "small_mesh", "map_torch", "as_tuple"]


# --- the placements an input may take on one mesh dim ----------------------------------------------
def placement_options(value: torch.Tensor, partial_ops=REDUCE_OPS) -> list:
    options: list[Placement] = [Replicate()] + [Shard(d) for d in range(value.dim())]
    for op in partial_ops:
        if op in ("sum", "avg") and value.dtype == torch.bool:
            continue      # a sum of booleans is not a boolean
        if op == "avg" and not value.dtype.is_floating_point:
            continue      # an integer average would truncate
        options.append(Partial(op))
    return options


def tensor_inputs(sample: Sample) -> list[torch.Tensor]:
    """The sample's tensors in the order dispatch numbers them (args, then kwargs, depth-first)."""
    found: list[torch.Tensor] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        found.append(t)
        return t
    map_torch((sample.args, sample.kwargs), keep)
    return found


def with_inputs(sample: Sample, replacements: list) -> tuple[tuple, dict]:
    """The sample's args and kwargs with its tensors replaced, in tensor_inputs order."""
    it = iter(replacements)
    args, kwargs = map_torch((sample.args, sample.kwargs), lambda t: next(it))
    return args, kwargs


def map_torch(value, fn):
    """map_tensors over plain torch tensors (the samples' inputs)."""
    return map_tensors(value, fn, lambda v: isinstance(v, torch.Tensor))


class Symbol:
    """What plan_call sees of a DTensor."""
    __slots__ = ("_meta",)

    def __init__(self, spec):
        self._meta = spec


# --- Partial contributions and their reduction ----------------------------------------------------
def split_partial(value: torch.Tensor, parts: int, op: str, g: torch.Generator) -> list[torch.Tensor]:
    """Random contributions whose reduction by `op` is `value` (up to rounding for floats), with
    the awkward ones real programs make: -inf in a max (an empty shard), inf + -inf for nan."""
    def noise():
        if value.dtype.is_floating_point:   # scales from 0 to 4: near the value and far from it
            scale = 4 * torch.rand(value.shape, generator=g)
            return (scale * torch.randn(value.shape, generator=g)).to(value.dtype)
        if value.dtype == torch.bool:
            return torch.rand(value.shape, generator=g) > 0.5
        return torch.randint(0, 4, value.shape, generator=g, dtype=value.dtype)
    if op == "sum":
        pieces = [noise() for _ in range(parts - 1)]
        return _non_finite(pieces + [value - sum(pieces, torch.zeros_like(value))], value)
    if op == "avg":
        pieces = [noise() for _ in range(parts)]
        center = sum(pieces, torch.zeros_like(value)) / parts
        return _non_finite([value + p - center for p in pieces], value)
    owner = torch.randint(0, parts, value.shape, generator=g)
    return [torch.where(owner == i, value, _away(value, noise(), op, torch.rand(value.shape, generator=g)))
            for i in range(parts)]


def _non_finite(pieces, value):
    """inf from one contribution alone; nan only the hard way, inf + -inf."""
    if len(pieces) < 2 or not value.dtype.is_floating_point:
        return pieces
    nan, inf = value.isnan(), value.isinf()
    pieces = [torch.where(nan | inf, 0.0, p).to(value.dtype) for p in pieces]
    pieces[0] = torch.where(nan, math.inf, torch.where(inf, value, pieces[0]))
    pieces[1] = torch.where(nan, -math.inf, pieces[1])
    return pieces


def _away(value, noise, op, chance):
    """A value no greater (max) / no smaller (min) than `value`; sometimes the very extreme
    (-inf, or an integer type's minimum: what an empty shard's max holds), sometimes 0."""
    if value.dtype == torch.bool:   # mostly the opposite: one rank alone tends to decide
        return value & (chance < 0.2) if op == "max" else value | (chance > 0.2)
    if value.dtype.is_floating_point:
        bound = -math.inf if op == "max" else math.inf
        moved = value - noise.abs() if op == "max" else value + noise.abs()
        moved = torch.where(moved.isfinite() | (value == bound), moved, noise)   # nothing below -inf
    else:
        bound = torch.iinfo(value.dtype).min if op == "max" else torch.iinfo(value.dtype).max
        moved = value - noise if op == "max" else value + noise
        moved = torch.where((moved <= value) == (op == "max"), moved, value)     # no wrap-around
    zero_fits = (value >= 0) if op == "max" else (value <= 0)
    moved = torch.where((chance < 0.1) & zero_fits, torch.zeros_like(value), moved)
    return torch.where(chance > 0.8, torch.full_like(value, bound), moved)


def _reduce(values: list, op: str) -> torch.Tensor:
    stacked = torch.stack(values)
    if op == "sum":
        return stacked.sum(0, dtype=stacked.dtype)
    if op == "avg":
        return stacked.sum(0, dtype=stacked.dtype) / len(values)
    return stacked.amax(0) if op == "max" else stacked.amin(0)


def _groups(mesh: DeviceMesh, mesh_dim: int):
    """Coordinates that differ only along mesh_dim, group by group."""
    others = [range(n) if m != mesh_dim else [0] for m, n in enumerate(mesh.shape)]
    for base in itertools.product(*others):
        yield [base[:mesh_dim] + (i,) + base[mesh_dim + 1:] for i in range(mesh.shape[mesh_dim])]


def contributions(value, mesh: DeviceMesh, placements, g, split=None) -> dict:
    """Each coordinate's full-size contribution: reduced in mesh-dim order they give `value`.
    Contributions depend on the Partial dims' coordinates only: along R or S dims they repeat.
    `split` replaces split_partial (same arguments)."""
    split = split or split_partial
    partial_dims = [m for m, p in enumerate(placements) if isinstance(p, Partial)]
    held = {c: value for c in itertools.product(*map(range, mesh.shape))}
    for mesh_dim in reversed(partial_dims):   # the last reduction splits first
        splits = {}
        for group in _groups(mesh, mesh_dim):
            key = tuple([group[0][m] for m in partial_dims if m != mesh_dim])
            if key not in splits:
                splits[key] = split(held[group[0]], len(group), placements[mesh_dim].reduce_op, g)
            held.update(zip(group, splits[key]))
    return held


def matches(held: dict, mesh: DeviceMesh, placements, expected: torch.Tensor, exact=False) -> bool:
    """Would the ranks' local values, read through `placements`, give `expected`? Every rank
    must agree (a replica that differs would poison later ops even if a read looked right)."""
    held = dict(held)
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Partial):
            for group in _groups(mesh, mesh_dim):
                if len({tuple(held[c].shape) for c in group}) != 1:
                    return False
                reduced = _reduce([held[c] for c in group], p.reduce_op)
                held.update((c, reduced) for c in group)
    for coordinate, value in held.items():
        offset, shape = local_region(expected.shape, mesh, placements, coordinate)
        if tuple(value.shape) != tuple(shape) or value.dtype != expected.dtype:
            return False
        if not _close(value, narrow_to_box(expected, offset, shape), exact):
            return False
    return True


def _close(actual, expected, exact) -> bool:
    if exact or not expected.dtype.is_floating_point:
        return torch.equal(actual, expected)
    rtol = 1e-2 if expected.dtype in (torch.float16, torch.bfloat16) else 1e-4
    finite = expected[expected.isfinite()].double()
    scale = finite.abs().max().item() if finite.numel() else 1.0
    # atol relative to the output's own scale: a product of 35 normals is 1e-10 everywhere
    return torch.allclose(actual.double(), expected.double(), rtol=rtol, atol=rtol * 0.1 * scale, equal_nan=True)


def run_ranks(kernel, sample, values, held, placements, mesh, extra) -> dict:
    """Each coordinate's outputs: its blocks of the inputs through the kernel, as a worker would.
    A kernel that exchanges data with its peers (a PeerGroup argument) runs on every coordinate
    at once, one thread each, its exchanges carried by queues."""
    coordinates = list(itertools.product(*map(range, mesh.shape)))
    mailboxes: dict[tuple, queue.Queue] = {c: queue.Queue() for c in coordinates}
    results = {}

    def run(coordinate) -> None:
        blocks = [narrow_to_box(h[coordinate], *local_region(v.shape, mesh, p, coordinate))
                  for v, h, p in zip(values, held, placements)]
        args, kwargs = with_inputs(sample, blocks)
        args, kwargs = _as_wire(args), {**_as_wire(kwargs), **extra}
        kwargs = {k: _rank_local(v, mesh, coordinate, mailboxes) for k, v in kwargs.items()}
        with warnings.catch_warnings():   # torch's warnings about tiny shards say nothing about rules
            warnings.simplefilter("ignore")
            results[coordinate] = as_tuple(kernel(*args, **kwargs))
    if not any(type(v) is PeerGroup for v in extra.values()):
        for coordinate in coordinates:
            run(coordinate)
        return results
    failures = []

    def run_or_record(coordinate) -> None:
        try:
            run(coordinate)
        except Exception as error:  # noqa: BLE001 -- re-raised below, on the caller's thread
            failures.append(error)
    threads = [threading.Thread(target=run_or_record, args=(c,), daemon=True) for c in coordinates]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    if failures or any(t.is_alive() for t in threads):
        raise failures[0] if failures else TimeoutError("simulated peers did not finish their exchanges")
    return results


def _rank_local(value, mesh, coordinate, mailboxes):
    """What a worker substitutes for a ShardRegion or a PeerGroup, at `coordinate`."""
    if type(value) is ShardRegion:
        return value.at(mesh, coordinate)
    if type(value) is PeerGroup:
        return SimulatedPeers(value, mesh, coordinate, mailboxes)
    return value


class SimulatedPeers:
    """runtime.peers.Peers over in-process queues: each coordinate has a mailbox; pass_along
    posts to the next member's and takes from its own (FIFO per sender suffices: one sender)."""

    def __init__(self, group: PeerGroup, mesh, coordinate, mailboxes):
        self.index, self.size = coordinate[group.mesh_dim], mesh.shape[group.mesh_dim]
        self.blocks = group.blocks(mesh, coordinate)
        following = list(coordinate)
        following[group.mesh_dim] = (self.index + 1) % self.size
        self._mine, self._next = mailboxes[tuple(coordinate)], mailboxes[tuple(following)]

    def pass_along(self, payload: torch.Tensor, incoming: int) -> torch.Tensor:
        self._next.put(payload.clone())
        received = self._mine.get(timeout=30)
        assert received.numel() == incoming, (received.numel(), incoming)
        return received


def _as_wire(value):
    """Sequences arrive on a worker as lists (msgpack, then the worker's reference mapping)."""
    if type(value) in (list, tuple):
        return [_as_wire(v) for v in value]
    if type(value) is dict:
        return {k: _as_wire(v) for k, v in value.items()}
    return value


def as_tuple(result) -> tuple:
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


def small_mesh(shape) -> DeviceMesh:
    """A mesh of ranks 0..n-1 in the given shape: pure, no workers behind it."""
    return DeviceMesh("cpu", nest_ranks(list(range(math.prod(shape))), list(shape)))

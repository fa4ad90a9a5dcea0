"""Brute-force check of placement rules against torch: `python -m dtorch.ops.validate --op add`
(or `--all`, `--family nn`, `--mesh 2,2`).

For every sample call of an op (dtorch/ops/samples.py) and every combination of input
placements on a small mesh (R, S(d) for each dim, P(sum|avg|max|min)), it plans the call the
way the controller does, then SIMULATES the ranks on this CPU: each rank's local inputs are
cut with the same local-shape math the workers use (distributed_spec.local_region), Partial
inputs are genuinely split into random contributions, and the rank runs the same kernel from
`registry.KERNELS`. It reports:
  WRONG    the rule accepted the combination but the ranks' results, read back through the
           output placements, differ from torch on the whole tensors (or a kernel raised);
  MISSING  the rule rejected the combination, yet running the op's kernel on the local inputs
           as given produces, for some output placement, exactly torch's result.
No worker processes: a simulation gives the same answers as real workers for what a rule
decides (tests/test_ops_sweep.py runs the real runtime) and is fast enough to be exhaustive.
"""
from __future__ import annotations

import argparse
import itertools
import math
import sys
from typing import NamedTuple

import torch

from ..distributed_spec import DeviceMesh, Partial, Replicate, Shard, format_placements, local_region
from ..errors import PlacementError
from .dispatch import plan_call
from .registry import KERNELS, REGISTRY, OpSpec
from .samples import SAMPLED_FAMILIES, Sample, samples
from .spec import tensor_spec

__all__ = ["validate", "Finding", "placement_options", "tensor_inputs", "with_inputs", "split_partial"]

PARTIAL_OPS = ("sum", "avg", "max", "min")
CONFIRMING_DRAWS = 2


# MISSING findings a rule declines on purpose, by (op, input placements): the reason is printed.
DECLINED = {
    ("mul", "[P(max)]"): "x * c keeps order only for c > 0, and plans key scalars by type, not value",
    ("mul", "[P(min)]"): "x * c keeps order only for c > 0, and plans key scalars by type, not value",
    ("div", "[P(max)]"): "x / c keeps order only for c > 0, and plans key scalars by type, not value",
    ("div", "[P(min)]"): "x / c keeps order only for c > 0, and plans key scalars by type, not value",
    ("isfinite", "[P(sum)]"): "finite contributions can overflow to inf when summed",
    ("isfinite", "[P(avg)]"): "finite contributions can overflow to inf when summed",
    ("isnan", "[P(max)]"): "Gloo's max/min do not propagate nan, so isnan cannot be pushed through them",
    ("isnan", "[P(min)]"): "Gloo's max/min do not propagate nan, so isnan cannot be pushed through them",
    ("to_dtype", "[P(sum)]"): "rounding every contribution to a narrower dtype loses more than rounding the sum",
    ("to_dtype", "[P(avg)]"): "rounding every contribution to a narrower dtype loses more than rounding the sum",
    ("to_dtype", "[P(max)]"): "float -> int of an empty shard's -inf is undefined behaviour",
}


class Finding(NamedTuple):
    kind: str          # "WRONG", "MISSING", or "DECLINED" (a MISSING listed in DECLINED)
    op: str
    placements: tuple  # per tensor input, N-D
    detail: str

    def __str__(self) -> str:
        given = ", ".join(map(format_placements, self.placements))
        return f"{self.kind:8} {self.op}({given}): {self.detail}"


# --- the placements an input may take on one mesh dim ----------------------------------------------
def placement_options(value: torch.Tensor, partial_ops=PARTIAL_OPS) -> list:
    options = [Replicate()] + [Shard(d) for d in range(value.dim())]
    for op in partial_ops:
        if op in ("sum", "avg") and value.dtype == torch.bool:
            continue      # a sum of booleans is not a boolean
        if op == "avg" and not value.dtype.is_floating_point:
            continue      # an integer average would truncate
        options.append(Partial(op))
    return options


def tensor_inputs(sample: Sample) -> list[torch.Tensor]:
    """The sample's tensors in the order dispatch numbers them (args, then kwargs, depth-first)."""
    found = []
    _map_torch((sample.args, sample.kwargs), lambda t: found.append(t) or t)
    return found


def with_inputs(sample: Sample, replacements: list) -> tuple[tuple, dict]:
    """The sample's args and kwargs with its tensors replaced, in tensor_inputs order."""
    it = iter(replacements)
    args, kwargs = _map_torch((sample.args, sample.kwargs), lambda t: next(it))
    return args, kwargs


def _map_torch(value, fn):
    if isinstance(value, torch.Tensor):
        return fn(value)
    if type(value) in (list, tuple):
        return type(value)(_map_torch(v, fn) for v in value)
    if type(value) is dict:
        return {k: _map_torch(v, fn) for k, v in value.items()}
    return value


class _Symbol:
    """What plan_call sees of a DTensor."""
    __slots__ = ("_spec",)

    def __init__(self, spec):
        self._spec = spec


# --- Partial contributions and their reduction ----------------------------------------------------
def split_partial(value: torch.Tensor, parts: int, op: str, g: torch.Generator) -> list[torch.Tensor]:
    """Random contributions whose reduction by `op` is `value` (up to rounding for floats), with
    the awkward ones real programs make: -inf in a max (an empty shard), inf + -inf for nan."""
    def noise():
        if value.dtype.is_floating_point:
            return torch.randn(value.shape, generator=g).to(value.dtype)
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
    if value.dtype == torch.bool:
        return value & noise if op == "max" else value | noise
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


def contributions(value, mesh: DeviceMesh, placements, g) -> dict:
    """Each coordinate's full-size contribution: reduced in mesh-dim order they give `value`."""
    held = {c: value for c in itertools.product(*map(range, mesh.shape))}
    for mesh_dim in reversed(range(mesh.ndim)):   # the last reduction splits first
        if isinstance(placements[mesh_dim], Partial):
            for group in _groups(mesh, mesh_dim):
                parts = split_partial(held[group[0]], len(group), placements[mesh_dim].reduce_op, g)
                held.update(zip(group, parts))
    return held


def _block(tensor, offset, shape):
    for dim, (start, length) in enumerate(zip(offset, shape)):
        tensor = tensor.narrow(dim, start, length)
    return tensor


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
        if not _close(value, _block(expected, offset, shape), exact):
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


# --- one op -----------------------------------------------------------------------------------------
class Stats(NamedTuple):
    combinations: int = 0
    accepted: int = 0
    refused: int = 0      # raised something other than PlacementError (e.g. UnsupportedOpError)


def validate(op: OpSpec | str, mesh_shape=(3,), uneven: bool = True, seed: int = 0) -> tuple[Stats, list]:
    """Every sample of `op`, every input placement combination on a mesh of `mesh_shape`."""
    op = REGISTRY[op] if isinstance(op, str) else op
    mesh = DeviceMesh("cpu", _nested(list(range(_count(mesh_shape))), list(mesh_shape)))
    totals, findings = [0, 0, 0], []
    for number, sample in enumerate(samples(op.name, uneven, seed)):
        draw = _Draw(op, sample, mesh, seed)
        # A MISSING candidate must survive more independent draws: one draw can fit by chance.
        again = [lambda k=k: _Draw(op, samples(op.name, uneven, seed + k)[number], mesh, seed + k)
                 for k in range(1, CONFIRMING_DRAWS + 1)]
        options = [list(itertools.product(placement_options(v), repeat=mesh.ndim)) for v in draw.values]
        for combo in itertools.product(*options):
            outcome, finding = _check(op, draw, combo, again)
            totals[0] += 1
            totals[1] += outcome == "accepted"
            totals[2] += outcome == "refused"
            if finding is not None:
                findings.append(finding._replace(detail=f"sample {number}: {finding.detail}"))
    return Stats(*totals), findings


class _Draw:
    """One sample's whole tensors, torch's results on them, and their rank contributions."""

    def __init__(self, op: OpSpec, sample: Sample, mesh: DeviceMesh, seed: int):
        self.sample, self.mesh = sample, mesh
        self.values = tensor_inputs(sample)
        self.expected = _as_tuple(op.torch_fn(*sample.args, **sample.kwargs))
        self._g = torch.Generator().manual_seed(seed + 104729)   # a stream apart from the sample's
        self._held: dict = {}

    def held(self, combo) -> list:
        for key in enumerate(combo):
            if key not in self._held:
                index, placements = key
                self._held[key] = contributions(self.values[index], self.mesh, placements, self._g)
        return [self._held[key] for key in enumerate(combo)]


def _check(op, draw: _Draw, combo, again):
    specs = [tensor_spec(v.shape, v.dtype, draw.mesh, p) for v, p in zip(draw.values, combo)]
    args, kwargs = with_inputs(draw.sample, [_Symbol(s) for s in specs])
    try:
        plan = plan_call(op, args, kwargs, specs)
    except PlacementError:
        return "rejected", _missing(op, draw, combo, again)
    except Exception:   # noqa: BLE001  (UnsupportedOpError and the like: refused on purpose)
        return "refused", None
    required = [_after_steps(combo[i], plan.input_steps, i) for i in range(len(combo))]
    try:
        ranks = _run_ranks(KERNELS[plan.kernel], draw.sample, draw.values, draw.held(combo), required,
                           draw.mesh, plan.extra_kwargs)
    except Exception as error:  # noqa: BLE001  (a kernel failing on a shard is a wrong rule)
        return "accepted", Finding("WRONG", op.name, combo, f"a rank's kernel raised {error!r}")
    for i, (spec, want) in enumerate(zip(plan.out_specs, draw.expected)):
        if not matches({c: out[i] for c, out in ranks.items()}, draw.mesh, spec.placements, want):
            return "accepted", Finding("WRONG", op.name, combo,
                                       f"output {i} as {format_placements(spec.placements)} differs from torch")
    return "accepted", None


def _missing(op, draw: _Draw, combo, again):
    fits = _fitting(op, draw, combo, None)
    for next_draw in again:
        if fits is None:
            return None
        fits = _fitting(op, next_draw(), combo, fits)
    if fits is None:
        return None
    found = ", ".join(format_placements(candidates[0]) for candidates in fits)
    reason = DECLINED.get((op.name, ", ".join(map(format_placements, combo))))
    if reason is not None:
        return Finding("DECLINED", op.name, combo, f"would read as {found}; declined: {reason}")
    return Finding("MISSING", op.name, combo, "rejected, but the local results read as " + found)


def _fitting(op, draw: _Draw, combo, among):
    """Per output, the placements under which the ranks' results (the op's kernel on the inputs
    as given) read as torch's; None when some output has none. `among`: candidates to keep."""
    try:
        ranks = _run_ranks(KERNELS[op.name], draw.sample, draw.values, draw.held(combo), combo, draw.mesh, {})
    except Exception:  # noqa: BLE001  (the kernel cannot even run on these shards)
        return None
    fits = []
    for i, want in enumerate(draw.expected):
        outs = {c: out[i] for c, out in ranks.items() if i < len(out)}
        if len(outs) != len(ranks):
            return None
        candidates = among[i] if among is not None else list(_candidates(want, draw.mesh))
        fitting = [p for p in candidates if matches(outs, draw.mesh, p, want)]
        if not fitting:
            return None
        fits.append(fitting)
    return fits


def _candidates(value: torch.Tensor, mesh: DeviceMesh):
    return itertools.product(placement_options(value), repeat=mesh.ndim)


def _after_steps(placements, input_steps, index) -> tuple:
    current = list(placements)
    for i, _, _, steps in input_steps:
        if i == index:
            for mesh_dim, _, after in steps:
                current[mesh_dim] = after
    return tuple(current)


def _run_ranks(kernel, sample, values, held, placements, mesh, extra) -> dict:
    """Each coordinate's outputs: its blocks of the inputs through the kernel, as a worker would."""
    results = {}
    for coordinate in itertools.product(*map(range, mesh.shape)):
        blocks = [_block(h[coordinate], *local_region(v.shape, mesh, p, coordinate))
                  for v, h, p in zip(values, held, placements)]
        args, kwargs = with_inputs(sample, blocks)
        args, kwargs = _as_wire(args), {**_as_wire(kwargs), **extra}
        if "_dtorch_region" in kwargs:
            shape, region_placements = kwargs["_dtorch_region"]
            kwargs["_dtorch_region"] = local_region(shape, mesh, region_placements, coordinate)
        results[coordinate] = _as_tuple(kernel(*args, **kwargs))
    return results


def _as_wire(value):
    """Sequences arrive on a worker as lists (msgpack, then the worker's reference mapping)."""
    if type(value) in (list, tuple):
        return [_as_wire(v) for v in value]
    if type(value) is dict:
        return {k: _as_wire(v) for k, v in value.items()}
    return value


def _as_tuple(result) -> tuple:
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


def _count(shape) -> int:
    total = 1
    for n in shape:
        total *= n
    return total


def _nested(flat, shape):
    if len(shape) <= 1:
        return flat
    step = len(flat) // shape[0]
    return [_nested(flat[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]


# --- command line -----------------------------------------------------------------------------------
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtorch.ops.validate", description=__doc__.split("\n")[0])
    parser.add_argument("--op", action="append", default=[], help="an op name (repeatable)")
    parser.add_argument("--all", action="store_true", help=f"every op of {', '.join(SAMPLED_FAMILIES)}")
    parser.add_argument("--family", action="append", default=[], help="every op of one family")
    parser.add_argument("--mesh", default="3", help="mesh shape, e.g. 3 or 2,2 (default 3: uneven splits)")
    parser.add_argument("--even", action="store_true", help="inputs that divide evenly (default: uneven)")
    parser.add_argument("--show", type=int, default=5, help="findings listed per op and kind")
    options = parser.parse_args(argv)
    families = SAMPLED_FAMILIES if options.all else tuple(options.family)
    names = options.op + sorted(n for n, s in REGISTRY.items() if s.family in families)
    if not names:
        parser.error("name ops with --op, --family or --all")
    mesh_shape = tuple(int(n) for n in options.mesh.split(","))
    wrong = 0
    for name in names:
        if name not in REGISTRY:
            parser.error(f"no op {name!r}")
        stats, findings = validate(name, mesh_shape, uneven=not options.even)
        wrong += _report(name, stats, findings, options.show)
    print(f"{len(names)} op(s) on mesh {mesh_shape}: {wrong} wrong rule(s)")
    return 1 if wrong else 0


def _report(name, stats, findings, show) -> int:
    counts = {kind: [f for f in findings if f.kind == kind] for kind in ("WRONG", "MISSING", "DECLINED")}
    print(f"{name}: {stats.combinations} combinations, {stats.accepted} accepted, {stats.refused} refused, "
          f"{len(counts['WRONG'])} wrong, {len(counts['MISSING'])} missing, {len(counts['DECLINED'])} declined")
    for kind in ("WRONG", "MISSING", "DECLINED"):
        for finding in counts[kind][:show]:
            print("  " + str(finding))
    return len(counts["WRONG"])


if __name__ == "__main__":
    sys.exit(main())

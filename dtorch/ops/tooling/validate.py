"""Brute-force check of placement rules against torch: `python -m dtorch.ops.tooling.validate --op add`
(or `--all`, `--family nn`, `--mesh 2,2`).

For every sample call of an op (dtorch/ops/tooling/samples.py) and every combination of input
placements on a small mesh (R, S(d) for each dim, P(sum|avg|max|min)), it plans the call the
way the controller does, then SIMULATES the ranks on this CPU (dtorch/ops/tooling/simulate.py): each
rank's local inputs are cut with the same local-shape math the workers use, Partial inputs are
split into random contributions, and each rank runs the kernel from `registry.KERNELS` that a
worker would. It reports:
  WRONG    the rule accepted the combination but the ranks' results, read back through the
           output placements, differ from torch on the whole tensors (or a kernel raised);
  MISSING  the rule rejected the combination, yet running the op's kernel on the local inputs
           as given produces, for some output placement, exactly torch's result.
  DECLINED a MISSING that a rule refuses on purpose (listed in DECLINED with the reason).
No worker processes: for what a rule decides, a simulation answers as real workers would
(tests/test_ops_sweep.py runs the real runtime), and it is fast enough to be exhaustive.
Floats run in float64, and a MISSING candidate must fit several independent draws, so neither
rounding nor a lucky draw passes for a rule.
"""
from __future__ import annotations

import argparse
import itertools
import math
import random
import sys
from typing import NamedTuple

import torch

from ...spec.placements import DeviceMesh, format_placements
from ...errors import PlacementError
from ..dispatch import plan_call
from ..registry import KERNELS, REGISTRY, RegisteredOp
from ..tensor_meta import tensor_meta
from .samples import SAMPLED_FAMILIES, Sample, samples
from .simulate import (Symbol, as_tuple, contributions, map_torch, matches, placement_options, run_ranks,
                       small_mesh, tensor_inputs, with_inputs)

__all__ = ["validate", "Finding", "Stats", "DECLINED", "main"]

CONFIRMING_DRAWS = 6   # a MISSING candidate must also fit this many fresh draws


# MISSING findings a rule declines on purpose, by (op, the inputs' placements on one mesh dim).
DECLINED = {
    **{(op, f"[P({kind})]"): "only matrix_power(A, 0) (the identity, whatever A) reads right from a Partial A; "
       "plans do not key on the exponent's value" for op in ("matrix_power", "linalg_matrix_power")
       for kind in ("sum", "avg", "max", "min")},
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
    ("getitem", "[S(0)]"): "a strided slice of a sharded dim lines up with the shards for some sizes only",
    ("getitem", "[S(1)]"): "a strided slice of a sharded dim lines up with the shards for some sizes only",
}
# batch_norm_from_moments is the second step of dtorch.nn.functional.batch_norm_with_running_stats:
# its input and moments come from one tensor, so a Partial input never meets whole moments
DECLINED.update({("batch_norm_from_moments", combo): "an internal step whose moments come from its own input: "
                 "Partial forms not derived" for combo in ("[P(avg)], [R], [R], [P(avg)], [R], [R]", "[P(avg)], [R]",
                                                          "[P(max)], [R]", "[P(min)], [R]")})
_JOIN_PARTIAL_WITH_R = ("[R], [P(avg)]", "[R], [P(max)]", "[R], [P(min)]", "[P(avg)], [R]", "[P(max)], [R]",
                        "[P(min)], [R]")
DECLINED.update({(op, combo): "a Partial joined with an R input: exact for P(avg|max|min), refused for simplicity"
                 for op in ("cat", "stack") for combo in _JOIN_PARTIAL_WITH_R})
_NAN_TO_NUM_SUM = "a sum whose contributions are replaced one by one differs once one is inf or nan"
_NAN_TO_NUM_ORDER = "a max (min) carrying nan is nan, which nan_to_num sends to 0 while the other contributions stay"
DECLINED.update({
    ("nan_to_num", "[P(sum)]"): _NAN_TO_NUM_SUM, ("nan_to_num", "[P(avg)]"): _NAN_TO_NUM_SUM,
    ("nan_to_num", "[P(max)]"): _NAN_TO_NUM_ORDER, ("nan_to_num", "[P(min)]"): _NAN_TO_NUM_ORDER,
    ("repeat_interleave", "[S(0)]"): "without dim, rows flatten into whole shards for some sizes only (as reshape)",
    ("lerp", "[R], [P(max)]"): "lerp rises in end only for weight >= 0; plans key a scalar weight by type",
    ("lerp", "[R], [P(min)]"): "lerp rises in end only for weight >= 0; plans key a scalar weight by type",
    ("lerp", "[R], [R], [P(avg)]"): "exact (lerp is affine in weight) but not derived: Laws has no affine-only group",
    **{("isclose", combo): "a contribution other than the max (min) may be close where the max (min) is not"
       for combo in ("[R], [P(max)]", "[R], [P(min)]", "[P(max)], [R]", "[P(min)], [R]")},
})
_OVERFLOW = "finite contributions can overflow to inf when summed (and inf + -inf is nan)"
_SCALAR_LOG = "x log c is linear in x (and monotone) for c > 0 only, and plans key a scalar c by type"
_NAN_IGNORED = ("a P(max) (fmin: P(min)) carrying nan reads nan, whose fmax is the other operand, while a finite "
                "contribution's may exceed it (this tool only draws nan or -inf beside a nan)")
_SIGN_BIT = "rising in the sign bit's order only: a reduction of signed zeros or nan need not keep -0.0 < +0.0"
DECLINED.update({
    **{(op, combo): _OVERFLOW for op in ("isposinf", "isneginf") for combo in ("[P(sum)]", "[P(avg)]")},
    **{("xlogy", combo): _SCALAR_LOG for combo in ("[P(sum)]", "[P(avg)]", "[P(max)]", "[P(min)]")},
    **{("copysign", combo): _SIGN_BIT for combo in ("[R], [P(max)]", "[R], [P(min)]")},
    **{(op, combo): _NAN_IGNORED for op, partial in (("fmax", "[P(max)]"), ("fmin", "[P(min)]"))
       for combo in (f"[R], {partial}", f"{partial}, [R]", f"{partial}, {partial}")},
})
DECLINED[("slice_scatter", "[S(1)], [S(1)]")] = (
    "a strided slice of a sharded dim lines up with the shards for some sizes only (as getitem)")
DECLINED[("index_put", "[P(sum)], [S(0)], [S(0)]")] = (
    "accumulate with positions and values split alike into a P(sum) target is exact, not derived yet")
# scatter passes a Partial only as input and src alike (R index); the other forms below are exact
# too but not derived yet: gaps of the rule, listed so that a new one still shows up as MISSING
_SCATTER_NOT_DERIVED = ("[P(avg)], [R]", "[P(avg)], [R], [R]", "[P(max)], [R]", "[P(max)], [R], [R]",
                        "[P(min)], [R]", "[P(min)], [R], [R]", "[P(min)], [S(0)], [S(0)]", "[P(min)], [S(1)]",
                        "[P(min)], [S(1)], [S(1)]", "[R], [R], [P(avg)]", "[R], [R], [P(max)]",
                        "[R], [R], [P(min)]", "[R], [S(0)], [S(0)]", "[R], [S(1)]", "[R], [S(1)], [S(1)]")
DECLINED.update({("scatter", combo): "not derived yet (scatter's rule passes input and src of the same "
                 "Partial only)" for combo in _SCATTER_NOT_DERIVED})

# a depthwise weight (out, 1, k...) split on its in-channels-per-group dim: one rank holds it all
# and the others add only their bias share, so P(sum) reads right; a weight S(1) with groups > 1
# splits every group's input channels apart, which no input placement follows
DECLINED.update({(f"conv{n}d", "[R], [S(1)], [P(sum)]"): "a weight S(1) with groups > 1 reads right only where each "
                 "group has 1 in-channel (all on one rank): not a layout to derive" for n in (1, 2, 3)})

class Finding(NamedTuple):
    kind: str          # "WRONG", "MISSING", or "DECLINED" (a MISSING listed in DECLINED)
    op: str
    placements: tuple  # per tensor input, N-D
    detail: str

    def __str__(self) -> str:
        given = ", ".join(map(format_placements, self.placements))
        return f"{self.kind:8} {self.op}({given}): {self.detail}"


# --- one op -----------------------------------------------------------------------------------------
class Stats(NamedTuple):
    combinations: int = 0
    accepted: int = 0
    refused: int = 0      # raised something other than PlacementError (e.g. UnsupportedOpError)


def validate(op: RegisteredOp | str, mesh_shape=(3,), uneven: bool = True, seed: int = 0,
             limit: int | None = None) -> tuple[Stats, list]:
    """Every sample of `op`, every input placement combination on a mesh of `mesh_shape` (a
    seeded sample of `limit` of them per sample call where there are more)."""
    op = REGISTRY[op] if isinstance(op, str) else op
    mesh = small_mesh(mesh_shape)
    totals, findings = [0, 0, 0], []
    for number, sample in enumerate(samples(op.name, uneven, seed)):
        draw = _Draw(op, sample, mesh, seed)
        # A MISSING candidate must survive more independent draws: one draw can fit by chance.
        again = [lambda k=k: _Draw(op, samples(op.name, uneven, seed + k)[number], mesh, seed + k)
                 for k in range(1, CONFIRMING_DRAWS + 1)]
        options = [list(itertools.product(placement_options(v), repeat=mesh.ndim)) for v in draw.values]
        for combo in _combinations(options, limit, random.Random(seed)):
            outcome, finding = _check(op, draw, combo, again)
            totals[0] += 1
            totals[1] += outcome == "accepted"
            totals[2] += outcome == "refused"
            if finding is not None:
                findings.append(finding._replace(detail=f"sample {number}: {finding.detail}"))
    return Stats(*totals), findings


def _combinations(options, limit, chooser):
    if limit is None or math.prod(map(len, options)) <= limit:
        return itertools.product(*options)
    return (tuple([chooser.choice(o) for o in options]) for _ in range(limit))


class _Draw:
    """One sample's whole tensors, torch's results on them, and their rank contributions."""

    def __init__(self, op: RegisteredOp, sample: Sample, mesh: DeviceMesh, seed: int):
        # float64 in place of float32: the rules do not depend on it, and contributions that
        # cancel (P(sum) of P(sum)) then leave no rounding to mistake for a wrong rule
        sample = sample._replace(args=map_torch(sample.args, _wider), kwargs=map_torch(sample.kwargs, _wider))
        self.sample, self.mesh = sample, mesh
        self.values = tensor_inputs(sample)
        self.expected = as_tuple(op.torch_fn(*sample.args, **sample.kwargs))
        self._g = torch.Generator().manual_seed(seed + 104729)   # a stream apart from the sample's
        self._held: dict = {}

    def held(self, combo) -> list:
        for key in enumerate(combo):
            if key not in self._held:
                index, placements = key
                self._held[key] = contributions(self.values[index], self.mesh, placements, self._g)
        return [self._held[key] for key in enumerate(combo)]


def _wider(value: torch.Tensor) -> torch.Tensor:
    return value.double() if value.dtype == torch.float32 else value


def _check(op, draw: _Draw, combo, again):
    specs = [tensor_meta(v.shape, v.dtype, draw.mesh, p) for v, p in zip(draw.values, combo)]
    args, kwargs = with_inputs(draw.sample, [Symbol(s) for s in specs])
    try:
        plan = plan_call(op, args, kwargs, specs, strict=True)   # the rule as written, no moves
    except PlacementError:
        return "rejected", _missing(op, draw, combo, again)
    except Exception:   # noqa: BLE001  (UnsupportedOpError and the like: refused on purpose)
        return "refused", None
    required = [_after_steps(combo[i], plan.input_steps, i) for i in range(len(combo))]
    try:
        ranks = run_ranks(KERNELS[plan.kernel], draw.sample, draw.values, draw.held(combo), required,
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
    reason = _declined(op.name, combo)
    if reason is not None:
        return Finding("DECLINED", op.name, combo, f"would read as {found}; declined: {reason}")
    return Finding("MISSING", op.name, combo, "rejected, but the local results read as " + found)


def _declined(name: str, combo):
    """The DECLINED reason of the first mesh dim whose choices (one per input) are listed."""
    for mesh_dim in range(len(combo[0]) if combo else 0):
        reason = DECLINED.get((name, ", ".join(f"[{p[mesh_dim]!r}]" for p in combo)))
        if reason is not None:
            return reason
    return None


def _fitting(op, draw: _Draw, combo, among):
    """Per output, the placements under which the ranks' results (the op's kernel on the inputs
    as given) read as torch's; None when some output has none. `among`: candidates to keep."""
    try:
        ranks = run_ranks(KERNELS[op.name], draw.sample, draw.values, draw.held(combo), combo, draw.mesh, {})
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


# --- command line -----------------------------------------------------------------------------------
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtorch.ops.tooling.validate", description=__doc__.split("\n")[0])
    parser.add_argument("--op", action="append", default=[], help="an op name (repeatable)")
    parser.add_argument("--all", action="store_true", help=f"every op of {', '.join(SAMPLED_FAMILIES)}")
    parser.add_argument("--family", action="append", default=[], help="every op of one family")
    parser.add_argument("--mesh", default="3", help="mesh shape, e.g. 3 or 2,2 (default 3: uneven splits)")
    parser.add_argument("--even", action="store_true", help="inputs that divide evenly (default: uneven)")
    parser.add_argument("--show", type=int, default=5, help="findings listed per op and kind")
    parser.add_argument("--limit", type=int, default=None,
                        help="combinations tried per sample call at most (a seeded sample beyond)")
    options = parser.parse_args(argv)
    families = SAMPLED_FAMILIES if options.all else tuple(options.family)
    names = options.op + sorted(n for n, s in REGISTRY.items() if s.family in families)
    if not names:
        parser.error("name ops with --op, --family or --all")
    mesh_shape = tuple([int(n) for n in options.mesh.split(",")])
    wrong = 0
    for name in names:
        if name not in REGISTRY:
            parser.error(f"no op {name!r}")
        stats, findings = validate(name, mesh_shape, uneven=not options.even, limit=options.limit)
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

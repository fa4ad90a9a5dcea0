"""A training soak: does the resident memory of the controller and of each worker stay flat?

    python -m benchmarks.soak_rss [--minutes 10] [--workers 2] [--warmup-minutes M] [--json PATH]
    python -m benchmarks.soak_rss --minutes 3 --tracemalloc 15   # what grew on the controller
    python -m benchmarks.soak_rss --steps 4000 --warmup-steps 1500   # a fixed amount of work (tests/test_soak.py)

Two small torch models (an MLP over byte embeddings with LayerNorm and a cross-entropy loss)
are placed data parallel on --workers local CPU workers (dtorch.distribute_module) and trained
with dtorch.optim.AdamW, one eager step and one dtorch.compile'd step after the other, each on a
fresh batch uploaded with dtorch.tensor, with a loss.item() of both every READ_EVERY steps, as
a training loop logs. Every --sample-s seconds it records the controller's RSS (VmRSS of
/proc/self/status) and each worker's (VmRSS of /proc/<pid>/status; a worker on another host
would give its heartbeat's rss_bytes, dtorch.workers()).

After the warm-up (default: the first 20% of the run, at least 1 minute, while allocators,
caches and torch's own pools settle; with --warmup-steps, that many steps instead: the
controller's bounded records fill per command, not per minute, e.g. the ring of the lines that
issued the last 65536 command seqs, and the 4096 newest replays), it fits a least-squares line to each process's samples
and reports its slope (MB/min, MB = 2**20 bytes) and two measures of growth after warm-up: the
range (max - min of the samples) and slope x duration. A flat process has a range of a few
hundred KB (pages that come and go) and a slope near 0.

--tracemalloc N traces the controller's Python allocations (slower: every allocation is
recorded) and prints the N tracebacks whose memory grew most between the end of the warm-up and
the end, and --object-counts N the N object types whose number grew most (gc.get_objects()):
how issue 43's creep was found. Results go to --json (default
benchmarks/results/soak_rss.json) and a table to stdout; docs/design/benchmarks.md ("Soak") has
this machine's figures.
"""
from __future__ import annotations

import argparse
import collections
import gc
import json
import math
import sys
import time
import tracemalloc
from pathlib import Path

from .process_memory import free_tuples_mib, rss_mib, rss_parts_mib
from .scale_model import fit_line

__all__ = ["Samples", "growth", "soak", "main"]

READ_EVERY = 10
MB = float(1 << 20)
RESULTS = Path(__file__).resolve().parent / "results" / "soak_rss.json"


class Samples:
    """(seconds since start, RSS in MiB) per process: "controller" (and its RSS in two parts:
    "controller anon", its own memory, and "controller files", pages of mapped files such as
    torch's libraries; and "controller free tuples", the tuples CPython keeps for reuse, which
    filled step by step until dtorch built its tuples at their size), "rank 0", "rank 1", ..."""

    def __init__(self):
        self.started = time.monotonic()
        self.series: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
        self.steps: list[int] = []   # the steps done at each sample

    def take(self, workers: list[dict], steps: int) -> None:
        now = time.monotonic() - self.started
        self.steps.append(steps)
        self.series["controller"].append((now, rss_mib()))
        anon, file = rss_parts_mib()
        self.series["controller anon"].append((now, anon))   # the controller's RSS in its two parts
        self.series["controller files"].append((now, file))
        self.series["controller free tuples"].append((now, free_tuples_mib()))   # inside "anon": not live data
        for worker in workers:
            self.series[f"rank {worker['rank']}"].append((now, _worker_rss_mib(worker)))


def _worker_rss_mib(worker: dict) -> float:
    try:
        return rss_mib(worker["pid"])   # a local worker: read now, not half a second ago
    except (OSError, KeyError):
        return worker["rss_bytes"] / MB


def growth(series: list[tuple[float, float]], warmed: list[bool]) -> dict:
    """Slope (MB/min) and growth after warm-up (range, slope x duration) of one process;
    `warmed`: whether each sample is past the warm-up."""
    after = [sample for sample, past in zip(series, warmed) if past]
    if len(after) < 2:
        return {"samples": len(after)}
    minutes = [t / 60 for t, _ in after]
    values = [mib for _, mib in after]
    _, slope = fit_line(minutes, values)
    duration = minutes[-1] - minutes[0]
    return {"samples": len(after), "minutes": duration, "start_mb": values[0], "end_mb": values[-1],
            "slope_mb_per_min": slope, "range_mb": max(values) - min(values),
            "fitted_growth_mb": slope * duration}


def _model(torch, vocab: int, width: int):
    nn = torch.nn

    class Soak(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            self.norm = nn.LayerNorm(width)
            self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
            self.head = nn.Linear(width, vocab)

        def forward(self, ids, targets):
            x = self.embed(ids)
            x = x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))
            return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())
    return Soak()


class Trainer:
    """One model, its optimizer and its step: eager, or under dtorch.compile."""

    def __init__(self, mesh, compiled: bool, args):
        import torch
        import dtorch
        self.mesh, self.args = mesh, args
        self.model = dtorch.distribute_module(_model(torch, args.vocab, args.width), mesh)
        self.optimizer = dtorch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.step = dtorch.compile(self._step) if compiled else self._step
        self.generator = torch.Generator().manual_seed(int(compiled))

    def _step(self, ids, targets):
        loss = self.model(ids, targets)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss

    def __call__(self):
        import torch
        import dtorch
        from dtorch import Shard
        batch = torch.randint(0, self.args.vocab, (self.args.batch, self.args.context + 1), generator=self.generator)
        ids, targets = (dtorch.tensor(t.contiguous(), device_mesh=self.mesh, placements=[Shard(0)])
                        for t in (batch[:, :-1], batch[:, 1:]))
        return self.step(ids, targets)


def soak(args) -> dict:
    """Train for args.minutes, sampling every args.sample_s; the samples and settings as a dict."""
    import dtorch
    dtorch.init(num_workers=args.workers)
    try:
        mesh = dtorch.init_device_mesh("cpu", (args.workers,))
        trainers = [Trainer(mesh, False, args), Trainer(mesh, True, args)]
        return _train(trainers, args)
    finally:
        dtorch.shutdown()


def _train(trainers, args) -> dict:
    import dtorch
    samples, steps, losses = Samples(), 0, []   # the first and the latest losses read (a list of all would grow)
    deadline, warmup_s = args.minutes * 60, args.warmup_minutes * 60
    next_sample, traced = 0.0, Diagnostics(args) if args.tracemalloc or args.object_counts else None
    while (elapsed := time.monotonic() - samples.started) < deadline and steps < (args.steps or math.inf):
        step_losses = [train() for train in trainers]
        steps += 1
        if steps % READ_EVERY == 0:
            losses[1 if losses else 0:] = [[loss.item() for loss in step_losses]]
        del step_losses
        if elapsed >= next_sample:
            samples.take(dtorch.workers(), steps)
            next_sample += args.sample_s
            if traced:
                traced.at(elapsed >= warmup_s and steps >= args.warmup_steps)
    samples.take(dtorch.workers(), steps)
    stats = dtorch.stats()
    warmed = [t >= warmup_s and done >= args.warmup_steps
              for (t, _), done in zip(samples.series["controller"], samples.steps)]
    result = {"settings": vars(args) | {"json": str(args.json)}, "steps": steps, "warmup_s": warmup_s,
              "warmup_ended_s": next((t for (t, _), past in zip(samples.series["controller"], warmed) if past), None),
              "losses_first_last": losses,
              "stats": {key: stats[key] for key in ("commands_sent", "messages_rejected", "pending_reads")
                        if key in stats},
              "growth": {name: growth(series, warmed) for name, series in samples.series.items()},
              "series": dict(samples.series), "series_steps": samples.steps}
    if traced:
        result["diagnostics"] = traced.report()
    return result


class Diagnostics:
    """tracemalloc snapshots and object counts of the controller at the end of the warm-up and
    at the end: what grew between them."""

    def __init__(self, args):
        self.top, self.counts, self.first = args.tracemalloc, args.object_counts, None
        if self.top:
            tracemalloc.start(12)

    def _state(self):
        gc.collect()
        counts = collections.Counter(type(o).__qualname__ for o in gc.get_objects()) if self.counts else None
        return (tracemalloc.take_snapshot() if self.top else None), counts

    def at(self, warmed: bool) -> None:
        if self.first is None and warmed:
            self.first = self._state()

    def report(self) -> dict:
        if self.first is None:
            return {}
        (snapshot, counts), (first_snapshot, first_counts) = self._state(), self.first
        out = {}
        if self.top:
            diff = snapshot.compare_to(first_snapshot, "traceback")[:self.top]
            out["tracemalloc"] = [{"kib": stat.size_diff / 1024, "count": stat.count_diff,
                                   "traceback": stat.traceback.format()} for stat in diff]
        if self.counts:
            grown = (counts - first_counts).most_common(self.counts)
            out["object_counts"] = [{"type": name, "grew": n, "now": counts[name]} for name, n in grown]
        return out


def print_report(result: dict) -> None:
    ended = result["warmup_ended_s"]
    print(f"{result['steps']} steps (eager + compiled each) in {result['series']['controller'][-1][0] / 60:.1f} min, "
          f"warm-up {'not over' if ended is None else f'{ended / 60:.1f} min'}; losses {result['losses_first_last']}; "
          f"{result['stats']}")
    print(f"{'process':22s} {'samples':>7s} {'start MB':>9s} {'end MB':>8s} {'slope MB/min':>13s} "
          f"{'range MB':>9s} {'slope x min':>12s}")
    for name, g in result["growth"].items():
        if "slope_mb_per_min" not in g:
            print(f"{name:22s} {g['samples']:7d}  (too few samples after warm-up)")
            continue
        print(f"{name:22s} {g['samples']:7d} {g['start_mb']:9.1f} {g['end_mb']:8.1f} {g['slope_mb_per_min']:13.3f} "
              f"{g['range_mb']:9.2f} {g['fitted_growth_mb']:12.2f}")
    for stat in result.get("diagnostics", {}).get("tracemalloc", []):
        print(f"\n{stat['kib']:+9.1f} KiB {stat['count']:+7d} blocks\n    " + "\n    ".join(stat["traceback"][-8:]))
    for row in result.get("diagnostics", {}).get("object_counts", []):
        print(f"{row['type']:40s} +{row['grew']:7d}  now {row['now']}")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak_rss", description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="stop after this long ...")
    parser.add_argument("--steps", type=int, default=0, help="... or after this many steps (0: no limit)")
    parser.add_argument("--warmup-minutes", type=float, default=None,
                        help="samples before this are not fitted (default: 20%% of the run, at least 1 "
                             "minute; none with --warmup-steps)")
    parser.add_argument("--warmup-steps", type=int, default=0, help="nor samples before this many steps")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--sample-s", type=float, default=3.0)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=32)
    parser.add_argument("--tracemalloc", type=int, default=0, metavar="N")
    parser.add_argument("--object-counts", type=int, default=0, metavar="N")
    parser.add_argument("--json", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.warmup_minutes is None:
        args.warmup_minutes = 0.0 if args.warmup_steps else min(max(0.2 * args.minutes, 1.0), 0.5 * args.minutes)
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    result = soak(args)
    print_report(result)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    print(f"\nresults: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

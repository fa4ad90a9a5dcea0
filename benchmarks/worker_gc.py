"""What a full collection of Python's cyclic garbage collector costs a worker's command loop.

    PYTHONPATH=<checkout> python benchmarks/worker_gc.py [--reps 5]

Each repetition starts a fresh Python process that imports what a worker imports (torch, zmq,
msgpack, dtorch.runtime.worker.worker and worker_process), then:
  as started    applies the checkout's own start-up treatment of the collector, as a worker that
                dtorch-launch starts over ssh or slurm (or DTORCH_ZYGOTE=0) applies it
                (worker_process._freeze_collector; nothing on a checkout without it), then times
                one gc.collect(): the pause a generation-2 collection puts into the command loop
  untreated     the same without any treatment: what such a worker paid before
Python runs a generation-2 collection on its own once enough objects have outlived two younger
collections (a quarter of those it already tracks), so a worker that keeps building objects
(autograd graphs, compiled graphs, tensors' tables) pays it every so often, and every peer then
waits for it at the next collective. A worker forked from the template (runtime/processes/zygote.py) is
frozen by the template before the fork either way.

Standalone (no relative imports): run it with PYTHONPATH on any checkout. Prints the objects the
collector tracks (after the treatment) and the median and minimum pause over the repetitions, in milliseconds.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

_CHILD = """
import gc, json, sys, time
import msgpack, torch, zmq
from dtorch.runtime.worker import worker; from dtorch.runtime.processes import worker_process
if sys.argv[1] == "as started":
    getattr(worker_process, "_freeze_collector", lambda: None)()
tracked = len(gc.get_objects())
started = time.perf_counter()
gc.collect()
print(json.dumps({"tracked": tracked, "ms": (time.perf_counter() - started) * 1e3}))
"""


def _one(variant: str) -> dict:
    done = subprocess.run([sys.executable, "-c", _CHILD, variant], capture_output=True, text=True,
                          timeout=120, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    import dtorch
    print(dtorch.__file__.rsplit("/dtorch/", 1)[0])
    for variant in ("as started", "untreated"):
        runs = [_one(variant) for _ in range(args.reps)]
        pauses = [run["ms"] for run in runs]
        print(f"{variant:11s} objects tracked {runs[0]['tracked']:7d}  full collection: "
              f"median {statistics.median(pauses):.3f} ms, min {min(pauses):.3f} ms")


if __name__ == "__main__":
    main()

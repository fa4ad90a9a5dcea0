"""Benchmark 10's dp4 step, eager and dtorch.compile'd, each with and without a warmup + cosine
LambdaLR (issue 45), in turns: each round takes one step of each of the four, so that a drift in
the machine's speed weighs on all alike. Per row: the median wall time of a step, the controller's
CPU per step and the workers' (utime + stime, summed over the 4), and for the compiled rows how
many of the calls captured.

    PYTHONPATH=<checkout> python benchmarks/schedule_turns.py [--rounds 16]

Run it on two checkouts alternately for a before / after; the benchmark file itself may be
copied into the older checkout (it needs only llama_train's Layout and _stepper).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import dtorch_session
from benchmarks import llama_train
from benchmarks.config import QUICK
from benchmarks.llama_forward import config_fields
from benchmarks.process_memory import returned_buffers

ROWS = (("eager", False, False), ("compiled", True, False), ("eager, LambdaLR", False, True),
        ("compiled, LambdaLR", True, True))
_TICK = os.sysconf("SC_CLK_TCK")


def process_cpu(pid: int) -> float:
    """Seconds of CPU (user + system) the process has run."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=16, help="timed steps of each row, in turns")
    rounds = parser.parse_args(argv).rounds
    import dtorch
    suite = QUICK
    fields = config_fields(replace(suite, llama_layers=suite.train_layers, llama_hidden=suite.train_hidden,
                                   llama_seq=suite.train_seq))
    with returned_buffers():
        dtorch_session.close()   # the pool starts with the allocator setting in its environment
        model, ids = llama_train._reference(fields, suite)
        mesh = llama_train._mesh(llama_train.Layout("dp4", (4,), "dp"))
        pids = [worker["pid"] for worker in dtorch.workers() if worker["rank"] in mesh.ranks]
        steps = {}
        for name, compiled, scheduled in ROWS:
            steps[name] = llama_train._stepper(model, ids, mesh, None, [], None, compiled, False, scheduled)
            for _ in range(llama_train.WARMUP_STEPS):
                steps[name]()
        walls = {name: [] for name, _, _ in ROWS}
        controller, workers = dict.fromkeys(walls, 0.0), dict.fromkeys(walls, 0.0)
        for _ in range(rounds):
            for name in walls:
                cpu, spent = time.process_time(), sum(map(process_cpu, pids))
                walls[name].append(steps[name]())
                controller[name] += time.process_time() - cpu
                workers[name] += sum(map(process_cpu, pids)) - spent
        for name, samples in walls.items():
            median = statistics.median(samples)
            print(f"{name:20s} median {median * 1e3:6.1f} ms ({1 / median:4.2f} steps/s), min {min(samples) * 1e3:6.1f}"
                  f"; controller CPU {controller[name] / rounds * 1e3:5.1f} ms/step"
                  f"; workers' CPU {workers[name] / rounds * 1e3:6.1f} ms/step{_captures(steps[name], rounds)}")
        dtorch_session.close()


def _captures(step, rounds: int) -> str:
    for cell in step.__closure__ or ():
        if type(cell.cell_contents).__name__ == "CompiledFunction":
            return f"; captured {cell.cell_contents.captures} of {llama_train.WARMUP_STEPS + rounds} calls"
    return ""


if __name__ == "__main__":
    main()

"""The interrupt fuzzer: a thread sends SIGINT to this process at random 1-50 ms intervals while
the main thread runs a loop of ops, reads, redistributes and a training step, catching every
KeyboardInterrupt the way a notebook ("interrupt kernel") or a script that saves on Ctrl-C does.

Properties: the session is never lost (every iteration after an interrupt runs on the same
workers), nothing hangs (a faulthandler dump and exit 3 if no iteration completes for
HANG_S), and every value that an uninterrupted iteration reads equals plain torch's.

    python tests/interrupt_fuzz.py --interrupts 5000            # the long variant (~5 min)
    python tests/interrupt_fuzz.py --interrupts 500 --json      # what tests/test_interrupts.py runs

Exit status 0 when all properties hold; the last line is a JSON summary with --json.
"""
from __future__ import annotations

import argparse
import faulthandler
import itertools
import json
import os
import random
import signal
import sys
import threading
import time

import torch

HANG_S = 60.0


class Interrupter(threading.Thread):
    """SIGINT to the main thread at random intervals, until `target` have been sent."""

    def __init__(self, target: int, seed: int, low_s: float = 0.001, high_s: float = 0.05):
        super().__init__(name="interrupter", daemon=True)
        self.target, self.sent = target, 0
        self.random = random.Random(seed)
        self.low_s, self.high_s = low_s, high_s
        self.stop = threading.Event()

    def run(self) -> None:
        while self.sent < self.target and not self.stop.wait(self.random.uniform(self.low_s, self.high_s)):
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            self.sent += 1


class Workload:
    """One iteration = ops, a redistribute, reads and one training step, each checked against
    plain torch when no interrupt cut the iteration short."""

    def __init__(self, mesh, seed: int):
        import dtorch
        from dtorch import Replicate, Shard
        self.dtorch, self.mesh, self.Shard, self.Replicate = dtorch, mesh, Shard, Replicate
        self.random = random.Random(seed)
        torch.manual_seed(seed)
        self.reference = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        self.model = dtorch.distribute_module(_copy(self.reference), mesh)
        self.reference_opt = torch.optim.SGD(self.reference.parameters(), lr=0.05)
        self.opt = dtorch.optim.SGD(self.model.parameters(), lr=0.05)
        self.compiled_model = dtorch.distribute_module(_copy(self.reference), mesh)
        self.compiled_opt = dtorch.optim.SGD(self.compiled_model.parameters(), lr=0.05)
        self.compiled_step = dtorch.compile(self.step_of(self.compiled_model, self.compiled_opt))
        self.checked = self.wrong = 0
        self.failures: list[str] = []

    def iteration(self, index: int) -> None:
        step = self.random.randrange(5)
        if step == 0:
            self.ops(index)
        elif step == 1:
            self.redistribute(index)
        elif step == 2:
            self.reads(index)
        elif step == 3:
            self.train(index, self.model, self.step_of(self.model, self.opt))
        else:
            self.train(index, self.compiled_model, self.compiled_step)

    def ops(self, index: int) -> None:
        a, b = torch.randn(13, 6), torch.randn(13, 6)
        x = self.dtorch.distribute_tensor(a, self.mesh, [self.Shard(0)])
        y = self.dtorch.distribute_tensor(b, self.mesh, [self.Shard(0)])
        z = ((x + y) * 2).relu().sum(dim=1)
        self.compare(f"ops#{index}", z.to_torch(), ((a + b) * 2).relu().sum(dim=1))

    def redistribute(self, index: int) -> None:
        a = torch.randn(9, 10)
        x = self.dtorch.distribute_tensor(a, self.mesh, [self.Shard(0)])
        y = x.redistribute(self.mesh, [self.Shard(1)]).redistribute(self.mesh, [self.Replicate()])
        self.compare(f"redistribute#{index}", y.to_torch(), a)

    def reads(self, index: int) -> None:
        a = torch.arange(24, dtype=torch.float32).reshape(6, 4) + index
        x = self.dtorch.distribute_tensor(a, self.mesh, [self.Shard(0)])
        self.compare(f"item#{index}", torch.tensor(x.sum().item()), a.sum())
        self.compare(f"fetch#{index}", (x * x).to_torch(), a * a)

    def step_of(self, model, opt):
        def step(batch, target):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(batch), target)
            loss.backward()
            opt.step()
            return loss
        return step

    def train(self, index: int, model, step) -> None:
        """The dtorch model starts each step from its own parameters (read back), so that a step an
        interrupt cut short leaves nothing to compare against but a consistent state. `step`:
        eager, or dtorch.compile'd (an interrupt may land in its capture or its replays)."""
        before = [p.to_torch() for p in model.parameters()]
        with torch.no_grad():
            for mine, theirs in zip(self.reference.parameters(), before):
                mine.copy_(theirs)
        batch, target = torch.randn(16, 8), torch.randn(16, 4)
        self.reference_opt.zero_grad()
        expected_loss = torch.nn.functional.mse_loss(self.reference(batch), target)
        expected_loss.backward()
        self.reference_opt.step()
        loss = step(self.upload(batch), self.upload(target))
        self.compare(f"train#{index}.loss", loss.to_torch(), expected_loss.detach())
        for number, (mine, theirs) in enumerate(zip(model.parameters(), self.reference.parameters())):
            self.compare(f"train#{index}.param{number}", mine.to_torch(), theirs.detach())

    def upload(self, tensor: torch.Tensor):
        return self.dtorch.distribute_tensor(tensor, self.mesh, [self.Shard(0)])

    def compare(self, what: str, got: torch.Tensor, expected: torch.Tensor) -> None:
        self.checked += 1
        if got.shape != expected.shape or not torch.allclose(got, expected, atol=1e-5, rtol=1e-4):
            self.wrong += 1
            self.failures.append(f"{what}: wrong value")


def _copy(module):
    import copy
    return copy.deepcopy(module)


def storm(workload: Workload, interrupter: Interrupter, counts: dict, error_kinds: dict) -> None:
    """Iterations until the interrupter is done; every KeyboardInterrupt is caught and the loop
    goes on, as a notebook's next cell would."""
    while interrupter.is_alive() and counts["errors"] < 5:
        faulthandler.dump_traceback_later(HANG_S, exit=True)
        counts["index"] += 1
        try:
            workload.iteration(counts["index"])
            counts["completed"] += 1
        except KeyboardInterrupt:
            counts["caught"] += 1
        except Exception as error:   # a lost session, a protocol error: counted, and the run fails
            counts["errors"] += 1
            kind = f"{type(error).__name__}: {str(error)[:200]}"
            error_kinds[kind] = error_kinds.get(kind, 0) + 1


def run(interrupt_count: int, seed: int, workers: int) -> dict:
    raised = itertools.count()   # KeyboardInterrupts raised, counted where they are made (a C call)
    def counting_handler(signum, frame):
        next(raised)
        raise KeyboardInterrupt
    signal.signal(signal.SIGINT, counting_handler)   # dtorch puts its handler in front of this one
    import dtorch
    from dtorch.runtime.controller import interrupts
    faulthandler.enable()
    mesh = dtorch.init_device_mesh("cpu", (workers,))
    pids = sorted(w["pid"] for w in dtorch.workers())
    workload = Workload(mesh, seed)
    interrupter = Interrupter(interrupt_count, seed)
    counts = {"caught": 0, "completed": 0, "errors": 0, "index": 0}
    error_kinds: dict[str, int] = {}
    started = time.monotonic()
    interrupter.start()
    while interrupter.is_alive() and counts["errors"] < 5:
        try:   # an interrupt may land in this harness's own bookkeeping too: then it counts once more
            storm(workload, interrupter, counts, error_kinds)
        except KeyboardInterrupt:
            counts["caught"] += 1
    interrupter.stop.set()
    interrupter.join()
    settle_deadline = time.monotonic() + 1.0
    while time.monotonic() < settle_deadline:   # an interrupt still deferred runs at the next call
        try:
            time.sleep(0.01)
        except KeyboardInterrupt:
            counts["caught"] += 1
    faulthandler.cancel_dump_traceback_later()
    # After the storm: the same workers still answer, with the right values.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    final_ok = True
    try:
        workload.ops(-1)
        workload.train(-1, workload.model, workload.step_of(workload.model, workload.opt))
        workload.train(-2, workload.compiled_model, workload.compiled_step)
        dtorch.synchronize()
    except Exception as error:
        final_ok = False
        error_kinds[f"final: {type(error).__name__}: {str(error)[:200]}"] = 1
    survivors = sorted(w["pid"] for w in dtorch.workers() if w["alive"])
    summary = {"interrupts_sent": interrupter.sent, "interrupts_raised": next(raised),
               "interrupts_caught": counts["caught"],
               "iterations": counts["index"], "iterations_completed": counts["completed"],
               "values_checked": workload.checked, "wrong_values": workload.wrong,
               "errors": counts["errors"], "error_kinds": error_kinds,
               "interrupts_handled": interrupts.counts()["seen"],   # Python merges SIGINTs that come too fast
               "interrupts_coalesced": interrupts.counts()["coalesced"],
               "interrupts_forced": interrupts.counts()["forced"],
               "session_kept": final_ok and survivors == pids, "seconds": round(time.monotonic() - started, 1),
               "failures": workload.failures[:10]}
    dtorch.shutdown()
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interrupts", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=int(os.environ.get("DTORCH_FUZZ_SEED", 0)))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    summary = run(args.interrupts, args.seed, args.workers)
    accounted = (summary["interrupts_raised"] + summary["interrupts_coalesced"] == summary["interrupts_handled"]
                 and summary["interrupts_caught"] == summary["interrupts_raised"])   # none dropped on the way
    ok = (summary["errors"] == 0 and summary["wrong_values"] == 0 and summary["session_kept"] and accounted
          and summary["interrupts_forced"] == 0)
    print(json.dumps(summary) if args.json else json.dumps(summary, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

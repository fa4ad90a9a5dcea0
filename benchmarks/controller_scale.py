"""12. Controller CPU per op by world size: the same program on 1, 4, 16 and 64 local workers.

The program is N small elementwise ops (`z = z * 1.0001 + 1` on a (64, 128) `Shard(0)` tensor)
and one read of the result. A single controller scales only if what it spends per op does not
grow with the number of workers: a command is published once whatever the world size, so only
the read (one reply per rank) and the heartbeats (two per worker per second) may grow. Issue 15's
goal: 64 workers within 1.1x of 1 worker.

Each world size runs in a fresh controller process (`python -m benchmarks.controller_scale N OPS
REPS IDLE_S` prints one JSON line), so no pool, thread or cache is shared between rows. Per
repetition it measures the controller process's CPU time (time.process_time: user + sys of
every thread) divided by N, and the same split by thread (from /proc/self/task/*/schedstat, in
nanoseconds): the user's thread, which plans and queues commands; the loop thread, which
publishes batches and handles replies and heartbeats; ZeroMQ's I/O thread, which writes each
subscriber its copy; and the rest (output forwarders, the worker template's listener).

The same rows give each worker's own CPU per op (the mean over workers, every thread of the
process, from /proc/<pid>/task/*/schedstat): a worker decodes and runs every command of its mesh,
and on a machine with fewer cores than workers that CPU is what stretches the wall time.

Then, with the pool idle, it measures the CPU per second that heartbeats cost (every message
the controller sends while idle is a pong, one per heartbeat). That cost is per second, not per
op, and on a 2-core machine 64 busy workers stretch the program's wall time (they share the two
cores), so the raw per-op figure charges the program for seconds of heartbeats. The second row
of each world size subtracts them: raw CPU minus (idle CPU per second x the program's wall time).
"""
from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from .process_memory import cpu_seconds, thread_cpu_seconds
from .timing import Row, guarded, median

NAME = "controller_scale"
TITLE = "12. Controller CPU per op by world size (N small ops + 1 read)"
SHAPE = (64, 128)   # Shard(0) over up to 64 ranks: one row or more each
ROOT = Path(__file__).resolve().parent.parent
THREADS = ("user", "loop", "zmq", "other")
PUBLISHED_S = 0.05   # after issuing, well past the controller's idle flush (0.5 ms)

__all__ = ["run", "measure", "measure_in_subprocess", "ThreadClocks"]


def run(suite) -> list[Row]:
    rows = []
    for world in suite.scale_worlds:
        rows += _world_rows(suite, world)
    return rows


def _world_rows(suite, world: int) -> list[Row]:
    variant, first = _variant(world), suite.scale_worlds[0]
    def reference(case):
        return None if world == first else (case, _variant(first))
    cases = {"raw": f"{suite.scale_ops} ops + 1 read, workers running",
             "paused": f"{suite.scale_ops} ops issued, workers paused",
             "read_r": "read of a ready (1,) R tensor", "read_s0": f"read of a ready {SHAPE} S(0) tensor",
             "idle": "idle pool (heartbeats only)"}
    measured: dict = {}

    def raw_row() -> Row:
        measured.update(measure_in_subprocess(world, suite.scale_ops, suite.reps, suite.scale_idle_s,
                                              suite.process_timeout_s))
        net = median(measured["net_cpu_per_op"])
        return Row(NAME, cases["raw"], variant, "op", measured["cpu_per_op"], reference=reference(cases["raw"]),
                   note=f"{_thread_note(measured, '')}; net of heartbeats {1e6 * net:.1f} us/op; "
                        f"wall {1e6 * median(measured['wall_per_op']):.0f} us/op; "
                        f"each worker's CPU {1e6 * median(measured['worker_cpu_per_op']):.1f} us/op")

    rows = [guarded(raw_row, NAME, cases["raw"], variant, "op")]
    if not measured:
        return rows
    rows.append(Row(NAME, cases["paused"], variant, "op", measured["paused_issue_cpu_per_op"],
                    reference=reference(cases["paused"]), note=_thread_note(measured, "paused_")))
    for key in ("read_r", "read_s0"):
        rows.append(Row(NAME, cases[key], variant, "read", measured[f"{key}_cpu_s"], reference=reference(cases[key]),
                        note=f"round trip {1e3 * median(measured[f'{key}_wall_s']):.2f} ms; "
                             f"{1e6 * median(measured[f'{key}_cpu_s']) / world:.0f} us CPU per rank"))
    rows.append(Row(NAME, cases["idle"], variant, "idle second", [measured["idle_cpu_per_s"]],
                    reference=reference(cases["idle"]), note=_idle_note(measured)))
    return rows


def _variant(world: int) -> str:
    return f"dtorch, {world} worker{'s' if world > 1 else ''}"


def _thread_note(measured: dict, prefix: str) -> str:
    parts = ", ".join(f"{name} {1e6 * median(measured[f'{prefix}{name}_cpu_per_op']):.1f}" for name in THREADS)
    return f"CPU us/op by thread: {parts}"


def _idle_note(measured: dict) -> str:
    return (f"{measured['heartbeats_per_s']:.0f} heartbeats/s, "
            f"{1e6 * measured['idle_cpu_per_s'] / max(measured['heartbeats_per_s'], 1e-9):.0f} us CPU each; "
            f"loop thread {1e3 * measured['idle_thread_cpu_per_s']['loop']:.1f} ms/s, "
            f"zmq {1e3 * measured['idle_thread_cpu_per_s']['zmq']:.1f} ms/s")


def measure_in_subprocess(world: int, ops: int, reps: int, idle_s: float, timeout_s: float) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-m", "benchmarks.controller_scale", str(world), str(ops), str(reps),
                             str(idle_s)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    if result.returncode != 0:
        raise RuntimeError(f"measuring {world} workers failed: {result.stderr.strip().splitlines()[-1:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


# --- in the measuring process --------------------------------------------------------------------
class ThreadClocks:
    """CPU seconds so far of this process's threads, grouped: the user's (main) thread, the
    controller's loop thread, ZeroMQ's I/O threads, and every other thread (Linux /proc). Call
    it from the main thread: its own clock is read after the others in `start` and before them
    in `stop`, so reading ~2 files per thread (130 at 64 workers) is not charged to it."""

    def __init__(self, loop_thread: threading.Thread):
        self._user, self._loop = threading.main_thread().native_id, loop_thread.native_id

    def start(self) -> dict:
        found = self._others()
        found["user"] = time.thread_time()
        return found

    def stop(self, started: dict) -> dict:
        """CPU seconds of each group since `started`."""
        user = time.thread_time()
        found = dict(self._others(), user=user)
        # A thread that ended between the readings (other) can make its group's delta negative.
        return {name: max(0.0, found[name] - started[name]) for name in THREADS}

    def _others(self) -> dict:
        found = dict.fromkeys(THREADS, 0.0)
        for tid in os.listdir("/proc/self/task"):
            if int(tid) == self._user:
                continue
            try:
                seconds = thread_cpu_seconds("self", tid)
                with open(f"/proc/self/task/{tid}/comm") as comm:
                    name = comm.read()
            except OSError:   # the thread ended meanwhile
                continue
            group = "loop" if int(tid) == self._loop else "zmq" if name.startswith("ZMQbg") else "other"
            found[group] += seconds
        return found


def measure(world: int, ops: int, reps: int, idle_s: float, reads: int = 20) -> dict:
    """Start `world` workers in this process's session, then time the program `reps` times
    with the workers running, `reps` times with them paused while it is issued, and `reads`
    reads of ready tensors; then idle."""
    import dtorch
    from dtorch.spec.placements import Replicate, Shard, init_device_mesh
    from dtorch.runtime.controller import session

    from .chain import run_chain
    dtorch.init(num_workers=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        clocks = ThreadClocks(session.controller()._thread)
        z = dtorch.zeros(*SHAPE, device_mesh=mesh, placements=[Shard(0)])
        run_chain(z, ops).to_torch()   # warm-up: caches, the first command's Gloo connect
        found: dict = collections.defaultdict(list)
        pids = [worker["pid"] for worker in dtorch.workers()]
        for _ in range(reps):
            _program_once(mesh, ops, clocks, pids, found)
        for _ in range(reps):
            _issue_paused(mesh, ops, clocks, pids, found)
        for name, placement, shape in (("read_s0", Shard(0), SHAPE), ("read_r", Replicate(), (1,))):
            ready = dtorch.zeros(*shape, device_mesh=mesh, placements=[placement])
            dtorch.synchronize()
            for _ in range(reads):
                _read_once(ready, clocks, name, found)
        found = dict(found)
        found.update(idle_cost(clocks, idle_s))
        found["net_cpu_per_op"] = [cpu - found["idle_cpu_per_s"] * wall
                                   for cpu, wall in zip(found["cpu_per_op"], found["wall_per_op"])]
        return found
    finally:
        dtorch.shutdown()


def _program_once(mesh, ops: int, clocks: ThreadClocks, pids: list, found: dict) -> None:
    """The program with the workers running: all in, on this machine. Also the workers' own
    CPU per op (each decodes and runs every command of its mesh), their mean."""
    import dtorch
    from dtorch.spec.placements import Shard

    from .chain import run_chain
    z = dtorch.zeros(*SHAPE, device_mesh=mesh, placements=[Shard(0)])
    dtorch.synchronize()
    workers_cpu = sum(map(cpu_seconds, pids))
    threads, cpu, wall = clocks.start(), time.process_time(), time.perf_counter()
    z = run_chain(z, ops)
    issued = time.perf_counter()
    z.to_torch()
    done = time.perf_counter()
    found["cpu_per_op"].append((time.process_time() - cpu) / ops)
    found["worker_cpu_per_op"].append((sum(map(cpu_seconds, pids)) - workers_cpu) / ops / len(pids))
    for name, seconds in clocks.stop(threads).items():
        found[f"{name}_cpu_per_op"].append(seconds / ops)
    found["wall_per_op"].append((done - wall) / ops)
    found["read_s"].append(done - issued)


def _issue_paused(mesh, ops: int, clocks: ThreadClocks, pids: list, found: dict) -> None:
    """Issue the ops while every worker is stopped (SIGSTOP): on this 2-core machine 64 running
    workers would take the cores from the controller, and a cluster's workers have cores of
    their own. Stopped workers send no heartbeats either, so this is the cost of the ops alone:
    planning, queueing, publishing, and ZeroMQ writing each subscriber its copy (the commands
    wait in the sockets' queues). The workers resume (SIGCONT) and catch up before the next one."""
    import dtorch
    from dtorch.spec.placements import Shard

    from .chain import run_chain
    z = dtorch.zeros(*SHAPE, device_mesh=mesh, placements=[Shard(0)])
    dtorch.synchronize()
    _signal_all(pids, signal.SIGSTOP)
    try:
        threads, cpu, wall = clocks.start(), time.process_time(), time.perf_counter()
        z = run_chain(z, ops)
        issued = time.perf_counter()
        time.sleep(PUBLISHED_S)   # the last batch leaves after a short idle: count its publishing
        found["paused_issue_cpu_per_op"].append((time.process_time() - cpu) / ops)
        found["paused_issue_wall_per_op"].append((issued - wall) / ops)
        for name, seconds in clocks.stop(threads).items():
            found[f"paused_{name}_cpu_per_op"].append(seconds / ops)
    finally:
        _signal_all(pids, signal.SIGCONT)
    z.to_torch()


def _signal_all(pids: list, number: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, number)
        except ProcessLookupError:
            pass


def _read_once(tensor, clocks: ThreadClocks, name: str, found: dict) -> None:
    """One read of a ready tensor: its round trip, and the controller CPU it took."""
    cpu, wall = time.process_time(), time.perf_counter()
    tensor.to_torch()
    found[f"{name}_wall_s"].append(time.perf_counter() - wall)
    found[f"{name}_cpu_s"].append(time.process_time() - cpu)


def idle_cost(clocks: ThreadClocks, idle_s: float) -> dict:
    """CPU per second while nothing is issued: heartbeats in, pongs out, the watch task. Every
    message the controller sends while idle is a pong, one per heartbeat it handled."""
    import dtorch
    time.sleep(min(1.0, idle_s))   # let the last read's stragglers settle
    before, threads, cpu, wall = dtorch.stats(), clocks.start(), time.process_time(), time.perf_counter()
    time.sleep(idle_s)
    seconds, after = time.perf_counter() - wall, dtorch.stats()
    by_thread = clocks.stop(threads)
    return {"idle_cpu_per_s": (time.process_time() - cpu) / seconds,
            "idle_thread_cpu_per_s": {name: value / seconds for name, value in by_thread.items()},
            "heartbeats_per_s": (after["messages_sent"] - before["messages_sent"]) / seconds,
            "heartbeat_bytes_in_per_s": (after["bytes_received"] - before["bytes_received"]) / seconds}


if __name__ == "__main__":
    world_arg, ops_arg, reps_arg, idle_arg = sys.argv[1:5]
    print(json.dumps(measure(int(world_arg), int(ops_arg), int(reps_arg), float(idle_arg))))

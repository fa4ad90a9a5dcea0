"""`with dtorch.profile("trace.json"):` -- turn recording on in this process and on every worker,
align the workers' clocks to this one, and on the way out collect everything into one trace.

Start: a few Profile(on) commands: the first turns the workers' recording on, every one is a
clock ping, and the one with the shortest round trip gives each worker's offset. Stop: the same
pings again (the drift is the change in offset), then Profile(off), whose replies carry every
command the workers ran in between. Both travel in the command stream, so the workers record
exactly the commands issued inside the block, whenever they run them.
"""
from __future__ import annotations

import json
import os
import warnings

from ..errors import DTorchError
from ..runtime.controller import profiling, session
from .trace import Clock, WorkerRecording, build_trace

__all__ = ["profile"]

PINGS = 5   # clock pings at each end; the shortest round trip wins


class profile:
    """Record a Chrome / Perfetto trace of everything dtorch does inside the block: this
    process's op issues, flushes, reads, inserted redistributes, backward and optimizer steps,
    and every worker's commands with their collectives (bytes sent, time waiting on peers).

        with dtorch.profile("trace.json") as prof:
            loss = model(x).sum(); loss.backward(); optimizer.step()
        print(dtorch.profile.summarize(prof.trace))    # or python -m dtorch.profile summarize trace.json

    `path`: where the JSON goes when the block ends (default None: only `prof.trace`). The trace
    is written even when the block raises. `timeout_s`: how long the clock pings at each end wait
    for every worker (default 120 s). Needs a running session (a mesh, or dtorch.init()).
    Workers that join the pool inside the block are not recorded."""

    def __init__(self, path: str | os.PathLike | None = None, timeout_s: float = 120.0):
        self.path, self.timeout_s = path, timeout_s
        self.trace: dict | None = None

    def __enter__(self) -> profile:
        if profiling.active is not None:
            raise DTorchError("dtorch.profile: a profile is already recording in this process; "
                              "end it before starting another (profiles do not nest)")
        self.controller = _running_session()
        self.recorder = profiling.ControllerRecorder()
        try:
            self.start_readings = _best_pings(self.controller, self.timeout_s)   # the first turns recording on
        except BaseException:
            _stop_quietly(self.controller)
            raise
        self.start_ns = profiling.now()
        profiling.active = self.recorder
        return self

    def __exit__(self, error_type, error, tb) -> bool:
        profiling.active = None
        stop_ns = profiling.now()
        workers, problem = {}, None
        try:
            workers = self._collect_workers()
        except Exception as failure:  # a lost worker, an ended session: still write what this process saw
            problem = f"no worker's commands: {type(failure).__name__}: {failure}"
        lost = sorted(set(self.start_readings) - set(workers))
        if lost and problem is None:
            problem = f"rank(s) {lost} were lost during the profile: their commands are not in the trace"
        self.trace = build_trace(self.recorder, self.start_ns, stop_ns, workers, self.controller.sites.command_site,
                                 problem)
        if self.path is not None:
            with open(self.path, "w") as file:
                json.dump(self.trace, file)
        if problem is not None:
            warnings.warn(f"dtorch.profile: part of the trace is missing: {problem}", RuntimeWarning, stacklevel=2)
        return False

    def _collect_workers(self) -> dict[int, WorkerRecording]:
        try:
            end_readings = _best_pings(self.controller, self.timeout_s)
        except BaseException:
            _stop_quietly(self.controller)
            raise
        final = profiling.ping_workers(self.controller, False, self.timeout_s)
        return {rank: WorkerRecording(rank, _label(self.controller, rank), reading.payload[1],
                                      Clock.between(self.start_readings[rank], end_readings[rank]))
                for rank, reading in final.items() if rank in self.start_readings and rank in end_readings}


def _running_session():
    try:
        return session.controller()
    except DTorchError:
        raise DTorchError("dtorch.profile needs a running session to record its workers (none started yet, or "
                          "dtorch.shutdown() ended it): build a mesh (init_device_mesh) or call dtorch.init() "
                          "before the `with` block") from None


def _best_pings(controller, timeout_s: float) -> dict[int, profiling.ClockReading]:
    """Per rank, the clock reading of the shortest round trip among PINGS."""
    best: dict[int, profiling.ClockReading] = {}
    for _ in range(PINGS):
        for rank, reading in profiling.ping_workers(controller, True, timeout_s).items():
            if rank not in best or reading.round_trip < best[rank].round_trip:
                best[rank] = reading
    return best


def _stop_quietly(controller) -> None:
    """Turn the workers' recording off without waiting for them (after a failed ping: a
    worker lost, a timeout), so none keeps recording after the profile."""
    try:
        profiling.ping_workers(controller, False, timeout=None, wait=False)
    except Exception:  # the session itself has ended: its workers went with it
        pass


def _label(controller, rank: int) -> str:
    worker = controller.workers.get(rank)
    if worker is None:
        return f"rank {rank}"
    return f"rank {rank} ({worker.device}, {worker.host}, pid {worker.pid})"

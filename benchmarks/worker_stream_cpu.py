"""A worker's own CPU per phase of benchmark 10's training step (forward, backward, AdamW), alone:
the commands one worker receives during real steps are recorded, then replayed into a Worker in
this process, phase by phase, in turns with transformers' same phase in the same process.

    PYTHONPATH=<checkout> python benchmarks/worker_stream_cpu.py [--batch 2] [--steps 16] [--compiled]

With --compiled the steps are benchmark 10's `dtorch.compile`d step (llama_train.compiled_step):
one RunGraph command per step, so the phases are not apart and the row is the whole step.

In a live session the worker shares the cores with the controller, which wakes it ~16 times a
forward and evicts its caches in between; on a shared VM the host steals time as well. Here the
stream runs back to back on one thread with nothing else running, so the difference from torch
is what the worker itself adds: decoding, the per-command path, dtorch's kernels. The default
batch (2 of benchmark 10's 8 rows) is a dp4 worker's share.

Recording: a 1-worker session runs the steps while the controller's PUB socket is wrapped to
keep a copy of every message for rank 0 (broadcast and private topics). The in-process Worker
gets a one-member Gloo communicator, so the backward's collectives run as on a 1-worker mesh.
Standalone (absolute imports only), so that one copy measures either checkout: run it
alternately with PYTHONPATH on the commit before and after a change.
"""
from __future__ import annotations

import argparse
import resource
import statistics
import time

PHASES = ("forward", "backward", "AdamW step + zero_grad")
WHOLE_STEP = "whole step (compiled)"
WARMUP_STEPS = 4


class _Replies:
    """The in-process worker's socket: keeps the error replies (a replay that fails measures nothing)."""

    def __init__(self, wire) -> None:
        self.wire, self.errors = wire, []

    def send(self, frames) -> None:
        header = bytes(frames[0])
        if b"Traceback" in header:
            self.errors.append(header[:400])


def record(batch: int, steps: int, compiled: bool):
    """(messages for rank 0, [(phase, index after it)], transformers' model, the batch)."""
    import dtorch
    from dtorch.models import LlamaForCausalLM
    from dtorch.runtime import protocol as wire
    from dtorch.runtime import transport

    from benchmarks.config import QUICK
    from benchmarks.dp_step_cpu import _fields
    from benchmarks.llama_train import _reference, compiled_step
    reference, ids = _reference(_fields(), QUICK)
    ids = ids[:batch]
    recorded, publish = [], transport.ControllerSockets.publish
    ours = (wire.TOPIC_ALL, wire.topic_for_rank(0))

    def keeping(sockets, frames, copy=True):
        if bytes(frames[0]) in ours:
            recorded.append([bytes(frame) for frame in frames])
        return publish(sockets, frames, copy)
    transport.ControllerSockets.publish = keeping
    try:
        dtorch.init(num_workers=1)
        mesh = dtorch.init_device_mesh("cpu", (1,), mesh_dim_names=["dp"])
        model = LlamaForCausalLM(reference.config, device_mesh=mesh)
        model.load_state_dict(reference.state_dict())
        optimizer = dtorch.optim.AdamW(model.parameters(), lr=1e-3)
        dtorch.synchronize()
        marks = [("set-up", len(recorded))]
        if compiled:
            step, uploaded = compiled_step(model, optimizer), model._upload(ids)
            for _ in range(steps):
                step(uploaded)
                dtorch.synchronize()
                marks.append((WHOLE_STEP, len(recorded)))
            return recorded, marks, reference, ids
        for _ in range(steps):
            loss = model(ids, labels=ids).loss
            dtorch.synchronize()
            marks.append((PHASES[0], len(recorded)))
            loss.backward()
            dtorch.synchronize()
            marks.append((PHASES[1], len(recorded)))
            optimizer.step()
            optimizer.zero_grad()
            dtorch.synchronize()
            marks.append((PHASES[2], len(recorded)))
    finally:
        dtorch.shutdown()
        transport.ControllerSockets.publish = publish
    return recorded, marks, reference, ids


def in_process_worker(recorded: list):
    import torch.distributed as dist
    from dtorch.runtime import protocol as wire
    from dtorch.runtime.devices.comm import GlooCommunicator
    from dtorch.runtime.devices.device import CpuDevice
    from dtorch.runtime.worker.worker import _ON_COMMAND_SOCKET, Worker
    first = next(wire.decode(frames[1], _ON_COMMAND_SOCKET) for frames in recorded
                 if type(wire.decode(frames[1], _ON_COMMAND_SOCKET)) is wire.Batch)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True)
    comm = GlooCommunicator(f"127.0.0.1:{store.port}", 0, "127.0.0.1", 60)
    replies = _Replies(wire)
    return Worker(0, replies, comm, CpuDevice(), start_seq=first.first_seq), replies, store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2, help="rows of benchmark 10's batch of 8")
    parser.add_argument("--steps", type=int, default=16, help="steps recorded (the first 4 warm up)")
    parser.add_argument("--compiled", action="store_true", help="the dtorch.compile'd step, as one phase")
    args = parser.parse_args()
    if args.steps <= WARMUP_STEPS:
        parser.error(f"--steps must be more than the {WARMUP_STEPS} warm-up steps")
    import torch
    import zmq
    torch.set_num_threads(1)
    recorded, marks, reference, ids = record(args.batch, args.steps, args.compiled)
    worker, replies, _store = in_process_worker(recorded)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    torch.set_grad_enabled(False)   # as in a worker process: only commands that say `grad` record

    def replay(start: int, end: int) -> tuple:
        started, faults = time.thread_time(), _faults()
        for frames in recorded[start:end]:
            worker._on_message([zmq.Frame(frame) for frame in frames])
        return time.thread_time() - started, _faults() - faults

    def torch_step() -> list:
        with torch.enable_grad():
            marks = [(time.thread_time(), _faults())]
            loss = reference(ids, labels=ids).loss
            marks.append((time.thread_time(), _faults()))
            loss.backward()
            marks.append((time.thread_time(), _faults()))
            optimizer.step()
            optimizer.zero_grad()
            marks.append((time.thread_time(), _faults()))
        return [(t1 - t0, f1 - f0) for (t0, f0), (t1, f1) in zip(marks, marks[1:])]

    phases = (WHOLE_STEP,) if args.compiled else PHASES
    ours = {phase: [] for phase in phases}
    theirs = {phase: [] for phase in phases}
    start = 0
    for phase, end in marks:
        measured = replay(start, end)
        start = end
        if phase == phases[-1]:   # a whole step replayed: torch's step, in turn
            times = torch_step()
            if args.compiled:
                times = [(sum(t for t, _ in times), sum(f for _, f in times))]
            for name, value in zip(phases, times):
                theirs[name].append(value)
        if phase in ours:
            ours[phase].append(measured)
    if replies.errors:
        raise SystemExit(f"the replayed stream failed on the in-process worker: {replies.errors[0]!r}")
    import dtorch
    print(dtorch.__file__.rsplit("/dtorch/", 1)[0])   # which checkout this measured
    print(f"batch {args.batch} x {ids.shape[1]} tokens, {len(ours[phases[0]]) - WARMUP_STEPS} steps "
          f"(CPU ms, median / min, and minor page faults, median; {len(recorded)} messages recorded)")
    for phase in phases:
        mine, torch_ = ours[phase][WARMUP_STEPS:], theirs[phase][WARMUP_STEPS:]
        seconds, faults = [t for t, _ in mine], [f for _, f in mine]
        torch_seconds, torch_faults = [t for t, _ in torch_], [f for _, f in torch_]
        added = statistics.median(seconds) - statistics.median(torch_seconds)
        print(f"  {phase:24s} worker {statistics.median(seconds) * 1e3:6.1f} / {min(seconds) * 1e3:6.1f} "
              f"({statistics.median(faults):6.0f} faults)   torch {statistics.median(torch_seconds) * 1e3:6.1f} / "
              f"{min(torch_seconds) * 1e3:6.1f} ({statistics.median(torch_faults):6.0f} faults)   "
              f"added {added * 1e3:+5.1f} ms")


def _faults() -> int:
    """Minor page faults of this thread so far (pages touched for the first time)."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


if __name__ == "__main__":
    main()

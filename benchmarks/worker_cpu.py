"""A worker's own CPU time per small command, for A/B runs of two checkouts: a Worker in this
process, with no sockets, runs batches of the commands benchmark 1's chain sends (`z * 1.0001`,
`+ 1`, a Free per 16 dropped tensors) as its loop receives them (`Worker._on_message`), against
the same chain in plain torch. The difference is what each worker adds per op; on a 2-core
machine with 4 workers it is what stretches the end-to-end chain (benchmark 2).

    PYTHONPATH=<checkout> python benchmarks/worker_cpu.py [--reps 7]

Standalone (no relative imports), so that one copy measures either checkout: run it
alternately with PYTHONPATH on the commit before and after a change. Prints the minimum over
repetitions of 4,000 ops (a drifting machine only raises it) for the worker, plain torch, and
decoding the batch alone.
"""
from __future__ import annotations

import argparse
import time

OPS = 4_000
SHAPE = (64, 128)


class _NoReplies:
    """The worker's socket, for commands that send nothing back."""

    def send(self, frames) -> None:
        pass


def chain_commands(wire, first_seq: int, first_id: int) -> tuple[list, int]:
    """(the chain's commands from `first_seq`, reading tensor `first_id`; the last id made)."""
    commands, seq, previous, dropped = [], first_seq, first_id, []
    for i in range(OPS):
        op, scalar = ("mul", 1.0001) if i % 2 == 0 else ("add", 1)
        made = previous + 1
        commands.append(wire.RunOp(seq, (made,), 0, op, op, (wire.TensorRef(previous), scalar), {}, (), False))
        seq, previous = seq + 1, made
        dropped.append(made - 1)
        if len(dropped) == 16:
            commands.append(wire.Free(seq, tuple(dropped)))
            seq, dropped = seq + 1, []
    return commands, previous


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    import torch
    import zmq
    import dtorch
    from dtorch.runtime import protocol as wire
    from dtorch.runtime.devices import CpuDevice
    from dtorch.runtime.worker import Worker
    worker = Worker(0, _NoReplies(), None, CpuDevice(), start_seq=0)
    worker._execute(wire.DefineMesh(0, 0, "cpu", (1,), (0,)))
    worker._execute(wire.Factory(1, 1, 0, "zeros", SHAPE, "float32", (wire.decode_placement(0),), ()))
    worker.next_seq, last_id = 2, 1
    on_worker, in_torch, decoding = [], [], []
    for _ in range(args.reps + 1):   # the first warms up
        commands, made = chain_commands(wire, worker.next_seq, last_id)
        frames = wire.encode_batch(worker.next_seq, commands)
        started = time.thread_time()
        wire.decode_batch(wire.Batch(worker.next_seq, len(commands)), frames[2])
        decoding.append(time.thread_time() - started)
        started = time.thread_time()
        worker._on_message([zmq.Frame(f) for f in frames])
        on_worker.append(time.thread_time() - started)
        last_id = made
        z = torch.zeros(SHAPE)
        started = time.thread_time()
        for _ in range(OPS // 2):
            z = z * 1.0001 + 1
        in_torch.append(time.thread_time() - started)
    where = dtorch.__file__.rsplit("/dtorch/", 1)[0]
    worker_us, torch_us = min(on_worker[1:]) / OPS * 1e6, min(in_torch[1:]) / OPS * 1e6
    print(f"{where}  worker {worker_us:.2f} us/op, plain torch {torch_us:.2f}: {worker_us - torch_us:.2f} us/op "
          f"added; decoding alone {min(decoding[1:]) / OPS * 1e6:.2f} us/op")


if __name__ == "__main__":
    main()

"""A worker's own CPU time per small command, for A/B runs of two checkouts: a Worker in this
process, with no sockets, runs batches of the commands benchmark 1's chain sends (`z * 1.0001`,
`+ 1`, a Free per 16 dropped tensors) as its loop receives them (`Worker._on_message`), against
the same chain in plain torch. The difference is what each worker adds per op; on a 2-core
machine with 4 workers it is what stretches the end-to-end chain (benchmark 2).

    PYTHONPATH=<checkout> python benchmarks/worker_cpu.py [--reps 7]

Standalone (no relative imports), so that one copy measures either checkout: run it
alternately with PYTHONPATH on the commit before and after a change. Prints the minimum over
repetitions of 4,000 ops (a drifting machine only raises it) for the worker, plain torch, and
decoding the batch alone; then the same ops as replays of a captured 100-op graph (dtorch.compile's
RunGraph), against the same plain torch.
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


GRAPH_OPS = 100
CAPTURED_INPUT = 1_000_000   # the capture's own ids, far from the eager chain's


def chain_graph(wire, define_seq: int, graph_id: int):
    """A DefineGraph of GRAPH_OPS chain ops with their Frees, as dtorch.compile records run_chain(z, 100):
    the intermediates it drops are freed in the rows and named again as scratch."""
    rows, previous, dropped = [], CAPTURED_INPUT, []
    for i in range(GRAPH_OPS):
        op, scalar = ("mul", 1.0001) if i % 2 == 0 else ("add", 1)
        rows.append(wire.command_row(wire.RunOp(len(rows), (previous + 1,), 0, op, op,
                                                (wire.TensorRef(previous), scalar), {}, (), False)))
        previous += 1
        if previous - 1 > CAPTURED_INPUT:
            dropped.append(previous - 1)
        if len(dropped) == 16:
            rows.append(wire.command_row(wire.Free(len(rows), tuple(dropped))))
            dropped = []
    scratch = tuple(range(CAPTURED_INPUT + 1, previous))
    return wire.DefineGraph(define_seq, graph_id, tuple(rows), (CAPTURED_INPUT,), (previous,), scratch, (), ())


def replay_commands(wire, first_seq: int, first_id: int, define_seq: int, graph_id: int,
                    rows: int) -> tuple[list, int]:
    """OPS ops as RunGraph commands of a graph of `rows` rows, each reading the last one's output
    (freed after it)."""
    commands, seq, previous = [], first_seq, first_id
    for _ in range(OPS // GRAPH_OPS):
        commands.append(wire.RunGraph(seq, graph_id, rows, (previous,), (previous + 1,), 0, 0, (), define_seq))
        commands.append(wire.Free(seq + rows, (previous,)))
        seq, previous = seq + rows + 1, previous + 1
    return commands, previous


def _time_batch(worker, wire, zmq, commands) -> float:
    frames = wire.encode_batch(worker.next_seq, commands)
    started = time.thread_time()
    worker._on_message([zmq.Frame(f) for f in frames])
    return time.thread_time() - started


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
    graph = chain_graph(wire, worker.next_seq, 1)
    worker._on_message([zmq.Frame(f) for f in wire.encode_batch(worker.next_seq, [graph])])
    define_seq = worker.next_seq - 1
    on_worker, replayed, in_torch, decoding = [], [], [], []
    for _ in range(args.reps + 1):   # the first warms up; the measurements in turn
        commands, made = chain_commands(wire, worker.next_seq, last_id)
        body = wire.encode_batch(worker.next_seq, commands)[2]
        started = time.thread_time()
        wire.decode_batch(wire.Batch(worker.next_seq, len(commands)), body)
        decoding.append(time.thread_time() - started)
        on_worker.append(_time_batch(worker, wire, zmq, commands))
        commands, last_id = replay_commands(wire, worker.next_seq, made, define_seq, 1, len(graph.rows))
        replayed.append(_time_batch(worker, wire, zmq, commands))
        z = torch.zeros(SHAPE)
        started = time.thread_time()
        for _ in range(OPS // 2):
            z = z * 1.0001 + 1
        in_torch.append(time.thread_time() - started)
    where = dtorch.__file__.rsplit("/dtorch/", 1)[0]
    worker_us, torch_us = min(on_worker[1:]) / OPS * 1e6, min(in_torch[1:]) / OPS * 1e6
    print(f"{where}  worker {worker_us:.2f} us/op, plain torch {torch_us:.2f}: {worker_us - torch_us:.2f} us/op "
          f"added; decoding alone {min(decoding[1:]) / OPS * 1e6:.2f} us/op; replayed "
          f"{min(replayed[1:]) / OPS * 1e6:.2f} us/op: {min(replayed[1:]) / OPS * 1e6 - torch_us:.2f} us/op added")


if __name__ == "__main__":
    main()

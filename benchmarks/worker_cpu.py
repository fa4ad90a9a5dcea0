"""A worker's own CPU time per small command, for A/B runs of two checkouts: a Worker in this
process, with no sockets, runs batches of the commands benchmark 1's chain sends (`z * 1.0001`,
`+ 1`, a Free per 16 dropped tensors) as its loop receives them (`Worker._on_message`), against
the same chain in plain torch. The difference is what each worker adds per op; on a 2-core
machine with 4 workers it is what stretches the end-to-end chain (benchmark 2).

    PYTHONPATH=<checkout> python benchmarks/worker_cpu.py [--reps 7] [--grad]

--grad: the chain records for backward, as a training forward's ops do (its input requires grad,
every RunOp has `grad` set; torch's chain records too). Only the eager rows run then.

Standalone (no relative imports), so that one copy measures either checkout: run it
alternately with PYTHONPATH on the commit before and after a change. Prints the minimum over
repetitions of 4,000 ops (a drifting machine only raises it) for the worker, the same ops as
replays of a captured 100-op graph (dtorch.compile's RunGraph), decoding the batch alone, and
plain torch, taken in turns. On a checkout whose workers run a graph of plain ops as one
generated function (runtime/worker/straight_line.py), the replay is also measured row by row; on one
whose workers run plain ops inline (Worker._ran_inline), the worker rows are also measured with
every command on the general path (replays row by row, or as the function where there is one),
in the same turns: A/Bs of those steps within one process.
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


def chain_commands(wire, first_seq: int, first_id: int, grad: bool = False) -> tuple[list, int]:
    """(the chain's commands from `first_seq`, reading tensor `first_id`; the last id made)."""
    commands, seq, previous, dropped = [], first_seq, first_id, []
    for i in range(OPS):
        op, scalar = ("mul", 1.0001) if i % 2 == 0 else ("add", 1)
        made = previous + 1
        commands.append(wire.RunOp(seq, (made,), 0, op, op, (wire.TensorRef(previous), scalar), {}, (), grad))
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
    parser.add_argument("--grad", action="store_true", help="ops that record for backward (eager rows only)")
    args = parser.parse_args()
    import torch
    import zmq
    import dtorch
    from dtorch.runtime import protocol as wire
    from dtorch.runtime.devices.device import CpuDevice
    from dtorch.runtime.worker.worker import Worker
    worker = Worker(0, _NoReplies(), None, CpuDevice(), start_seq=0)
    worker._execute(wire.DefineMesh(0, 0, "cpu", (1,), (0,)))
    worker._execute(wire.Factory(1, 1, 0, "zeros", SHAPE, "float32", (wire.decode_placement(0),), ()))
    worker.tensors[1].requires_grad_(args.grad)
    worker.next_seq, last_id = 2, 1
    graph = chain_graph(wire, worker.next_seq, 1)
    worker._on_message([zmq.Frame(f) for f in wire.encode_batch(worker.next_seq, [graph])])
    define_seq, last = worker.next_seq - 1, [last_id]

    def eager() -> float:
        commands, last[0] = chain_commands(wire, worker.next_seq, last[0], args.grad)
        return _time_batch(worker, wire, zmq, commands)

    def replayed() -> float:
        commands, last[0] = replay_commands(wire, worker.next_seq, last[0], define_seq, 1, len(graph.rows))
        return _time_batch(worker, wire, zmq, commands)

    def decoding() -> float:
        commands, _ = chain_commands(wire, worker.next_seq, last[0])
        body = wire.encode_batch(worker.next_seq, commands)[2]
        started = time.thread_time()
        wire.decode_batch(wire.Batch(worker.next_seq, len(commands)), body)
        return time.thread_time() - started

    def plain_torch() -> float:
        z = torch.zeros(SHAPE, requires_grad=args.grad)
        started = time.thread_time()
        for _ in range(OPS // 2):
            z = z * 1.0001 + 1
        return time.thread_time() - started

    measures = {"worker, eager": eager} if args.grad else {"worker, eager": eager, "worker, replayed": replayed}
    if not args.grad and getattr(_graphs(worker)[1], "plan", None) is not None:   # the replay as one generated function
        measures["worker, replayed row by row"] = _row_by_row(worker, 1, replayed)
    if hasattr(Worker, "_ran_inline"):   # the same worker with every command on the general path
        measures.update({f"{name}, general path only": _general_path_only(worker, measure)
                         for name, measure in list(measures.items())})
    measures.update({"decoding alone": decoding, "plain torch": plain_torch})
    samples = {name: [] for name in measures}
    for _ in range(args.reps + 1):   # the first warms up; the measurements in turn
        for name, measure in measures.items():
            samples[name].append(measure())
    best = {name: min(values[1:]) / OPS * 1e6 for name, values in samples.items()}
    print(dtorch.__file__.rsplit("/dtorch/", 1)[0])
    for name, us in best.items():
        added = f"  {us - best['plain torch']:5.2f} us/op added" if name.startswith("worker") else ""
        print(f"  {name:48s} {us:6.2f} us/op{added}")


def _graphs(worker) -> dict:
    """The worker's compiled graphs by id: its GraphCommands' since the Worker owns one, before
    that an attribute of its own."""
    owner = getattr(worker, "graph_commands", worker)
    return owner.graphs


def _row_by_row(worker, graph_id: int, measure):
    graphs = _graphs(worker)

    def measure_row_by_row() -> float:
        graph = graphs[graph_id]
        graphs[graph_id] = graph._replace(plan=None)
        try:
            return measure()
        finally:
            graphs[graph_id] = graph
    return measure_row_by_row


def _general_path_only(worker, measure):
    def measure_on_the_general_path() -> float:
        worker._ran_inline = lambda command: False
        try:
            return measure()
        finally:
            del worker._ran_inline
    return measure_on_the_general_path

if __name__ == "__main__":
    main()

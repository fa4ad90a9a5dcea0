"""A worker's own time around a fused compiled call, in process, for A/B runs of two checkouts:
a Worker with no sockets defines benchmark 1's 100-op chain as a graph with backend "inductor"
(one FusedRun) and runs batches of what the controller sends per call of the fused chain (a
RunGraph, and a Free of the previous call's output), as its loop receives them.

    PYTHONPATH=<checkout> python benchmarks/fused_overhead.py [--reps 50] [--profile]

Prints, per call (the minimum over repetitions of batches of 40 calls, in turns):
- the whole call: decoding, the RunGraph handler and the replay's bookkeeping, the fused run,
  the Free;
- the compiled function alone, called as the FusedRun calls it (inductor's function past dynamo
  where fusion.py found that exact: AOTAutograd's wrapper and inductor's kernel; else
  torch.compile's own call, its guards too);
- the whole call with the fused run replaced by a function that returns its input: what the
  worker adds to the compiled function (docs/design/compile.md, "Where a fused call's time goes").
--profile: cProfile of the whole call afterwards.

Standalone, like worker_cpu.py (whose chain graph it uses): run it alternately with PYTHONPATH
on the commit before and after a change.
"""
from __future__ import annotations

import argparse
import time

from worker_cpu import GRAPH_OPS, OPS, SHAPE, _NoReplies, chain_graph, replay_commands

CALLS = OPS // GRAPH_OPS   # per batch: replay_commands' RunGraphs, each with its Free


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    import torch
    import zmq
    import dtorch
    from dtorch.runtime import protocol as wire
    from dtorch.runtime.devices.device import CpuDevice
    from dtorch.runtime.worker.worker import Worker
    torch.set_grad_enabled(False)   # as a worker's loop runs
    worker = Worker(0, _NoReplies(), None, CpuDevice(), start_seq=0)
    worker._execute(wire.DefineMesh(0, 0, "cpu", (1,), (0,)))
    worker._execute(wire.Factory(1, 1, 0, "zeros", SHAPE, "float32", (wire.decode_placement(0),), ()))
    worker.next_seq = 2
    graph = chain_graph(wire, worker.next_seq, 1)._replace(backend="inductor")
    worker._on_message([zmq.Frame(f) for f in wire.encode_batch(worker.next_seq, [graph])])
    define_seq, last = worker.next_seq - 1, [1]

    def calls() -> float:
        commands, last[0] = replay_commands(wire, worker.next_seq, last[0], define_seq, 1, len(graph.rows))
        frames = [zmq.Frame(f) for f in wire.encode_batch(worker.next_seq, commands)]
        started = time.perf_counter()
        worker._on_message(frames)
        return (time.perf_counter() - started) / CALLS

    calls()   # the first replay compiles
    fused = next(step for step in worker.graph_commands.graphs[1].plan if type(step) is not int)
    # what the FusedRun calls: inductor's function past dynamo where that is exact, else torch.compile's
    compiled = getattr(fused, "unguarded", None) or fused.compiled

    def compiled_alone() -> float:
        x = worker.tensors[last[0]]
        started = time.perf_counter()
        for _ in range(CALLS):
            x = compiled(x)[0]
        return (time.perf_counter() - started) / CALLS

    def stubbed() -> float:
        guarded, unguarded = fused.compiled, getattr(fused, "unguarded", None)
        fused.compiled = lambda x: (x,)
        if unguarded is not None:
            fused.unguarded = fused.compiled
        try:
            return calls()
        finally:
            fused.compiled = guarded
            if unguarded is not None:
                fused.unguarded = unguarded

    measures = {"whole call (RunGraph + Free)": calls, "compiled function alone": compiled_alone,
                "whole call, fused run stubbed out": stubbed}
    best = {name: float("inf") for name in measures}
    for _ in range(args.reps):
        for name, measure in measures.items():
            best[name] = min(best[name], measure())
    print(dtorch.__file__.rsplit("/dtorch/", 1)[0], f"torch threads {torch.get_num_threads()}")
    for name, seconds in best.items():
        print(f"  {name:36s} {seconds * 1e6:6.2f} us/call")
    if args.profile:
        import cProfile
        import pstats
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.reps):
            calls()
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()

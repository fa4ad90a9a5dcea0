"""Why a read costs several raw round trips on a small VM: the same work costs more right after
its thread slept, and a read wakes more Python than a ping-pong does.

    python -m benchmarks.read_idle [--workers 1 4] [--turns 6] [--reads 40] [--pauses-ms 0 1 10]

Two measurements, each taken after the processes idled for each pause:
  cold code   torch.frombuffer + reshape of 4 bytes, 5 times, right after time.sleep(pause) in this
              process: a few microseconds of Python and torch, the kind of work a read's reply
              does, with no other process involved
  reads       benchmark 3's read (`to_torch()` of a ready (1,) tensor, made and synchronized before
              the pause) on each world size, in turns with the raw pyzmq DEALER/ROUTER round trip
              of the same 4 bytes (benchmarks/zmq_pingpong.py) after the same pause

Benchmark 3 reads right after the synchronize that made the tensor: pause 0 here.
Prints medians (and p90 for the reads); the ratio is dtorch's median over the raw one's.
"""
from __future__ import annotations

import argparse
import sys
import time

from . import dtorch_session
from .fetch import read_fresh_tensor
from .timing import interleaved, median, p90, stopwatch
from .zmq_pingpong import EchoServer


def cold_code_us(pause_s: float, samples: int = 200) -> float:
    """Median microseconds of one frombuffer + reshape, measured after sleeping `pause_s`."""
    import torch
    times = []
    for _ in range(samples):
        if pause_s:
            time.sleep(pause_s)
        elapsed = stopwatch()
        for _ in range(5):
            torch.frombuffer(bytearray(4), dtype=torch.float32).reshape(1)
        times.append(elapsed() / 5)
    return median(times) * 1e6


def _dtorch_reads(dtorch, source, reads: int, pause_s: float):
    return lambda: [read_fresh_tensor(dtorch, source, pause_s) for _ in range(reads)]


def _raw_round_trips(server: EchoServer, reads: int, pause_s: float):
    def measure() -> list[float]:
        samples = []
        for _ in range(reads):
            if pause_s:
                time.sleep(pause_s)
            samples += server.round_trips(1, 4)[-1:]   # (round_trips warms up with one more first)
        return samples
    return measure


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.read_idle", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--reads", type=int, default=40)
    parser.add_argument("--pauses-ms", type=float, nargs="+", default=[0.0, 1.0, 10.0])
    args = parser.parse_args(argv)
    pauses = [ms / 1e3 for ms in args.pauses_ms]
    print("cold code: frombuffer + reshape, median us after sleeping",
          ", ".join(f"{ms:g} ms: {cold_code_us(s):.1f}" for ms, s in zip(args.pauses_ms, pauses)), flush=True)
    import dtorch
    from dtorch.spec.placements import Replicate
    with EchoServer(60.0) as server:
        for world in args.workers:
            mesh = dtorch_session.mesh((world,), ("dp",))
            source = dtorch.ones(1, device_mesh=mesh, placements=[Replicate()])
            measures = {}
            for ms, pause_s in zip(args.pauses_ms, pauses):
                measures[("dtorch", ms)] = _dtorch_reads(dtorch, source, args.reads, pause_s)
                measures[("raw", ms)] = _raw_round_trips(server, args.reads, pause_s)
            samples = interleaved(measures, args.turns)
            for ms in args.pauses_ms:
                mine, raw = ([s for turn in samples[(side, ms)] for s in turn] for side in ("dtorch", "raw"))
                print(f"{world} worker(s), pause {ms:g} ms: dtorch read median {median(mine) * 1e6:.0f} us "
                      f"(p90 {p90(mine) * 1e6:.0f}), raw round trip {median(raw) * 1e6:.0f} us "
                      f"(p90 {p90(raw) * 1e6:.0f}): {median(mine) / median(raw):.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

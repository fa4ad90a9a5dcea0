"""What privacy costs: dispatch and reads of a session on one machine, on each transport.

    python -m benchmarks.transport_modes [--ops 2000] [--reads 200] [--mib 16] [--modes tcp,tcp+curve]

Modes: tcp+curve (controller_address="127.0.0.1": every TCP session's default), tcp (the same with
curve=False), ipc (a private 0700 directory, the default without a controller address),
ipc+curve. Each mode starts its own 2-worker session and reports the median of a few repeats:
  dispatch   µs per op to issue a chain of small adds (the user thread only)
  chain      µs per op including the workers running them (issue + synchronize)
  read 4 B   ms per to_torch() of a ready (1,) tensor: one round trip to the workers
  read N MiB ms per to_torch() of a ready replicated float32 tensor (bytes through the ROUTER)
  MiB/s      N MiB divided by that time: the bandwidth of a large read
docs/design/launcher.md, "Privacy", quotes its figures.
"""
from __future__ import annotations

import argparse
import statistics
import time

MODES = {"tcp+curve": ("127.0.0.1", True), "tcp": ("127.0.0.1", False),
         "ipc": (None, False), "ipc+curve": (None, True)}


def measure(address, curve: bool, ops: int, reads: int, mib: int) -> dict:
    import dtorch
    from dtorch.spec.placements import Replicate, Shard, init_device_mesh
    dtorch.init(num_workers=2, controller_address=address, curve=curve)
    try:
        mesh = init_device_mesh("cpu", (2,))
        z = dtorch.zeros(64, device_mesh=mesh, placements=[Shard(0)])
        dtorch.synchronize()
        issue, total = [], []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(ops):
                z = z + 1
            issued = time.perf_counter()
            dtorch.synchronize()
            issue.append((issued - start) / ops * 1e6)
            total.append((time.perf_counter() - start) / ops * 1e6)
        small = dtorch.ones(1, device_mesh=mesh, placements=[Replicate()])
        big = dtorch.ones(mib * 1 << 18, device_mesh=mesh, placements=[Replicate()])
        big_ms = _read_ms(dtorch, big, max(5, reads // 20))
        return {"dispatch us/op": statistics.median(issue), "chain us/op": statistics.median(total),
                "read 4 B ms": _read_ms(dtorch, small, reads),
                f"read {mib} MiB ms": big_ms, "MiB/s": mib / big_ms * 1e3}
    finally:
        dtorch.shutdown()


def _read_ms(dtorch, source, count: int) -> float:
    samples = []
    for _ in range(count):
        ready = source * 1.0
        dtorch.synchronize()
        start = time.perf_counter()
        ready.to_torch()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=2000)
    parser.add_argument("--reads", type=int, default=200)
    parser.add_argument("--mib", type=int, default=16)
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args()
    for mode in args.modes.split(","):
        row = measure(*MODES[mode], args.ops, args.reads, args.mib)
        print(f"{mode:10s} " + "  ".join(f"{k} {v:8.2f}" for k, v in row.items()), flush=True)


if __name__ == "__main__":
    main()

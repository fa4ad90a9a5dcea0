"""Run by dtorch-launch in the end-to-end tests: a (2,) mesh over the hosts of the hostfile.

Prints ``WORKERS <json>`` (rank, host, pid of every worker), checks an op and a redistribute
against torch, then either shuts down and prints OK, or (with --wait) waits on stdin for a test
to kill it, or (with --lose) waits for one stdin line — the test kills a remote worker meanwhile —
and prints ``LOST <seconds> <message>`` for the read that follows. A failed start prints
``STARTUP <seconds> <message>``. With --cuda the mesh is a "cuda" mesh (one GPU per slot).
"""
import json
import sys
import time

import torch

import dtorch
from dtorch import Replicate, Shard, init_device_mesh


def main() -> None:
    started = time.monotonic()
    try:
        mesh = init_device_mesh("cuda" if "--cuda" in sys.argv else "cpu", (2,))
    except dtorch.StartupError as error:
        print(f"STARTUP {time.monotonic() - started:.1f} {error}", flush=True)
        return
    print("WORKERS " + json.dumps([{k: w[k] for k in ("rank", "host", "pid")} for w in dtorch.workers()]),
          flush=True)
    expected = torch.arange(12.0).reshape(6, 2)
    x = dtorch.tensor(expected, device_mesh=mesh, placements=[Shard(0)])
    y = (x * 3 + x).redistribute(mesh, [Replicate()])
    assert y.placements == (Replicate(),), y.placements
    torch.testing.assert_close(y.to_torch(), expected * 3 + expected)
    if "--lose" in sys.argv:
        print("READY", flush=True)
        sys.stdin.readline()
        lost_at = time.monotonic()
        try:
            (x * 2).to_torch()
            print("LOST never: the read succeeded", flush=True)
        except dtorch.WorkerLostError as error:
            print(f"LOST {time.monotonic() - lost_at:.1f} {error}", flush=True)
    if "--wait" in sys.argv:
        print("WAITING", flush=True)
        sys.stdin.read()
    dtorch.shutdown()
    print("OK", flush=True)


if __name__ == "__main__":
    main()

"""Run by ``dtorch-launch --slurm`` (under salloc or sbatch) in tests/launcher/test_slurm.py.

A (4,) mesh over every task of the allocation: prints ``CONTROLLER <json>`` (its pid, the SLURM job
id and the run's secret, which the test looks for on command lines) and ``WORKERS <json>`` (rank,
host, pid), runs
the README's seed example, a redistribute and a read, each checked against torch on the same
inputs. Then, as the arguments ask:
  --wait  prints WAITING and waits on stdin (a test SIGKILLs this controller, or scancels the job);
  --lose  prints READY, waits for one stdin line (the test kills a worker meanwhile), and prints
          ``LOST <seconds> <message>`` for the read that follows; then replaces the lost worker
          (REPLACED <json>) and runs the checks again on the same mesh (RECHECKED);
  --until-lost  prints WAITING, then reads in a loop until a worker is lost and prints LOST like
          --lose (a test scancels the job meanwhile), then waits for SLURM's SIGTERM.
Ends with OK after dtorch.shutdown(). A failed start prints ``STARTUP <seconds> <message>``.
"""
import json
import os
import sys
import time

import torch

import dtorch
from dtorch import Replicate, Shard, init_device_mesh


def seed_example_and_redistribute(mesh) -> dtorch.DTensor:
    dtorch.manual_seed(0)
    x = dtorch.randn(256, 128, device_mesh=mesh, placements=[Shard(0)])
    y = dtorch.randn(256, 128, device_mesh=mesh, placements=[Shard(0)])
    torch.testing.assert_close((x + y).to_torch(), x.to_torch() + y.to_torch())
    expected = torch.arange(30.0).reshape(10, 3)     # 10 rows on 4 ranks: an uneven tail
    a = dtorch.tensor(expected, device_mesh=mesh, placements=[Shard(0)])
    b = (a * 3 + a).redistribute(mesh, [Replicate()])
    assert b.placements == (Replicate(),), b.placements
    torch.testing.assert_close(b.to_torch(), expected * 3 + expected)
    c = b.redistribute(mesh, [Shard(1)])
    torch.testing.assert_close(c.to_torch(), expected * 4)
    return a


def report_loss(a) -> None:
    lost_at = time.monotonic()
    try:
        (a * 2).to_torch()
        print("LOST never: the read succeeded", flush=True)
    except dtorch.WorkerLostError as error:
        print(f"LOST {time.monotonic() - lost_at:.1f} {error}", flush=True)


def main() -> None:
    started = time.monotonic()
    try:
        mesh = init_device_mesh("cpu", (4,))
    except dtorch.StartupError as error:
        print(f"STARTUP {time.monotonic() - started:.1f} {error}", flush=True)
        return
    secret = dtorch.runtime.controller.session.controller().secret
    print("CONTROLLER " + json.dumps({"pid": os.getpid(), "job": os.environ.get("SLURM_JOB_ID"),
                                      "secret": secret.hex() if isinstance(secret, bytes) else str(secret)}),
          flush=True)
    print("WORKERS " + json.dumps([{k: w[k] for k in ("rank", "host", "pid")} for w in dtorch.workers()]),
          flush=True)
    a = seed_example_and_redistribute(mesh)
    print("CHECKED", flush=True)
    if "--lose" in sys.argv:
        print("READY", flush=True)
        sys.stdin.readline()
        report_loss(a)
        replaced = dtorch.replace_lost_workers()     # a new srun step for the lost rank, same node
        print("REPLACED " + json.dumps([{k: r[k] for k in ("rank", "host", "pid")} for r in replaced]), flush=True)
        seed_example_and_redistribute(mesh)
        print("RECHECKED", flush=True)
    if "--until-lost" in sys.argv:
        print("WAITING", flush=True)
        try:
            while True:
                a.to_torch()
                time.sleep(0.1)
        except dtorch.WorkerLostError as error:
            print(f"LOST {error}", flush=True)
            # SLURM may signal the workers' steps before this batch step: wait for its SIGTERM,
            # so that the job always ends through dtorch-launch's handler, as the test checks
            time.sleep(60)
    if "--wait" in sys.argv:
        print("WAITING", flush=True)
        sys.stdin.read()
    dtorch.shutdown()
    print("OK", flush=True)


if __name__ == "__main__":
    main()

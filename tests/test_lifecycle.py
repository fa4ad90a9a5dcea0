"""Processes: workers that die, a controller that is killed, shutdown, memory, pool growth,
reads from a user event loop, the protocol's gap check. Tests that kill things run a fresh
controller in a subprocess, each with a hard timeout."""
import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import dtorch
from dtorch.spec.placements import Replicate, Shard
from dtorch.runtime.controller import session
from benchmarks.chain import run_chain
from support import REPO, alive, run_script


def _wait_gone(pids, seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def test_worker_killed_mid_run_raises_naming_rank_host_pid():
    result = run_script("""
        import json, os, signal, time, dtorch
        from dtorch.spec.placements import init_device_mesh, Shard
        mesh = init_device_mesh("cpu", (2,))
        x = dtorch.ones(64, 64, device_mesh=mesh, placements=[Shard(0)])
        assert x.sum().item() == 4096
        victim = dtorch.workers()[1]
        os.kill(victim["pid"], signal.SIGKILL)
        start = time.monotonic()
        try:
            (x * 2).to_torch()
            outcome = "no error"
        except dtorch.WorkerLostError as error:
            outcome = str(error)
        print(json.dumps({"outcome": outcome, "seconds": time.monotonic() - start, "victim": victim}))
    """)
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["seconds"] < 5, report
    victim = report["victim"]
    for expected in ("rank 1", victim["host"], f"pid {victim['pid']}"):
        assert expected in report["outcome"], report


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="uses a cuda:0 worker failing for want of a GPU")
def test_a_local_worker_that_cannot_start_fails_the_call_with_its_reason():
    """Its own last line (here: a "cuda:0" device on a machine where torch sees no GPU) becomes
    the StartupError, and the process has exited."""
    result = run_script("""
        import torch, dtorch
        from dtorch.runtime.controller import session
        from dtorch.runtime.controller.cluster import LocalSpawner
        class NoGpuHere(LocalSpawner):
            def spawn(self, rank, config):
                return super().spawn(rank, dict(config, device="cuda:0"))
        dtorch.init(num_workers=1)
        session._spawner = NoGpuHere()
        try:
            dtorch.init(num_workers=2)
        except dtorch.StartupError as error:
            print("REFUSED", error)
        dtorch.shutdown()
    """)
    assert result.returncode == 0, result.stderr
    assert ("REFUSED worker rank 1 on localhost exited with code 2: dtorch worker 1 cannot start: "
            "StartupError: this worker was assigned cuda:0") in result.stdout, result.stdout + result.stderr


def test_controller_sigkill_stops_every_worker_within_10s():
    script = ("import dtorch, json, time; from dtorch.spec.placements import init_device_mesh;"
              "init_device_mesh('cpu', (2,)); print(json.dumps([w['pid'] for w in dtorch.workers()]), flush=True);"
              "time.sleep(120)")
    controller = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True,
                                  env={**os.environ, "PYTHONPATH": REPO})
    try:
        pids = json.loads(controller.stdout.readline())
        assert all(alive(p) for p in pids)
        controller.send_signal(signal.SIGKILL)
        controller.wait(10)
        assert _wait_gone(pids, 10), "workers outlived their controller"
        # its private ipc directory stayed behind; the next session's start removes it
        import glob
        import shutil
        import tempfile
        from dtorch.runtime import transport
        left = glob.glob(os.path.join(tempfile.gettempdir(), f"dtorch-{controller.pid}-*"))
        assert left, "the killed controller's ipc directory should still be there"
        fresh = transport._private_dir()
        shutil.rmtree(fresh)
        assert not any(os.path.exists(path) for path in left), left
    finally:
        controller.kill()
        controller.wait()


def test_interpreter_exit_without_shutdown_stops_workers():
    result = run_script("""
        import json, dtorch
        from dtorch.spec.placements import init_device_mesh
        init_device_mesh("cpu", (2,))
        print(json.dumps([w["pid"] for w in dtorch.workers()]))
    """)
    pids = json.loads(result.stdout.strip().splitlines()[-1])
    assert _wait_gone(pids, 10)


def test_pool_grows_for_a_larger_mesh_and_meshes_share_workers():
    result = run_script("""
        import json, torch, dtorch
        from dtorch.spec.placements import init_device_mesh, Shard, Replicate
        dtorch.init(num_workers=2)
        small = init_device_mesh("cpu", (2,))
        big = init_device_mesh("cpu", (3,))
        one = init_device_mesh("cpu", (1,))
        grid = init_device_mesh("cpu", (3, 1))
        values = []
        for mesh in (small, big, one):
            x = dtorch.arange(10, device_mesh=mesh, placements=[Shard(0)])
            values.append((x * 2).sum().item())
        y = dtorch.ones(6, 2, device_mesh=grid, placements=[Shard(0), Replicate()])
        print(json.dumps({"workers": len(dtorch.workers()), "values": values, "grid": y.sum().item()}))
        dtorch.shutdown()
    """)
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {"workers": 3, "values": [90, 90, 90], "grid": 12.0}, result.stderr


def _rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


@pytest.mark.timeout(180)
def test_dropped_tensors_are_freed_on_workers(mesh4):
    pids = [w["pid"] for w in dtorch.workers()]
    for _ in range(200):  # warm the allocator
        dtorch.ones(262144, device_mesh=mesh4, placements=[Replicate()])
    dtorch.synchronize()
    before = [_rss_kib(p) for p in pids]
    for _ in range(10_000):  # 10,000 tensors of 1 MiB, each dropped at once
        dtorch.ones(262144, device_mesh=mesh4, placements=[Replicate()])
    dtorch.synchronize()
    after = [_rss_kib(p) for p in pids]
    growth_mib = max(a - b for a, b in zip(after, before)) / 1024
    assert growth_mib < 64, f"worker memory grew by {growth_mib:.0f} MiB"


def test_a_dropped_large_block_is_freed_before_the_next_command(mesh4):
    """Small dropped symbols wait for a Free of 16 (or the next flush); one whose block on each
    worker reaches FREE_AT_ONCE_BYTES goes in a Free before the next command, so a chain of large
    temporaries does not keep up to 16 dead buffers on every worker."""
    from dtorch.runtime.controller.controller import FREE_AT_ONCE_BYTES
    controller = session.controller()
    rows = FREE_AT_ONCE_BYTES // (4 * 64) * 4   # float32 (rows, 64), S(0): one block per rank
    small = dtorch.ones(8, device_mesh=mesh4, placements=[Shard(0)])
    large = dtorch.ones(rows, 64, device_mesh=mesh4, placements=[Shard(0)])
    dtorch.synchronize()
    assert large._meta.block_bytes == FREE_AT_ONCE_BYTES and small._meta.block_bytes < FREE_AT_ONCE_BYTES
    dropped = small._id
    del small
    keep = dtorch.ones(1, device_mesh=mesh4, placements=[Shard(0)])
    assert dropped in controller.released_pending()
    dropped = large._id
    del large
    keep = keep + 1   # (the old `keep`, small, is dropped after this op: it waits)
    assert dropped not in controller.released_pending()
    assert torch.equal(keep.to_torch(), torch.full((1,), 2.0))


async def test_await_from_a_user_event_loop_does_not_block_it(mesh4):
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.001)

    task = asyncio.create_task(ticker())
    x = dtorch.randn(512, 512, device_mesh=mesh4, placements=[Shard(0)])
    w = dtorch.randn(512, 512, device_mesh=mesh4, placements=[Replicate()])
    value = await (x @ w).fetch()
    again = await (x @ w).fetch()
    task.cancel()
    assert torch.equal(value, again) and ticks > 0
    future = x.sum().fetch()
    assert future.result(timeout=30).shape == () and future.done()


def test_asyncio_run_accepts_fetch_directly(mesh4):
    x = dtorch.ones(4, device_mesh=mesh4, placements=[Shard(0)])
    assert torch.equal(asyncio.run(x.fetch()), torch.ones(4))


def test_commands_are_batched_and_sent_once_for_all_workers(mesh4):
    dtorch.synchronize()
    before = dtorch.stats()
    x = dtorch.ones(16, device_mesh=mesh4, placements=[Shard(0)])
    for _ in range(500):
        x = x * 1.0001 + 1
    x.to_torch()
    after = dtorch.stats()
    commands = after["commands_sent"] - before["commands_sent"]
    batches = after["batches_sent"] - before["batches_sent"]
    assert commands >= 1000
    assert batches < commands / 10, (batches, commands)   # batched, one broadcast each


def test_a_free_that_goes_before_the_next_command_does_not_send_each_command_alone(mesh4):
    """Each replay of a compiled function puts a Free of what was dropped before its RunGraph (as
    a dropped large block does before the next op); that Free starts the batch, so the batch ages
    from then and waits for more commands like any other. (It once kept the previous batch's
    start, and each call went in a batch of its own.)"""
    step = dtorch.compile(lambda x: x * 1.0001 + 1)
    x = dtorch.ones(16, device_mesh=mesh4, placements=[Shard(0)])
    x = step(step(x))   # the capture, then the first replay
    dtorch.synchronize()
    before = dtorch.stats()
    for _ in range(300):
        x = step(x)   # the previous x is dropped: a Free before the next call's RunGraph
    x.to_torch()
    after = dtorch.stats()
    commands = after["commands_sent"] - before["commands_sent"]
    batches = after["batches_sent"] - before["batches_sent"]
    assert commands >= 300
    assert batches < commands / 10, (batches, commands)


def test_calls_of_a_compiled_graph_leave_once_a_batch_holds_enough_rows(mesh4, monkeypatch):
    """With the aged flush and the watchdog out of the way, the issuing thread publishes a batch
    of replays of a 100-row graph itself once their rows reach WORK_FLUSH_ROWS: about every 10th
    call goes out with the ones before it, no read and no quiet spell needed."""
    from dtorch.runtime.controller import controller as controller_module
    for name in ("AGED_FLUSH_S", "STALE_PENDING_S"):
        monkeypatch.setattr(controller_module, name, 1e9)
    controller = session.controller()
    step = dtorch.compile(lambda x: run_chain(x, 100))   # benchmark 1's chain: 100 ops
    x = dtorch.ones(16, device_mesh=mesh4, placements=[Shard(0)])
    x = step(step(x))   # the capture, then the first replay
    dtorch.synchronize()
    calls = 0
    while calls < 40 and (calls == 0 or controller.published_upto <= x._seq):   # until a call's RunGraph is out
        x = step(x)
        calls += 1
    assert calls <= controller_module.WORK_FLUSH_ROWS // 100 + 1, calls
    dtorch.synchronize()


def test_commands_leave_once_the_issuing_thread_goes_quiet(mesh4, monkeypatch):
    """No read follows: the idle-flush timer, which stays armed while ops keep coming, publishes
    the last batch once the thread stops issuing (the watchdog's safety net is off here)."""
    from dtorch.runtime.controller import controller as controller_module   # (flush_stale: the watchdog's net)
    monkeypatch.setattr(controller_module, "STALE_PENDING_S", 1e9)
    controller = session.controller()
    dtorch.synchronize()
    x = dtorch.ones(16, device_mesh=mesh4, placements=[Shard(0)])
    started = time.monotonic()
    while time.monotonic() - started < 0.05:   # issue for 50 ms: the timer re-arms while busy
        x = x * 1.0001 + 1
    deadline = time.monotonic() + 10
    while controller.published_upto < controller._next_seq:
        assert time.monotonic() < deadline, "commands issued before a quiet spell were never published"
        time.sleep(0.001)
    dtorch.synchronize()   # the workers run the backlog here, not in the next test


class _Recorder:
    def __init__(self):
        self.sent = []

    def send(self, frames):
        self.sent.append(frames)


def test_worker_reports_a_gap_in_command_numbers_instead_of_computing():
    from dtorch.errors import ProtocolError
    from dtorch.runtime import protocol as wire
    from dtorch.runtime.devices.device import CpuDevice
    from dtorch.runtime.worker.worker import Worker
    sockets = _Recorder()
    worker = Worker(0, sockets, comm=None, device=CpuDevice(), start_seq=0)
    frames = wire.encode_batch(0, [wire.Free(0, ())])
    worker._run_batch(wire.decode(frames[1], (wire.Batch,)), frames[2])
    skipped = wire.encode_batch(5, [wire.Free(5, ())])     # commands 1..4 never arrived
    with pytest.raises(ProtocolError, match="expected command #1, got #5"):
        worker._run_batch(wire.decode(skipped[1], (wire.Batch,)), skipped[2])


def test_every_command_has_a_handler():
    """One handler per command, on the Worker or one of its components: building the table
    (worker.handler_table, in Worker.__init__) raises, naming the command, where that fails."""
    from dtorch.runtime import protocol as wire
    from dtorch.runtime.devices.device import CpuDevice
    from dtorch.runtime.worker.worker import Worker
    worker = Worker(0, _Recorder(), comm=None, device=CpuDevice(), start_seq=0)
    assert list(worker._handlers) == list(wire.COMMANDS)
    for command, handler in worker._handlers.items():
        assert callable(handler) and handler.__name__ == wire.handler_name(command), command.__name__


def test_a_command_with_no_handler_or_two_fails_the_worker_at_start():
    from dtorch.runtime import protocol as wire
    from dtorch.runtime.worker.worker import handler_table

    class Meshes:
        def handle_define_mesh(self, command):
            pass

    class MoreMeshes(Meshes):
        pass
    assert list(handler_table((wire.DefineMesh,), (Meshes(),))) == [wire.DefineMesh]
    with pytest.raises(TypeError, match=r"Factory \(handle_factory on none of Meshes\)"):
        handler_table((wire.DefineMesh, wire.Factory), (Meshes(),))
    with pytest.raises(TypeError, match=r"DefineMesh \(handle_define_mesh on Meshes and MoreMeshes\)"):
        handler_table((wire.DefineMesh,), (Meshes(), MoreMeshes()))


def test_workers_lists_rank_host_pid_device(mesh4):
    listed = dtorch.workers()
    assert [w["rank"] for w in listed] == [0, 1, 2, 3]
    assert all(w["pid"] and w["host"] and w["device"] == "cpu" for w in listed)

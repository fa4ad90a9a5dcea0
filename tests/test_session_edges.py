"""Lifecycle edges a new user found: tensors kept past dtorch.shutdown(), reads after it, a mesh
of survivors after a lost worker, failures nobody read. Each runs a fresh controller in a
subprocess with a hard timeout (run_script), since they end sessions or kill workers."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from support import REPO, alive, run_script


def _report(result) -> dict:
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_tensor_from_an_ended_session_raises_and_never_reads_the_new_sessions_data():
    report = _report(run_script("""
        import json, dtorch
        from dtorch import init_device_mesh, Shard
        mesh = init_device_mesh("cpu", (4,))
        a = dtorch.zeros(8, 8, device_mesh=mesh, placements=[Shard(0)])
        dtorch.shutdown()
        mesh = init_device_mesh("cpu", (4,))
        b = dtorch.full((8, 8), 7.0, device_mesh=mesh, placements=[Shard(0)])
        outcomes = {}
        for name, call in {"op": lambda: (a + 1).to_torch(), "op with a live tensor": lambda: (a + b).to_torch(),
                           "read": lambda: a.to_torch(),
                           "redistribute": lambda: a.redistribute(placements=[dtorch.Replicate()])}.items():
            try:
                outcomes[name] = repr(call())
            except dtorch.SessionEndedError as error:
                outcomes[name] = "SessionEndedError: " + str(error)
        outcomes["b"] = b.to_torch().sum().item()   # the new session is unharmed
        print(json.dumps(outcomes))
    """))
    assert report.pop("b") == 7.0 * 64
    for name, outcome in report.items():
        assert outcome.startswith("SessionEndedError"), (name, outcome)
        assert "session that has ended" in outcome and "<string>:" in outcome, (name, outcome)


def test_reads_after_shutdown_and_reads_pending_at_shutdown_fail_at_once():
    report = _report(run_script("""
        import asyncio, json, os, signal, time, dtorch
        from dtorch import init_device_mesh, Shard
        mesh = init_device_mesh("cpu", (2,))
        x = dtorch.ones(4, 4, device_mesh=mesh, placements=[Shard(0)])
        os.kill(dtorch.workers()[1]["pid"], signal.SIGSTOP)   # the read cannot finish before shutdown
        # (shutdown kills what does not exit in time, stopped processes included)
        pending = x.fetch()
        dtorch.shutdown()
        outcomes, start = {}, time.monotonic()
        for name, call in {"pending": lambda: pending.result(10), "to_torch": x.to_torch,
                           "fetch().result()": lambda: x.fetch().result(10),
                           "await fetch()": lambda: asyncio.run(asyncio.wait_for(x.fetch(), 10)),
                           "item": lambda: x.sum().item()}.items():
            try:
                outcomes[name] = repr(call())
            except dtorch.SessionEndedError as error:
                outcomes[name] = "SessionEndedError"
        outcomes["seconds"] = time.monotonic() - start
        print(json.dumps(outcomes))
    """))
    assert report.pop("seconds") < 5, report
    assert set(report.values()) == {"SessionEndedError"}, report


def test_a_mesh_of_survivors_works_after_a_worker_is_lost():
    """Rank 3 is lost in two ways: killed before the next collective (the controller refuses to
    send it) and stopped in the middle of one (the survivors are in the collective when the loss
    is found, and must leave it). Either way ranks 0 and 1 answer on a new mesh within seconds."""
    report = _report(run_script("""
        import json, os, signal, threading, time, dtorch
        from dtorch import init_device_mesh, Replicate, Shard
        mesh = init_device_mesh("cpu", (4,))
        x = dtorch.ones(8, 8, device_mesh=mesh, placements=[Shard(0)])
        assert x.sum().item() == 64
        victim = dtorch.workers()[3]["pid"]
        os.kill(victim, signal.SIGSTOP)     # alive but silent: lost after the heartbeat timeout
        import atexit; atexit.register(os.kill, victim, signal.SIGKILL)   # a stopped worker cannot exit by itself
        stuck = x.sum().redistribute(placements=[Replicate()]).fetch()   # rank 3 never joins
        outcomes, start = {}, time.monotonic()
        try:
            stuck.result(30)
            outcomes["stuck"] = "a value"
        except dtorch.WorkerLostError as error:
            outcomes["stuck"] = "WorkerLostError"
        outcomes["lost after"] = time.monotonic() - start
        try:
            (x * 2).sum().item()
            outcomes["refused"] = "sent"
        except dtorch.WorkerLostError as error:
            outcomes["refused"] = "WorkerLostError"
        start = time.monotonic()
        survivors = init_device_mesh("cpu", (2,))
        y = dtorch.ones(4, 4, device_mesh=survivors, placements=[Shard(0)])
        outcomes["sum"] = y.sum().item()   # an all-reduce among ranks 0 and 1, who were in the stuck one
        outcomes["replicated"] = (y + 1).redistribute(placements=[Replicate()]).to_torch().sum().item()
        outcomes["survivors answered after"] = time.monotonic() - start
        print(json.dumps(outcomes))
    """, timeout=90))
    assert report["stuck"] == "WorkerLostError" and report["refused"] == "WorkerLostError", report
    assert report["lost after"] < 10, report
    assert report["sum"] == 16 and report["replicated"] == 32, report
    assert report["survivors answered after"] < 10, report


def test_a_stall_of_the_whole_machine_loses_no_worker():
    """Controller and workers stop together for longer than the heartbeat silence limit (a
    suspended VM, a starved CI machine): the controller's watchdog sees that it did not run
    either and loses nobody. The workers go on a moment after the controller, as they would
    if the machine's scheduler woke the controller first."""
    report = _report(run_script("""
        import json, os, signal, threading, time, dtorch
        from dtorch import init_device_mesh, Shard
        from dtorch.runtime.controller import cluster, session
        mesh = init_device_mesh("cpu", (2,))
        x = dtorch.ones(8, device_mesh=mesh, placements=[Shard(0)])
        assert x.sum().item() == 8
        pids = [w["pid"] for w in dtorch.workers()]
        held = threading.Event()
        def stall():   # the controller's loop thread stops, as the workers do
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            held.set()
            time.sleep(cluster.WORKER_SILENCE_S + 1.5)
        session.controller()._loop.call_soon_threadsafe(stall)
        held.wait(10)
        time.sleep(cluster.WORKER_SILENCE_S + 1.8)   # the loop runs again from here
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
        time.sleep(1.0)
        lost = [w["rank"] for w in dtorch.workers() if not w["alive"]]
        print(json.dumps({"lost": lost, "sum": (x * 2).sum().item()}))
    """, timeout=60))
    assert report == {"lost": [], "sum": 16}, report


@pytest.mark.parametrize("workers_stop", [True, False], ids=["whole machine, workers wake first",
                                                            "controller's Python only"])
def test_a_stall_longer_than_the_workers_silence_limit_loses_no_worker(workers_stop):
    """As above, but the stall outlasts the workers' own limit on controller silence (6 s).
    Either the workers stopped too and wake first (they find no answer yet, and must not count
    the time they were stopped as the controller's silence: a CI machine lost ranks 0 and 3
    this way), or they ran on through a pause of the controller's Python alone (a long garbage
    collection), whose ZeroMQ I/O thread kept their connection alive."""
    report = _report(run_script(f"""
        import json, os, signal, threading, time, dtorch
        from dtorch import init_device_mesh, Shard
        from dtorch.runtime.controller import session
        mesh = init_device_mesh("cpu", (2,))
        x = dtorch.ones(8, device_mesh=mesh, placements=[Shard(0)])
        assert x.sum().item() == 8
        pids = [w["pid"] for w in dtorch.workers()] if {workers_stop} else []
        held = threading.Event()
        def stall():
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            held.set()
            time.sleep(8.5)
        session.controller()._loop.call_soon_threadsafe(stall)
        held.wait(10)
        time.sleep(7.5)
        for pid in pids:   # the workers run a second before the controller's loop does
            os.kill(pid, signal.SIGCONT)
        time.sleep(2.5)
        alive = [w["rank"] for w in dtorch.workers() if w["alive"]]
        print(json.dumps({{"alive": alive, "sum": (x * 2).sum().item()}}))
    """, timeout=60))
    assert report == {"alive": [0, 1], "sum": 16}, report


def test_workers_exit_when_only_the_controller_stops_answering():
    """The other side of the rule above: a controller that is stopped while its workers run
    (hung, or its host cut off without closing the workers' stdin) is silent for real, and the
    workers leave after 6 s of listening instead of waiting forever."""
    controller = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import time, dtorch
        mesh = dtorch.init_device_mesh("cpu", (2,))
        assert dtorch.ones(4, device_mesh=mesh).sum().item() == 4
        print(*[w["pid"] for w in dtorch.workers()], flush=True)
        time.sleep(120)
    """)], cwd=REPO, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": REPO})
    try:
        pids = [int(p) for p in controller.stdout.readline().split()]
        assert len(pids) == 2, pids
        controller.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        while any(alive(pid) for pid in pids) and time.monotonic() - stopped < 20:
            time.sleep(0.2)
        assert not any(alive(pid) for pid in pids), f"workers {pids} outlived a silent controller by 20 s"
        assert time.monotonic() - stopped > 5, "the workers left before the 6 s silence limit"
    finally:
        controller.kill()
        controller.wait(10)


def test_a_failure_nobody_read_is_reported_at_shutdown_naming_the_op_and_line():
    result = run_script("""
        import torch, dtorch
        from dtorch import init_device_mesh, Shard
        mesh = init_device_mesh("cpu", (2,))
        n = dtorch.tensor(torch.arange(4), device_mesh=mesh, placements=[Shard(0)])
        d = dtorch.tensor(torch.tensor([1, 1, 0, 1]), device_mesh=mesh, placements=[Shard(0)])
        q = dtorch.div(n, d, rounding_mode="floor")   # fails on rank 1; never read
        dtorch.shutdown()
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "UnreadFailureWarning" in result.stderr, result.stderr[-3000:]
    assert "div failed on rank(s) [1]" in result.stderr and "<string>:7" in result.stderr, result.stderr[-3000:]


def test_a_mesh_made_after_a_loss_never_takes_a_live_meshs_id():
    """Mesh ids are never reused: after the (4,) mesh is dropped with its lost rank, a new (2,)
    mesh must not take the id of the (1,) mesh that is still alive (the workers would redefine it,
    and reads of tensors on the (1,) mesh would return the (2,) mesh's layout)."""
    report = _report(run_script("""
        import json, os, signal, time, torch, dtorch
        from dtorch import init_device_mesh, Shard, DeviceMesh
        whole = init_device_mesh("cpu", (4,))
        x = dtorch.ones(8, device_mesh=whole, placements=[Shard(0)])
        one = DeviceMesh("cpu", [0])
        kept = dtorch.arange(6, device_mesh=one, placements=[Shard(0)])
        assert kept.sum().item() == 15
        os.kill(dtorch.workers()[3]["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while dtorch.workers()[3]["alive"] and time.monotonic() < deadline:
            time.sleep(0.05)
        pair = DeviceMesh("cpu", [0, 1])
        y = dtorch.arange(6, device_mesh=pair, placements=[Shard(0)])
        fresh = dtorch.arange(6, device_mesh=one, placements=[Shard(0)])   # made after the pair's DefineMesh
        outcome = {"pair": y.to_torch().tolist(), "kept": (kept * 1).to_torch().tolist()}
        try:
            outcome["fresh"] = fresh.to_torch().tolist()
        except Exception as error:
            outcome["fresh"] = f"{type(error).__name__}: {error}"[:200]
        print(json.dumps(outcome))
    """, timeout=60))
    assert report == {"pair": [0, 1, 2, 3, 4, 5], "kept": [0, 1, 2, 3, 4, 5], "fresh": [0, 1, 2, 3, 4, 5]}, report


def test_a_worker_stuck_in_one_command_is_reported_naming_the_command_and_ended():
    """A worker alive and heartbeating but running one command past the hang timeout (here a
    matmul far longer than 1 s on one thread) is treated as lost: the read raises
    WorkerLostError naming the rank, the command, the op and the user's line, and the process
    is gone."""
    report = _report(run_script("""
        import json, os, time, dtorch
        from dtorch import DeviceMesh, Replicate
        dtorch.init(num_workers=2, hang_timeout_s=1.0)
        one = DeviceMesh("cpu", [1])
        a = dtorch.ones(6000, 6000, device_mesh=one, placements=[Replicate()])
        a.sum().item()
        pid = dtorch.workers()[1]["pid"]
        start = time.monotonic()
        product = a @ a @ a @ a   # minutes on one thread
        try:
            product.sum().item()
            outcome = {"read": "a value"}
        except dtorch.WorkerLostError as error:
            outcome = {"read": str(error)}
        outcome["seconds"] = time.monotonic() - start
        time.sleep(0.5)
        try:
            os.kill(pid, 0)
            outcome["process"] = "running"
        except ProcessLookupError:
            outcome["process"] = "gone"
        survivor = dtorch.ones(4, device_mesh=DeviceMesh("cpu", [0]), placements=[Replicate()])
        outcome["survivor"] = survivor.sum().item()
        print(json.dumps(outcome))
    """, timeout=90))
    read = report["read"]
    assert "stuck for" in read and "matmul" in read and "hang timeout" in read, report
    assert "rank 1" in read and "product = a @ a @ a @ a" not in read, report   # a line, not its text
    assert "issued at" in read and ":" in read.split("issued at")[1], report
    assert report["process"] == "gone" and report["survivor"] == 4 and report["seconds"] < 15, report

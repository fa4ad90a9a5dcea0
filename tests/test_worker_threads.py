"""Torch threads per worker: dtorch.init(threads_per_worker=N), DTORCH_THREADS, the default, and
dtorch.workers() showing each worker's count as the worker itself reported it when it registered
(torch.get_num_threads() after it set it). Sessions of their own run in a subprocess with a timeout."""
from __future__ import annotations

import json

import pytest

import dtorch
from dtorch.runtime.controller.cluster import ENV_THREADS, default_threads, threads_setting
from support import run_script


def _run(source: str, env_threads: str | None = None) -> dict:
    prefix = f"import os\nos.environ[{ENV_THREADS!r}] = {env_threads!r}\n" if env_threads is not None else ""
    result = run_script(prefix + source, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


SESSION = """
import json, os, signal, time
import dtorch
from dtorch import Shard
dtorch.init(num_workers=2{argument})
x = dtorch.ones(8, device_mesh=dtorch.init_device_mesh("cpu", (2,)), placements=[Shard(0)])
assert float((x * 2).sum().item()) == 16.0
report = {{"threads": [w["threads"] for w in dtorch.workers()]}}
try:
    dtorch.init(threads_per_worker=3)   # once workers run, a different count is refused
except ValueError as refused:
    report["refused"] = str(refused)
dtorch.init(threads_per_worker=report["threads"][0])   # the count they run: nothing to change
if {replace}:   # a replaced worker gets its predecessor's count
    os.kill(dtorch.workers()[1]["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while dtorch.workers()[1]["alive"] and time.monotonic() < deadline:
        time.sleep(0.1)
    dtorch.replace_lost_workers(timeout=60)
    report["replaced"] = dtorch.workers()[1]["threads"]
dtorch.shutdown()
print(json.dumps(report))
"""


@pytest.mark.parametrize("count", [1, 2])
def test_threads_per_worker_is_what_each_worker_runs(count):
    report = _run(SESSION.format(argument=f", threads_per_worker={count}", replace=count == 2))
    assert report["threads"] == [count, count]
    assert report.get("replaced", count) == count
    assert "already run" in report["refused"] and "dtorch.shutdown() first" in report["refused"]


def test_dtorch_threads_sets_it_and_the_argument_wins():
    assert _run(SESSION.format(argument="", replace=False), env_threads="2")["threads"] == [2, 2]
    assert _run(SESSION.format(argument=", threads_per_worker=1", replace=False), env_threads="2")["threads"] == [1, 1]


def test_the_default_shares_this_process_s_cpus_among_the_pool(mesh4):
    """The shared session's 4 workers were started without a setting (DTORCH_THREADS unset)."""
    assert [w["threads"] for w in dtorch.workers()][:4] == [default_threads(4)] * 4
    assert default_threads(10_000) == 1


@pytest.mark.parametrize("value", [0, -2, 1.5, True, "two"])
def test_a_bad_count_is_refused_before_anything_starts(value, monkeypatch):
    with pytest.raises(ValueError, match="threads_per_worker=.*at least 1 .*unset: the CPUs"):
        threads_setting(value)
    monkeypatch.setenv(ENV_THREADS, str(value))
    with pytest.raises(ValueError, match="DTORCH_THREADS="):
        threads_setting(None)


def test_unset_means_the_default(monkeypatch):
    monkeypatch.delenv(ENV_THREADS, raising=False)
    assert threads_setting(None) is None
    monkeypatch.setenv(ENV_THREADS, " 3 ")
    assert threads_setting(None) == 3 and threads_setting(2) == 2


def test_slurm_s_cpus_per_task_is_the_default_and_a_chosen_count_wins():
    """Under SLURM the spawner gives each worker its task's CPUs, unless the user chose a count.
    In a fresh process: this tree's launcher/, never an installed copy a session already imported."""
    report = _run("""
        import json, sys
        sys.path.insert(0, "tests/launcher")
        from launch_tree import load_launcher_from_tree
        load_launcher_from_tree()
        from dtorch_launcher import Allocation, SlurmSpawner, SshOptions, slurm
        started = []   # the config line each srun step would get on its stdin
        slurm.SlurmWorker.start_step = staticmethod(lambda *args: started.append(json.loads(args[-1])))
        spawner = SlurmSpawner(Allocation("7", ("n1",), (2,), 8), SshOptions())
        spawner.spawn(0, {"rank": 0, "threads": 1, "threads_chosen": False})
        spawner.spawn(1, {"rank": 1, "threads": 3, "threads_chosen": True})
        print(json.dumps({"threads": [config["threads"] for config in started]}))
    """)
    assert report["threads"] == [8, 3]

"""dtorch.profile: the trace's structure, what lands in it (and what does not), the bytes of known
collectives, clock alignment, summarize / plot, and profiles that end in an error.

The session fixture's 4 workers; every read and synchronize has a timeout, and the CLI runs in a
subprocess with one."""
from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dtorch
from dtorch import Partial, Replicate, Shard
from dtorch.errors import DTorchError, RemoteError, ShapeError
from dtorch.ops.suggest import move_cost
from dtorch.ops.tensor_meta import tensor_meta
from dtorch.profile import check_trace, summarize
from dtorch.profile.trace import CONTROLLER_PID
from dtorch.runtime.controller import profiling
from support import run_script

ROOT = Path(__file__).resolve().parent.parent
READ_S = 60


def _worker_commands(trace: dict, rank: int | None = None) -> list:
    return [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "command"
            and e["pid"] != CONTROLLER_PID and (rank is None or e["pid"] == rank + 1)]


def _controller_spans(trace: dict) -> list:
    return [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == CONTROLLER_PID]


def _small_step(mesh, tmp_path=None):
    x = dtorch.randn(16, 8, device_mesh=mesh, placements=[Shard(0)])
    y = (x * 2).exp()
    z = y.redistribute(placements=[Replicate()])
    return (z.sum() + x.sum()).fetch().result(READ_S)


def test_the_trace_file_is_valid_trace_event_format(mesh4, tmp_path):
    path = tmp_path / "trace.json"
    with dtorch.profile(path) as prof:
        _small_step(mesh4)
    trace = json.loads(path.read_text())
    assert trace == prof.trace
    assert check_trace(trace) == []
    for event in trace["traceEvents"]:
        assert {"name", "ph", "ts", "pid", "tid"} <= set(event)
        if event["ph"] == "X":
            assert event["dur"] >= 0
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names[CONTROLLER_PID] == "controller"
    ranks = [w["rank"] for w in dtorch.workers()]   # every worker of the session (earlier tests may add some)
    assert {pid for pid in names if pid != CONTROLLER_PID} == {r + 1 for r in ranks}
    assert all(names[r + 1].startswith(f"rank {r} (cpu") for r in ranks)
    lanes = {(e["pid"], e["tid"]) for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert {(e["pid"], e["tid"]) for e in trace["traceEvents"] if e["ph"] == "X"} <= lanes
    kinds = {e["cat"] for e in _controller_spans(trace)}
    assert {"op", "flush", "read"} <= kinds


def test_the_checker_sees_broken_traces():
    lane = [{"name": "thread_name", "ph": "M", "ts": 0, "pid": 0, "tid": 1, "args": {"name": "t"}},
            {"name": "process_name", "ph": "M", "ts": 0, "pid": 0, "tid": 0, "args": {"name": "controller"}}]
    good = lane + [{"name": "a", "ph": "X", "ts": 0, "dur": 10, "pid": 0, "tid": 1},
                   {"name": "b", "ph": "X", "ts": 2, "dur": 3, "pid": 0, "tid": 1},
                   {"name": "c", "ph": "X", "ts": 10, "dur": 1, "pid": 0, "tid": 1}]
    assert check_trace({"traceEvents": good}) == []
    overlapping = lane + [{"name": "a", "ph": "X", "ts": 0, "dur": 10, "pid": 0, "tid": 1},
                          {"name": "b", "ph": "X", "ts": 5, "dur": 10, "pid": 0, "tid": 1}]
    assert "overlaps" in check_trace({"traceEvents": overlapping})[0]
    assert "lacks ts" in check_trace({"traceEvents": [{"name": "a", "ph": "X", "pid": 0, "tid": 1}]})[0]
    assert "dur" in check_trace({"traceEvents": lane + [{"name": "a", "ph": "X", "ts": 0, "dur": -1,
                                                         "pid": 0, "tid": 1}]})[0]
    assert "no process_name" in " ".join(check_trace({"traceEvents": lane + [
        {"name": "a", "ph": "X", "ts": 0, "dur": 1, "pid": 7, "tid": 1}]}))


def test_workers_record_the_block_and_nothing_outside_it(mesh4):
    x = dtorch.randn(16, 8, device_mesh=mesh4, placements=[Shard(0)])
    before = x.neg()                        # issued before: never recorded, even if it runs late
    with dtorch.profile() as prof:
        inside = x.tanh()
    after = x.sigmoid()                     # issued after the block
    for result in (before, inside, after):
        result.fetch().result(READ_S)
    for rank in range(4):
        names = {e["name"] for e in _worker_commands(prof.trace, rank)}
        assert "tanh" in names and not names & {"neg", "sigmoid"}
    tanh = [e for e in _worker_commands(prof.trace) if e["name"] == "tanh"]
    assert all(e["args"]["site"].startswith(__file__) for e in tanh)   # the user's line, from the controller
    issued = [e for e in _controller_spans(prof.trace) if e["cat"] == "op"]
    assert [e["name"] for e in issued] == ["tanh"] and issued[0]["args"]["site"].startswith(__file__)
    assert profiling.active is None


@pytest.mark.parametrize("source, target, kind", [
    ([Shard(0)], [Replicate()], "all_gather"),
    ([Partial()], [Replicate()], "all_reduce"),
    ([Shard(0)], [Shard(1)], "all_to_all"),
    ([Partial()], [Shard(0)], "reduce_scatter"),
])
def test_collective_bytes_of_a_known_redistribute(mesh4, source, target, kind):
    shape = (16, 8)   # float32, 512 bytes
    x = dtorch.randn(*shape, device_mesh=mesh4, placements=[Replicate()]).redistribute(placements=source)
    x.fetch().result(READ_S)
    with dtorch.profile() as prof:
        x.redistribute(placements=target).fetch().result(READ_S)
    expected, _ = move_cost(tensor_meta(shape, torch.float32, mesh4, source), 0, target[0])
    for rank in range(4):
        moves = [e for e in _worker_commands(prof.trace, rank) if e["name"] == "redistribute"]
        assert len(moves) == 1, moves
        assert moves[0]["args"]["bytes"] == expected, (rank, moves[0]["args"])
        collectives = [e for e in prof.trace["traceEvents"] if e.get("cat") == "comm" and e["pid"] == rank + 1]
        assert [c["name"] for c in collectives] == [kind] and collectives[0]["args"]["group"] == [0, 1, 2, 3]
        assert 0 <= collectives[0]["args"]["wait_us"] <= collectives[0]["dur"] + 0.01


def test_an_inserted_redistribute_is_a_controller_span_inside_the_op(mesh4, automatic):
    """Fused (RunOp.moves): on the workers the move's all-to-all runs inside the add's own
    command, and no Redistribute command is sent."""
    a = dtorch.randn(8, 8, device_mesh=mesh4, placements=[Shard(0)])
    b = dtorch.randn(8, 8, device_mesh=mesh4, placements=[Shard(1)])
    with dtorch.profile() as prof:
        (a + b).fetch().result(READ_S)
    spans = _controller_spans(prof.trace)
    add = next(e for e in spans if e["name"] == "add")
    inserted = [e for e in spans if e["name"] == "redistribute (inserted)"]
    assert (inserted and add["ts"] <= inserted[0]["ts"]
            and inserted[0]["ts"] + inserted[0]["dur"] <= add["ts"] + add["dur"])
    assert inserted[0]["args"]["fused"] is True
    commands = _worker_commands(prof.trace, 0)
    assert not any(e["name"] == "redistribute" for e in commands)
    worker_add = next(e for e in commands if e["name"] == "add")
    collectives = [e for e in prof.trace["traceEvents"] if e.get("cat") == "comm" and e["pid"] == 1]
    assert [c["name"] for c in collectives] == ["all_to_all"]
    assert worker_add["ts"] <= collectives[0]["ts"] <= worker_add["ts"] + worker_add["dur"]


def test_backward_and_optimizer_step_are_spans(mesh4):
    weight = dtorch.nn.Parameter(dtorch.randn(8, 4, device_mesh=mesh4, placements=[Replicate()]))
    optimizer = dtorch.optim.SGD([weight], lr=0.1)
    x = dtorch.randn(16, 8, device_mesh=mesh4, placements=[Shard(0)])
    with dtorch.profile() as prof:
        (x @ weight).sum().backward()
        optimizer.step()
        weight.fetch().result(READ_S)
    names = {e["name"] for e in _controller_spans(prof.trace)}
    assert {"backward", "SGD.step", "matmul"} <= names
    worker = {e["name"] for e in _worker_commands(prof.trace, 0)}
    assert {"backward", "SGD"} <= worker
    assert check_trace(prof.trace) == []


def test_clock_offsets_are_small_on_one_machine(mesh4):
    with dtorch.profile() as prof:
        (dtorch.ones(4, device_mesh=mesh4, placements=[Shard(0)]) + 1).fetch().result(READ_S)
    clocks = prof.trace["otherData"]["clocks"]
    assert set(clocks) == {str(w["rank"]) for w in dtorch.workers()}
    for clock in clocks.values():   # one host, one monotonic clock: only the estimate's error remains
        assert abs(clock["offset_us"]) < 5_000 and abs(clock["drift_us"]) < 5_000


def test_profiling_twice_and_not_nested(mesh4):
    x = dtorch.randn(8, device_mesh=mesh4, placements=[Shard(0)])
    traces = []
    for op in ("cos", "sin"):
        with dtorch.profile() as prof:
            getattr(x, op)().fetch().result(READ_S)
            with pytest.raises(DTorchError, match="already recording"):
                with dtorch.profile():
                    pass
        traces.append(prof.trace)
    assert {e["name"] for e in _worker_commands(traces[0])} >= {"cos"}
    assert {e["name"] for e in _worker_commands(traces[1])} >= {"sin"}
    assert "cos" not in {e["name"] for e in _worker_commands(traces[1])}


def test_a_profile_inside_a_compiled_function_says_to_profile_around_it(mesh4):
    @dtorch.compile
    def step(x):
        with dtorch.profile():
            return x * 2
    with pytest.raises(dtorch.CompileError, match="dtorch.profile started or stopped at .* inside compiled .*step: "
                                                  ".* Profile around the compiled call instead"):
        step(dtorch.randn(8, device_mesh=mesh4, placements=[Shard(0)]))


def test_a_failing_op_inside_the_block_still_yields_a_trace(mesh4, tmp_path):
    path = tmp_path / "failed.json"
    numerator = dtorch.tensor(torch.arange(8), device_mesh=mesh4, placements=[Shard(0)])
    denominator = dtorch.tensor(torch.tensor([1, 1, 1, 1, 1, 1, 0, 1]), device_mesh=mesh4, placements=[Shard(0)])
    with pytest.raises(RemoteError):
        with dtorch.profile(path):
            dtorch.div(numerator, denominator, rounding_mode="floor").fetch().result(READ_S)   # fails on rank 3
    trace = json.loads(path.read_text())
    assert check_trace(trace) == []
    statuses = {e["pid"] - 1: e["args"]["status"] for e in _worker_commands(trace)
                if e["name"] == "div" and e["pid"] - 1 in mesh4.ranks}
    assert statuses == {0: "ok", 1: "ok", 2: "ok", 3: "failed"}
    read = next(e for e in _controller_spans(trace) if e["name"] == "read")
    assert read["args"]["failed"] is True
    # an error on the controller (at the user's line) as well
    with pytest.raises(ShapeError):
        with dtorch.profile(path):
            numerator + dtorch.ones(3, device_mesh=mesh4, placements=[Shard(0)])
    trace = json.loads(path.read_text())
    assert check_trace(trace) == []
    assert next(e for e in _controller_spans(trace) if e["name"] == "add")["args"]["raised"] == "ShapeError"


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dtorch.profile", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_summarize_prints_the_top_ops_and_shares(mesh4, tmp_path):
    path = tmp_path / "trace.json"
    with dtorch.profile(path) as prof:
        _small_step(mesh4)
    text = summarize(prof.trace)
    for expected in ("Top ops", "exp", "mul", "redistribute", "Per rank", "communication", "idle",
                     "rank 0", "rank 3", "read", "flush"):
        assert expected in text, (expected, text)
    shown = _cli("summarize", path)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.strip() == text.strip()
    checked = _cli("check", path)
    assert checked.returncode == 0 and "valid" in checked.stdout


def test_shares_per_rank_add_up(mesh4):
    with dtorch.profile() as prof:
        _small_step(mesh4)
    window = prof.trace["otherData"]["window_us"][1]
    for rank in range(4):
        busy = sum(e["dur"] for e in _worker_commands(prof.trace, rank))
        assert 0 < busy <= window + 1


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="plotting needs matplotlib")
def test_plot_writes_a_png(mesh4, tmp_path):
    path, picture = tmp_path / "trace.json", tmp_path / "timeline.png"
    with dtorch.profile(path):
        _small_step(mesh4)
    drawn = _cli("plot", path, "-o", picture)
    assert drawn.returncode == 0, drawn.stderr
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_session_goes_on_after_a_profile(mesh4):
    """After a profile the controller records nothing (one attribute check per hook)."""
    with dtorch.profile():
        pass
    assert profiling.active is None
    x = dtorch.ones(4, device_mesh=mesh4, placements=[Shard(0)])
    assert math.isclose(float((x * 3).sum().item()), 12.0)


def test_a_worker_lost_inside_the_block_leaves_the_controller_side(tmp_path):
    """In its own controller process: rank 1 is killed mid-profile; the block's error is the
    user's to see, and the trace still holds this process's spans, saying why the rest is missing."""
    path = tmp_path / "lost.json"
    result = run_script(f"""
        import json, os, signal, time, warnings
        import dtorch
        from dtorch import Shard
        mesh = dtorch.init_device_mesh("cpu", (2,))
        x = dtorch.ones(8, device_mesh=mesh, placements=[Shard(0)])
        pid = [w["pid"] for w in dtorch.workers() if w["rank"] == 1][0]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with dtorch.profile({str(path)!r}, timeout_s=30):
                    (x + 1).fetch().result(30)
                    os.kill(pid, signal.SIGKILL)
                    time.sleep(1.0)
                    (x * 2).fetch().result(30)
            except dtorch.WorkerLostError:
                print("lost")
        print("warned", any("part of the trace is missing" in str(w.message) for w in caught))
        trace = json.load(open({str(path)!r}))
        from dtorch.profile import check_trace
        print("problems", check_trace(trace))
        print("missing", bool(trace["otherData"]["workers_missing"]))
        print("ops", sorted({{e["name"] for e in trace["traceEvents"] if e.get("cat") == "op"}}))
        dtorch.shutdown()
    """, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[:4] == ["lost", "warned True", "problems []", "missing True"], result.stdout
    assert lines[4] == "ops ['add', 'mul']", result.stdout

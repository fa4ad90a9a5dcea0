"""Reading a dtorch.profile trace: summarize counts every instant once (a compiled replay's rows
and a command's collectives are nested, never added twice), plot's picture names ops and phases,
and plot without matplotlib says how to get it while summarize needs nothing.

Profiles run on the session fixture's 4 workers; the CLI runs in a subprocess with a timeout."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import dtorch
from dtorch import Replicate, Shard
from dtorch.profile import check_trace, summarize
from dtorch.profile.timeline import drawing, phase_of
from dtorch.profile.trace import CONTROLLER_PID

ROOT = Path(__file__).resolve().parent.parent
READ_S = 60
ROUNDING = 0.35   # four shares, each rounded to 0.1%
RANK_ROW = re.compile(r"^\s*rank (\d+)\s+\d+\s+([\d.]+)%\s+([\d.]+)%\s+([\d.]+)%\s+([\d.]+)%")


def _rank_shares(text: str) -> dict:
    """rank -> (compute, communication, waiting, idle) from summarize's per-rank table."""
    table = text.split("Per rank", 1)[1]
    return {int(m[1]): tuple(float(m[i]) for i in range(2, 6)) for m in map(RANK_ROW.match, table.splitlines()) if m}


def _op_shares(text: str) -> list:
    table = text.split("Top ops", 1)[1].split("Controller", 1)[0]
    return [float(share) for share in re.findall(r"\s([\d.]+)%\s+[\d.]+\s+\d+%", table)]


def _step(mesh):
    weight = dtorch.nn.Parameter(dtorch.randn(8, 8, device_mesh=mesh, placements=[Replicate()]))
    optimizer = dtorch.optim.SGD([weight], lr=0.1)

    def step(x):
        loss = (x @ weight).tanh().sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss
    return step


def _assert_adds_up(trace: dict) -> None:
    text = summarize(trace, top=1000)
    shares = _rank_shares(text)
    assert set(shares) == {w["rank"] for w in dtorch.workers()}, text
    for rank, (compute, communication, waiting, idle) in shares.items():
        assert abs(compute + communication + idle - 100) <= ROUNDING, (rank, text)
        assert waiting <= communication + 0.1, (rank, text)
    ops = _op_shares(text)
    assert ops and abs(sum(ops) - 100) <= 0.05 * len(ops) + 0.1, text


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
def test_shares_per_rank_add_up_to_100(mesh4, compiled):
    step = _step(mesh4)
    if compiled:
        step = dtorch.compile(step)
    x = dtorch.randn(16, 8, device_mesh=mesh4, placements=[Shard(0)])
    for _ in range(3):   # a training step captures twice, then replays (docs/guide/compile.md)
        step(x).fetch().result(READ_S)
    with dtorch.profile() as prof:
        for _ in range(2):
            step(x)
        dtorch.synchronize(timeout=READ_S)
    trace = prof.trace
    assert check_trace(trace) == []
    commands = [e for e in trace["traceEvents"] if e.get("cat") == "command" and e["pid"] == 1]
    replays = [e for e in commands if e["name"] == "RunGraph"]
    if compiled:   # the case that once added up to 108-123%: rows nested in the replay's span
        assert len(replays) == 2
        inside = [e for e in commands if replays[0]["ts"] < e["ts"] < replays[0]["ts"] + replays[0]["dur"]]
        assert {"matmul", "backward", "SGD"} <= {e["name"] for e in inside}
    else:
        assert not replays
    _assert_adds_up(trace)
    text = summarize(trace)
    assert "self" in text and "100%" in text   # the output says what a row counts
    phases = {phase_of(e) for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] != CONTROLLER_PID}
    assert {"forward", "backward", "optimizer", "communication"} <= phases


# --- a trace made by hand: every number known ------------------------------------------------------
def _meta(kind, pid, tid, name):
    return {"name": kind, "ph": "M", "ts": 0, "pid": pid, "tid": tid, "args": {"name": name}}


def _x(name, category, ts, dur, pid=1, **args):
    return {"name": name, "cat": category, "ph": "X", "ts": ts, "dur": dur, "pid": pid, "tid": 1, "args": args}


def _command(name, command, ts, dur, **args):
    return _x(name, "command", ts, dur, command=command, seq=int(ts), status="ok", **args)


HAND_MADE = {"displayTimeUnit": "ms", "otherData": {"window_us": [0.0, 1000.0]}, "traceEvents": [
    _meta("process_name", 0, 0, "controller"), _meta("thread_name", 0, 1, "thread MainThread"),
    _meta("process_name", 1, 0, "rank 0 (cpu, here, pid 1)"), _meta("thread_name", 1, 1, "commands"),
    _x("read", "read", 0, 1000, pid=0),
    # a replay (0-800 us) whose rows are commands of their own, with a collective in the backward
    _command("RunGraph", "RunGraph", 0, 800),
    _command("matmul", "RunOp", 10, 190),
    _command("backward", "Backward", 200, 400, bytes=64, comm_us=100, wait_us=20),
    _x("all_reduce", "comm", 300, 100, bytes=64, wait_us=20, group=[0]),
    _command("SGD", "OptimizerStep", 600, 150),
    _command("redistribute", "Redistribute", 850, 100, bytes=32, comm_us=100, wait_us=0),
    _x("all_gather", "comm", 850, 100, bytes=32, wait_us=0, group=[0]),
]}


def test_summarize_counts_self_time_of_a_hand_made_replay():
    text = summarize(HAND_MADE)
    # busy 800 + 100 of 1000 us: compute 900 - 200 in collectives, idle 100
    assert _rank_shares(text) == {0: (70.0, 20.0, 2.0, 10.0)}, text
    row = next(line for line in text.splitlines() if line.strip().startswith("RunGraph"))
    assert row.split()[2:4] == ["0.060", "6.7%"] and row.split()[-1] == "0.800", row   # 60 of 900 us, whole 800
    assert abs(sum(_op_shares(text)) - 100) < 0.2, text


def test_the_picture_names_ops_and_phases_on_worker_lanes():
    picture = drawing(HAND_MADE)
    worker_row = picture.lanes.index("rank 0")
    on_worker = [label for label in picture.labels if label.row == worker_row]
    assert {label.text for label in on_worker if label.kind == "phase"} == {
        "forward", "backward", "optimizer", "communication"}
    assert {"matmul", "backward", "SGD", "redistribute"} <= {label.text for label in on_worker if label.kind == "op"}
    assert "RunGraph" not in {label.text for label in on_worker}   # the replay is a colour; its rows are named
    colors = {bar.color for bar in picture.bars if bar.row == worker_row}
    assert len(colors) == 5   # forward, backward, optimizer, communication, the replay around them
    narrow = {**HAND_MADE, "otherData": {"window_us": [0.0, 1e6]}}   # 1 s: no bar is wide enough for a name
    assert not [label for label in drawing(narrow).labels if label.kind in ("op", "phase")]


WITHOUT_MATPLOTLIB = """
import runpy, sys
sys.modules["matplotlib"] = None     # as if it were not installed: its import raises ImportError
sys.argv = ["python -m dtorch.profile"] + sys.argv[1:]
runpy.run_module("dtorch.profile", run_name="__main__")
"""


def test_plot_without_matplotlib_says_how_to_get_it_and_summarize_needs_nothing(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(HAND_MADE))

    def cli(*args):
        return subprocess.run([sys.executable, "-c", WITHOUT_MATPLOTLIB, *map(str, args)], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
    drawn = cli("plot", path, "-o", tmp_path / "timeline.png")
    assert drawn.returncode == 1, drawn.stderr
    assert "needs matplotlib" in drawn.stderr and "pip install matplotlib" in drawn.stderr, drawn.stderr
    assert "Traceback" not in drawn.stderr and not (tmp_path / "timeline.png").exists()
    summarized = cli("summarize", path)
    assert summarized.returncode == 0, summarized.stderr
    assert summarized.stdout.strip() == summarize(HAND_MADE).strip()

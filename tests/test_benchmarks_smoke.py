"""Every benchmark runs end to end with a handful of iterations (`--smoke`).

Nothing here asserts anything about speed: only that each benchmark produces rows, that no
row is an error (a missing optional peer reads "not installed"), that the report files are
written, and that every process the suite started is gone afterwards.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from benchmarks import BENCHMARKS

ROOT = Path(__file__).resolve().parent.parent
# 2, 8 and 10 start baseline processes (8 and 10 importing transformers); 11 two sshd and three
# launches; ~120 s on a quiet 2-core machine, 300+ in a slow spell
SUITE_TIMEOUT_S = 480
EXIT_GRACE_S = 10
# dtorch workers start in their own session, so the suite's process group cannot find them;
# this variable, inherited by everything the suite starts, can.
TOKEN_VARIABLE = "DTORCH_BENCHMARK_SMOKE_TOKEN"


def run_marked(argv: list[str], token: str, timeout_s: float, what: str,
               kill_group: bool = False) -> subprocess.CompletedProcess:
    """`python <argv>` from the repository root, in a session of its own, with `token` in the
    environment of everything it starts (survivors_after_grace finds those); past `timeout_s`
    its group is killed and the test fails. `kill_group`: kill what is left of its process group
    once it ends (a suite's baselines; dtorch workers start sessions of their own)."""
    process = subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True, env=dict(os.environ, **{TOKEN_VARIABLE: token}))
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{what} ran past {timeout_s} s:\n{output[-4000:]}")
    finally:
        if kill_group:
            _kill_group(process.pid)
    return subprocess.CompletedProcess(process.args, process.returncode, output)


def run_smoke_suite(out: Path, token: str) -> subprocess.CompletedProcess:
    return run_marked(["-m", "benchmarks", "--smoke", "--out", str(out)], token, SUITE_TIMEOUT_S, "smoke suite",
                      kill_group=True)


def _kill_group(group: int) -> None:
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        pass


def processes_carrying(token: str) -> list[int]:
    marker = f"{TOKEN_VARIABLE}={token}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:  # exited meanwhile, or not ours to read
            continue
    return found


def survivors_after_grace(token: str) -> list[int]:
    """Processes started by the suite still alive after a grace period; they are killed."""
    deadline = time.monotonic() + EXIT_GRACE_S
    while (left := processes_carrying(token)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


@pytest.mark.slow
@pytest.mark.timeout(SUITE_TIMEOUT_S + EXIT_GRACE_S + 15)
def test_every_benchmark_runs_in_smoke_mode(tmp_path):
    token = uuid.uuid4().hex
    try:
        finished = run_smoke_suite(tmp_path, token)
    finally:
        survivors = survivors_after_grace(token) if Path("/proc/self/environ").exists() else []
    tail = finished.stdout[-4000:]
    results = json.loads((tmp_path / "latest.json").read_text())
    errors = [f"{r['benchmark']} / {r['case']} / {r['variant']}: {r['status']}"
              for r in results["rows"] if r["status"].startswith("error")]
    assert not errors, "benchmark rows failed:\n" + "\n".join(errors) + "\n" + tail
    assert finished.returncode == 0, tail
    assert not survivors, f"processes left running after the suite (killed now): {survivors}"
    assert {r["benchmark"] for r in results["rows"]} == set(BENCHMARKS)
    assert all(r["samples"] for r in results["rows"] if r["status"] == "ok")
    markdown = (tmp_path / "latest.md").read_text()
    assert len(re.findall(r"^#### \d+\. ", markdown, re.M)) == len(BENCHMARKS)
    assert "#### Per-op cost against torch eager" in markdown   # benchmarks 1 and 6 ran
    assert set(results["steal"]) == set(BENCHMARKS)   # each benchmark's host steal share (or null)
    assert "host steal" in finished.stdout


def test_ratio_uses_the_reference_from_the_same_run():
    from benchmarks.report import ratio
    from benchmarks.timing import Row
    reference = Row("b", "case", "floor", "op", [1.0, 2.0, 3.0])
    measured = Row("b", "case", "system", "op", [4.0, 4.0, 8.0], reference=("case", "floor"))
    assert ratio(measured, [reference, measured]) == pytest.approx(2.0)
    assert ratio(reference, [reference, measured]) is None


def test_the_per_op_summary_takes_each_systems_ratio_from_the_same_run():
    """The summary (the plot's first panel, the results block's first table): measured systems
    in a fixed order with their own benchmark's ratio, systems that did not run left out, and
    DTorch's published figure last, marked as not measured; nothing at all if nothing ran."""
    from benchmarks.per_op_summary import PUBLISHED_DTORCH, per_op_lines
    from benchmarks.timing import Row, not_installed
    case, eager = "(64, 128)", "torch eager (local)"
    rows = [Row("dispatch", case, eager, "op", [2.0]),
            Row("dispatch", case, "dtorch S(0), 4 workers", "op", [6.0], reference=(case, eager)),
            Row("dispatch", "(1,)", "dtorch S(0), 4 workers", "op", [60.0], reference=("(1,)", eager)),
            Row("peers", case, eager, "op", [3.0]),
            Row("peers", case, "Monarch actor, fire-and-forget", "op", [15.0], reference=(case, eager)),
            not_installed("peers", case, "Ray actor, fire-and-forget", "op", "ray")]
    lines = per_op_lines(rows)
    assert [(line.label, line.measured) for line in lines] == [
        ("dtorch eager, 4 workers (issuing thread)", True), ("Monarch actor, fire-and-forget", True),
        (PUBLISHED_DTORCH[0], False)]
    assert [line.ratio for line in lines] == pytest.approx([3.0, 5.0, 8.14 / 5.94])
    assert [line.label for line in per_op_lines(rows[3:])] == ["Monarch actor, fire-and-forget", PUBLISHED_DTORCH[0]]
    assert per_op_lines([rows[0], rows[5]]) == per_op_lines([]) == []


def test_a_saved_run_is_reported_again_without_measuring(tmp_path):
    """`python -m benchmarks --from-json`: read_json gives back the rows and meta write_json saved."""
    from benchmarks.report import markdown_report, read_json, write_json
    from benchmarks.timing import Row, failed
    rows = [Row("dispatch", "(1,)", "torch eager (local)", "op", [1e-6, 2e-6]),
            Row("dispatch", "(1,)", "dtorch S(0), 4 workers", "op", [3e-6], reference=("(1,)", "torch eager (local)"),
                note="a note"),
            failed("peers", "(64, 128)", "Ray actor, fire-and-forget", "op", RuntimeError("no"))]
    meta = {"steal": {"dispatch": 0.0}, "command": "python -m benchmarks", "suite": "quick", "date": "2026-12-05 10:13",
            "duration_s": 3.0, "machine": {"cpu": "x", "cores": 2}}
    write_json(rows, meta, tmp_path / "latest.json")
    again, meta_again = read_json(tmp_path / "latest.json")
    assert again == rows and meta_again == meta
    titles = {"dispatch": "1. Dispatch", "peers": "7. Peers"}
    assert markdown_report(again, titles, meta_again) == markdown_report(rows, titles, meta)


def test_publish_rewrites_the_results_block_of_the_benchmarks_page(tmp_path):
    """`python -m benchmarks --publish` writes into docs/design/benchmarks.md (DOCS_PAGE), between the
    results markers, and copies the plot beside it: the page exists and has exactly one block, and
    publish replaces the block and nothing else (checked on a copy)."""
    from benchmarks.__main__ import DOCS_PAGE
    from benchmarks.report import DOCS_BEGIN, DOCS_END, publish
    text = DOCS_PAGE.read_text()
    assert text.count(DOCS_BEGIN) == 1 and text.count(DOCS_END) == 1, f"{DOCS_PAGE}: one results block"
    page, plot = tmp_path / "benchmarks.md", tmp_path / "latest.png"
    page.write_text(text)
    plot.write_bytes(b"png")
    publish("NEW TABLES", plot, page)
    head, rest = text.split(DOCS_BEGIN, 1)
    assert page.read_text() == f"{head}{DOCS_BEGIN}\nNEW TABLES\n{DOCS_END}{rest.split(DOCS_END, 1)[1]}"
    assert (tmp_path / "benchmarks.png").read_bytes() == b"png"


def test_steal_share_is_read_from_proc_stat(tmp_path, monkeypatch):
    """steal.Meter: stolen ticks over the ticks the VM wanted a CPU (idle and iowait excluded);
    too few ticks give no figure rather than a rounding artefact."""
    from benchmarks import steal
    stat = tmp_path / "stat"
    monkeypatch.setattr(steal, "_STAT", stat)

    def write(user, system, idle, stolen):   # user nice system idle iowait irq softirq steal guest guest_nice
        stat.write_text(f"cpu  {user} 0 {system} {idle} 5 1 1 {stolen} 0 0\ncpu0 1 2 3\n")
    write(100, 50, 1000, 10)
    assert steal.cpu_ticks() == (100 + 50 + 1 + 1 + 10, 10)
    meter = steal.Meter()
    write(160, 70, 5000, 30)     # wanted 100 more ticks (ran 80), 20 of them stolen
    assert meter.share() == pytest.approx(0.2)
    assert steal.describe(meter.share()) == "host steal 20%"
    write(165, 70, 9000, 30)     # 5 ticks since the start of this meter: too few to say
    assert steal.Meter.MIN_TICKS > 5 and steal.Meter().share() is None
    stat.write_text("intr 1 2 3\n")
    assert steal.cpu_ticks() is None and steal.Meter().share() is None
    assert steal.describe(None).startswith("host steal")


@pytest.mark.timeout(240)
def test_the_fused_chain_ab_script_reports_each_rows_time_and_cpu():
    """benchmarks.fused_chain_ab (docs/design/compile.md quotes it): a short chain, one round, this
    checkout; every row, the controller's and the workers' CPU per call among them, as figures."""
    result = subprocess.run([sys.executable, "-m", "benchmarks.fused_chain_ab", "--rounds", "1", "--repeats", "1",
                             "--calls", "20", "--ops", "4"], cwd=ROOT, capture_output=True, text=True, timeout=230)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    for row in ("torch eager", "torch.compile", "dtorch fused", "issuing CPU", "controller CPU", "workers' CPU"):
        assert re.search(rf"{row}\s+best\s+\d+\.\d us, median\s+\d+\.\d us", result.stdout), (row, result.stdout)


def test_the_dp_step_cpu_script_runs():
    """benchmarks.dp_step_cpu (docs/design/benchmarks.md quotes it) prints every row, with 2 steps each, in
    one round of turns between dtorch's session and DDP's ranks (both kept alive throughout)."""
    import subprocess
    import sys
    result = subprocess.run([sys.executable, "-m", "benchmarks.dp_step_cpu", "--steps", "2", "--rounds", "1"], cwd=ROOT,
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    for row in ("dtorch dp4 ", "dtorch dp4, no_sync", "dtorch dp4, dtorch.compile step", "dtorch dp4, losses kept",
                "torch DDP, 4 procs", "torch.cat"):
        assert row in result.stdout, (row, result.stdout)
    assert result.stdout.count("host steal") == 7, result.stdout   # every row of steps says its steal


@pytest.mark.timeout(180)
def test_the_step_phases_script_runs():
    """benchmarks.step_phases (docs/design/benchmarks.md quotes its fsdp4 phases): a time for each phase."""
    result = subprocess.run([sys.executable, "-m", "benchmarks.step_phases", "--layout", "fsdp2", "--steps", "1"],
                            cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert re.search(r"fsdp2 medians over 1 steps: forward \d+ ms, backward \d+ ms, AdamW \+ zero_grad \d+ ms, "
                     r"step \d+ ms", result.stdout), result.stdout


@pytest.mark.timeout(180)
def test_the_redistribute_ab_script_runs():
    """benchmarks.redistribute_ab (docs/design/benchmarks.md quotes it): both default settings, each in
    its own controller process, with a time, a fault count and the workers' CPU for both redistributes."""
    result = subprocess.run([sys.executable, "-m", "benchmarks.redistribute_ab", "--rounds", "1", "--bursts", "2"],
                            cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("round 1, ")]
    assert len(rows) == 2 and "GLIBC_TUNABLES=" in rows[1], result.stdout
    for row in rows:
        assert re.search(r"S\(0\)->S\(1\) [\d.]+ ms \(\d+; CPU [\d.]+ ms\) \| "
                         r"S\(0\)->R [\d.]+ ms \(\d+; CPU [\d.]+ ms\)", row), row


def test_the_fsdp_prefetch_ab_script_runs():
    """benchmarks.fsdp_prefetch_ab (docs/design/benchmarks.md quotes it), tiny: dtorch's two rows
    in turns and FSDP2's (no torch.compile row: its compile alone takes minutes)."""
    result = subprocess.run([sys.executable, "-m", "benchmarks.fsdp_prefetch_ab", "--reps", "2", "--world", "2",
                             "--layers", "1", "--hidden", "64", "--seq", "8", "--batch", "4", "--backend", "none"],
                            cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    for row in ("dtorch, prefetch", "dtorch, no prefetch", "torch FSDP2"):
        assert re.search(rf"\n  {row} +median +[\d.]+ ms  min +[\d.]+ ms +[\d.]+x", result.stdout), result.stdout


@pytest.mark.timeout(120)
def test_the_read_idle_script_runs():
    """benchmarks.read_idle (docs/design/benchmarks.md quotes it): the cold-code line, then a dtorch read
    and the raw round trip after each pause, with their ratio."""
    result = subprocess.run([sys.executable, "-m", "benchmarks.read_idle", "--workers", "1", "--turns", "1",
                             "--reads", "3", "--pauses-ms", "0", "1"], cwd=ROOT, capture_output=True, text=True,
                            timeout=110)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert re.search(r"cold code: .* 0 ms: [\d.]+, 1 ms: [\d.]+", result.stdout), result.stdout
    for pause in ("0", "1"):
        line = rf"1 worker\(s\), pause {pause} ms: dtorch read median \d+ us .* raw round trip \d+ us .*: [\d.]+x"
        assert re.search(line, result.stdout), result.stdout


@pytest.mark.timeout(120)
def test_the_issue_floor_script_runs(tmp_path):
    """benchmarks.issue_floor (docs/design/benchmarks.md quotes it): the floor against torch eager, dtorch's
    issue loop with its publishes timed, and the reader of py-spy's raw samples, on a stack of the
    shape py-spy writes (only samples under the chain's line count)."""
    def run(*args):
        result = subprocess.run([sys.executable, "-m", "benchmarks.issue_floor", *args], cwd=ROOT,
                                capture_output=True, text=True, timeout=100)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
        return result.stdout
    assert re.search(r"torch eager [\d.]+ us/op; bare single-controller issue [\d.]+ us/op = [\d.]+x torch eager",
                     run("--rounds", "1"))
    assert re.search(r"\d+ ops, [\d.]+ us/op issuing; the issuing thread published \d+ batches, \d+ us each "
                     r"\(median\), [\d.]+% of the issue time", run("--dtorch-loop", "0.5", "--workers", "1"))
    chain = "<module> (x.py:1);run_chain (benchmarks/chain.py:18)"
    (tmp_path / "raw.txt").write_text(f"{chain};submit (c.py:5);send (s.py:9) 3\n{chain};submit (c.py:6) 1\n"
                                      "<module> (x.py:1);elsewhere (e.py:2) 50\n")
    report = run("--spy-report", str(tmp_path / "raw.txt"))
    assert "4 samples under the chain's line" in report, report
    assert "100.0%  submit (c.py)" in report and "75.0%  send (s.py)" in report, report
    assert "75.0%  send (s.py:9)" in report and "25.0%  submit (c.py:6)" in report, report


@pytest.mark.timeout(180)
@pytest.mark.parametrize("script, rows", [
    ("issue_cpu.py", (r"issue, short function: CPU us/op min [\d.]+ median [\d.]+",
                      r"issue, 300 lines into a function: CPU us/op min [\d.]+ median [\d.]+",
                      r"read of a ready \(1,\) tensor: us min \d+ median \d+")),
    ("worker_cpu.py", tuple(rf"\n  {name} +[\d.]+ us/op +-?[\d.]+ us/op added\n" for name in (
        "worker, eager", "worker, replayed", "worker, replayed row by row", "worker, eager, general path only",
        "worker, replayed, general path only", "worker, replayed row by row, general path only"))
     + (r"\n  decoding alone +[\d.]+ us/op\n", r"\n  plain torch +[\d.]+ us/op")),
    ("worker_cpu.py --grad", tuple(rf"\n  {name} +[\d.]+ us/op +-?[\d.]+ us/op added\n" for name in (
        "worker, eager", "worker, eager, general path only")) + (r"\n  plain torch +[\d.]+ us/op",)),
    ("moved_ops.py", (r"y moved S\(1\) -> S\(0\), \(64, 128\) on 4 workers: issuing CPU us/op "
                      r"min [\d.]+ median [\d.]+; wall us/op median \d+",
                      r"12 layers h = \(h @ w\)\.tanh\(\), \(1024, 1024\) float32: "
                      r"peak worker memory above idle [\d.]+ MiB")),
    ("worker_gc.py", tuple(rf"\n{variant} +objects tracked +\d+  full collection: median [\d.]+ ms, min [\d.]+ ms"
                           for variant in ("as started", "untreated"))),
])
def test_the_standalone_ab_scripts_run_against_a_checkout(script, rows):
    """benchmarks/issue_cpu.py, worker_cpu.py, moved_ops.py and worker_gc.py (docs quote them) run
    as files, importing dtorch from the checkout PYTHONPATH names, as the A/B procedure runs them."""
    script, *options = script.split()
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *options, "--reps", "2"], cwd="/",
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=170)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stdout.startswith(str(ROOT)), result.stdout
    for row in rows:
        assert re.search(row, result.stdout), (row, result.stdout)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sharded, form", [("batch", "sharded sum / count"), ("classes", "from the class shards")])
def test_the_class_loss_script_runs(sharded, form):
    """benchmarks.class_loss (quoted in closing notes): both variants, one repetition."""
    result = subprocess.run([sys.executable, "-m", "benchmarks.class_loss", "--sharded", sharded, "--batch", "16",
                             "--classes", "8", "--workers", "2", "--reps", "1"], cwd=ROOT, capture_output=True,
                            text=True, timeout=170)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    for variant in (form, "the op alone"):
        assert re.search(rf"{re.escape(variant)}.* median +[\d.]+ ms per forward \+ backward",
                         result.stdout), result.stdout


@pytest.mark.timeout(180)
def test_a_directly_started_worker_keeps_its_imports_out_of_the_collector():
    """worker_process._freeze_collector, measured by benchmarks/worker_gc.py: after it, a full
    collection no longer walks the ~175,000 objects torch's import left (a 100 ms pause)."""
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "worker_gc.py"), "--reps", "1"], cwd="/",
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=170)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    tracked = dict(re.findall(r"\n(as started|untreated) +objects tracked +(\d+)", result.stdout))
    assert int(tracked["untreated"]) > 50_000, result.stdout
    assert int(tracked["as started"]) < int(tracked["untreated"]) // 100, result.stdout


@pytest.mark.timeout(180)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_worker_stream_script_replays_a_recorded_training_step(compiled):
    """benchmarks/worker_stream_cpu.py records a 1-worker session's training steps and replays them
    into an in-process worker: it exits non-zero if any replayed command fails there, so a row
    for each phase means the whole stream ran (compiled: one RunGraph per step, one row)."""
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "worker_stream_cpu.py"), "--steps", "5",
                             *(["--compiled"] if compiled else [])],
                            cwd="/", env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                            timeout=170)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stdout.startswith(str(ROOT)), result.stdout
    assert "batch 2 x 64 tokens, 1 steps" in result.stdout, result.stdout
    phases = ("whole step \\(compiled\\)",) if compiled else ("forward", "backward", "AdamW step \\+ zero_grad")
    for phase in phases:
        assert re.search(rf"\n  {phase} +worker +[\d.]+ / +[\d.]+ \( *\d+ faults\) +torch +[\d.]+ / +[\d.]+ "
                         rf"\( *\d+ faults\) +added +[-+][\d.]+ ms", result.stdout), (phase, result.stdout)

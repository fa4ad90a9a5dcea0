"""scripts/gpu_check.sh, the GPU check, kept from rotting between GPU runs: its CPU smoke run
(--smoke) writes a record for every step, each skipped one saying why; a CPU dry run of one
step reads its script's figures; a step past the budget is skipped, saying so."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(ROOT, "scripts", "gpu_check.py"))
gpu_check = sys.modules["gpu_check"] = importlib.util.module_from_spec(spec)   # (dataclasses look it up)
spec.loader.exec_module(gpu_check)


def run_check(tmp_path, *arguments, timeout=60) -> tuple[subprocess.CompletedProcess, dict]:
    result = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), "--out", str(tmp_path),
                             *arguments], capture_output=True, text=True, timeout=timeout)
    with open(tmp_path / "gpu_check.json") as file:
        return result, json.load(file)


def test_the_smoke_run_records_every_step_and_why_each_was_skipped(tmp_path):
    result, record = run_check(tmp_path, "--smoke")
    assert result.returncode == 0, result.stdout + result.stderr
    steps = {step["name"]: step for step in record["steps"]}
    assert list(steps) == [step.name for step in gpu_check.STEPS]
    assert steps["versions"]["status"] == "passed" and "torch" in steps["versions"]["figures"]
    for step in gpu_check.STEPS:
        if step.cuda:
            assert steps[step.name]["status"] == "skipped"
            assert "--smoke" in steps[step.name]["reason"]
    assert record["smoke"] is True and record["budget_s"] == 480
    assert (tmp_path / "gpu_report.md").read_text().count("| skipped |") == sum(s.cuda for s in gpu_check.STEPS)


def test_the_step_limits_fit_the_eight_and_ten_minutes():
    assert sum(step.limit_s for step in gpu_check.STEPS) <= gpu_check.BUDGETS["one"] == 8 * 60
    assert sum(step.limit_s for step in gpu_check.MULTI_STEPS) <= gpu_check.BUDGETS["multi"] == 10 * 60


def test_the_multi_gpu_smoke_prints_its_report(tmp_path):
    result = subprocess.run(["bash", os.path.join(ROOT, "scripts", "multi_gpu_check.sh"), "--smoke", "--out",
                             str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "# dtorch multi-GPU check" in result.stdout
    record = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [step["name"] for step in record["steps"]] == [step.name for step in gpu_check.MULTI_STEPS]
    assert all(step["reason"] for step in record["steps"] if step["status"] == "skipped")


def test_multi_gpu_steps_say_what_they_need():
    relay = next(step for step in gpu_check.MULTI_STEPS if step.needs_env)
    assert "needs 2 GPUs" in gpu_check.step_reason(relay, 1)
    assert "DTORCH_CHECK_HOSTFILE" in gpu_check.step_reason(relay, 8) or os.environ.get("DTORCH_CHECK_HOSTFILE")


def test_a_cpu_dry_run_reads_the_step_script_figures(tmp_path):
    pytest.importorskip("transformers")
    result, record = run_check(tmp_path, "--cpu-dry-run", "--only", "llama generate", timeout=280)
    assert result.returncode == 0, result.stdout + result.stderr
    (step,) = record["steps"]
    assert (step["name"], step["status"], step["figures"]) == ("llama generate", "passed", {"tokens_equal": True})


def test_a_step_past_the_budget_is_skipped_saying_so(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "BUDGET_S", 5)
    slow = gpu_check.Step("slow", 10, [sys.executable, "-c", "pass"], cuda=False, figures="none")
    quick = gpu_check.Step("quick", 3, [sys.executable, "-c", "print('1 passed in 0.1s')"], cuda=False,
                           figures="pytest")
    slow_record, quick_record = gpu_check.run_check([slow, quick], smoke=True, out=str(tmp_path))
    assert slow_record["status"] == "skipped" and "budget has" in slow_record["reason"]
    assert quick_record["status"] == "passed" and quick_record["figures"] == {"passed": 1}

"""The GPU check's steps, run by scripts/gpu_check.sh (which installs what python lacks first).

Every step runs in a process of its own under its own time limit, and the limits add up to the
check's budget of 8 minutes; a step that would pass the budget is skipped, saying so. The results
go to OUT (default: $OUT, else .):

  gpu_check.json   one record per step: name, status (passed, failed, timed_out, skipped),
                   seconds, reason (why it was skipped or failed), figures (what it measured)
  gpu_check.log    every step's whole output
  gpu_report.md    the same as a page to paste into docs/design/cuda.md's results

A step marked cuda is skipped, with the reason, when torch sees no GPU, and always under
--smoke: a run of the check's structure on CPU, which tests/test_gpu_check_smoke.py runs in CI
so that the check cannot rot between GPU runs. --cpu-dry-run runs the steps that have a CPU
variant (the Llama parts and the dispatch benchmark, with --device cpu) on CPU workers instead
of skipping them: their code and the check's reading of their results, without a GPU.

    python scripts/gpu_check.py [--smoke | --cpu-dry-run] [--out DIR] [--only NAME,...]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUDGET_S = 480   # the 8 minutes on the GPU
PYTEST = [sys.executable, "-m", "pytest", "tests/test_cuda.py", "-q", "-rs", "-p", "no:cacheprovider"]
SHARED = {"DTORCH_SHARE_GPU": "1"}

VERSIONS = """
import json, sys, torch
found = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
         "gpus": torch.cuda.device_count()}
if torch.cuda.is_available():
    found["card"] = torch.cuda.get_device_name(0)
    found["torch_nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
for name in ("cupy", "zmq", "msgpack", "pytest", "transformers"):
    try:
        found[name] = getattr(__import__(name), "__version__", "?")
    except Exception as error:
        found[name] = f"not importable: {error}"
try:
    from cupy.cuda import nccl
    found["cupy_nccl"], found["cupy_nccl_build"] = nccl.get_version(), nccl.get_build_version()
except Exception as error:
    found["cupy_nccl"] = f"not available: {error}"
print(json.dumps(found))
"""


@dataclass
class Step:
    name: str
    limit_s: int
    command: list
    cuda: bool = True          # skipped without a GPU, and under --smoke
    env: dict = field(default_factory=dict)
    figures: str = "json"      # where its figures come from: "json" (--json FILE), "pytest", "stdout-json", "none"
    dry_run: list | None = None   # arguments that make it a CPU dry run (--cpu-dry-run); None: it needs a GPU


def llama(part: str, limit_s: int, *extra: str) -> Step:
    return Step(f"llama {part}", limit_s, [sys.executable, "scripts/gpu_llama.py", part, *extra], env=SHARED,
                dry_run=["--device", "cpu"])


# Limits add up to BUDGET_S: 20 + 10 + 90 + 120 + 50 + 60 + 25 + 30 + 30 + 30 + 15 = 480.
STEPS = [
    Step("versions", 20, [sys.executable, "-c", VERSIONS], cuda=False, figures="stdout-json"),
    Step("nvidia-smi", 10, ["nvidia-smi"], figures="none"),
    Step("test_cuda.py, one worker per GPU (NCCL)", 90, PYTEST, figures="pytest"),
    Step("test_cuda.py, shared-GPU mode (meshes up to 4 ranks)", 120, PYTEST, env=SHARED, figures="pytest"),
    Step("test_cuda.py -m cuda, NCCL forced on one-rank groups", 50,
         PYTEST + ["-m", "cuda", "-k", "cuda1 or one_rank or dtype"], env={"DTORCH_NCCL_SINGLE_RANK": "1"},
         figures="pytest"),
    llama("parity", 60, "--layouts", "dp2,fsdp2,tp2"),
    llama("generate", 25),
    llama("compiled", 30),
    llama("fused", 30),
    Step("dispatch and end to end vs torch eager", 30,
         [sys.executable, "scripts/gpu_dispatch.py", "--ops", "2000", "--reps", "3", "--rounds", "5",
          "--comm-mib", "64", "--matmul", "2048"],
         dry_run=["--device", "cpu", "--ops", "200", "--rounds", "2", "--comm-mib", "1", "--matmul", "64"]),
    llama("bench", 15, "--reps", "5"),
]


def cuda_reason(smoke: bool, dry_run: bool = False) -> str | None:
    """Why the CUDA steps are skipped here, or None when they run."""
    if smoke:
        return "--smoke: a CPU run of the check's structure, every CUDA step skipped"
    if dry_run:
        return "--cpu-dry-run: this step has no CPU variant"
    import torch
    if not torch.cuda.is_available():
        return f"torch.cuda.is_available() is False (torch {torch.__version__}, CUDA {torch.version.cuda})"
    return None


def run_step(step: Step, scratch: str, log, dry_run: bool = False) -> dict:
    """The step's record; its output goes to `log`."""
    command = list(step.command) + (step.dry_run if dry_run else [])
    result_file = os.path.join(scratch, re.sub(r"\W+", "_", step.name) + ".json")
    if step.figures == "json":
        command += ["--json", result_file]
    log.write(f"\n=== {step.name} (limit {step.limit_s}s): {' '.join(command)[:300]}\n")
    log.flush()
    started = time.monotonic()
    try:
        process = subprocess.Popen(command, cwd=ROOT, env={**os.environ, **step.env}, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, start_new_session=True)
    except FileNotFoundError as error:
        return {"status": "skipped", "seconds": 0.0, "reason": f"not installed: {error}", "figures": {}}
    try:
        output, _ = process.communicate(timeout=step.limit_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)   # its workers too: they share its session
        output, _ = process.communicate()
        timed_out = True
    seconds = round(time.monotonic() - started, 1)
    log.write(output)
    log.flush()
    if timed_out:
        return {"status": "timed_out", "seconds": seconds, "reason": f"ran past its {step.limit_s}s limit",
                "figures": {}}
    return {"seconds": seconds, **outcome(step, process.returncode, output, result_file)}


def outcome(step: Step, returncode: int, output: str, result_file: str) -> dict:
    """status, reason and figures from what the step left."""
    status = "passed" if returncode == 0 else "failed"
    reason = "" if returncode == 0 else f"exit code {returncode}: {last_line(output)}"
    figures: dict = {}
    if step.figures == "pytest":
        figures = pytest_counts(output)
    elif step.figures == "stdout-json" and returncode == 0:
        figures = json.loads(output.strip().splitlines()[-1])
    elif step.figures == "json" and os.path.exists(result_file):
        with open(result_file) as file:
            record = json.load(file)
        figures, status = record.get("figures", {}), record.get("status", status)
        reason = record.get("reason") or "; ".join(record.get("failures", [])) or reason
    return {"status": status, "reason": reason, "figures": figures}


def pytest_counts(output: str) -> dict:
    """{"passed": 12, "skipped": 3, ...} from pytest's last summary line."""
    lines = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", line)]
    return {word: int(count) for count, word in re.findall(r"(\d+) (\w+)", lines[-1])} if lines else {}


def last_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no output)"


def run_check(steps: list, smoke: bool, out: str, dry_run: bool = False) -> list:
    skip_cuda = cuda_reason(smoke, dry_run)
    records, started = [], time.monotonic()
    with open(os.path.join(out, "gpu_check.log"), "w") as log, tempfile.TemporaryDirectory() as scratch:
        for step in steps:
            left = BUDGET_S - (time.monotonic() - started)
            if step.cuda and skip_cuda and not (dry_run and step.dry_run is not None):
                record = {"status": "skipped", "seconds": 0.0, "reason": skip_cuda, "figures": {}}
            elif step.limit_s > left:
                record = {"status": "skipped", "seconds": 0.0, "figures": {},
                          "reason": f"the check's {BUDGET_S}s budget has {left:.0f}s left; this step may take "
                                    f"{step.limit_s}s"}
            else:
                record = run_step(step, scratch, log, dry_run and step.dry_run is not None)
            records.append({"name": step.name, **record})
            print(f"{record['status']:>9}  {record['seconds']:6.1f}s  {step.name}  {record.get('reason', '')}",
                  flush=True)
    return records


def report(records: list, out: str, smoke: bool) -> None:
    total = sum(r["seconds"] for r in records)
    header = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit(), "smoke": smoke,
              "seconds": round(total, 1), "budget_s": BUDGET_S}
    with open(os.path.join(out, "gpu_check.json"), "w") as file:
        json.dump({**header, "steps": records}, file, indent=1)
    versions = next((r["figures"] for r in records if r["name"] == "versions"), {})
    lines = [f"# dtorch GPU check, {header['date']}, commit {header['commit']}", "",
             f"card: {versions.get('card', 'none')}; torch {versions.get('torch')}, CUDA {versions.get('cuda')}; "
             f"{total:.0f}s of {BUDGET_S}s", "", "| step | status | seconds | figures or reason |", "|---|---|---|---|"]
    for r in records:
        detail = r.get("reason") or json.dumps(r["figures"])[:400]
        lines.append(f"| {r['name']} | {r['status']} | {r['seconds']:.1f} | {detail} |")
    with open(os.path.join(out, "gpu_report.md"), "w") as file:
        file.write("\n".join(lines) + "\n")


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="skip every CUDA step (a CPU run of the structure)")
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="run the steps that have a CPU variant on CPU workers, skip the rest")
    parser.add_argument("--out", default=os.environ.get("OUT") or ".")
    parser.add_argument("--only", help="comma-separated step names to run (others are left out)")
    args = parser.parse_args()
    steps = [s for s in STEPS if not args.only or s.name in args.only.split(",")]
    os.makedirs(args.out, exist_ok=True)
    records = run_check(steps, args.smoke, args.out, args.cpu_dry_run)
    report(records, args.out, args.smoke)
    print(f"results: {args.out}/gpu_check.json, {args.out}/gpu_report.md (whole output: {args.out}/gpu_check.log)")
    return 1 if any(r["status"] in ("failed", "timed_out") for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())

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
variant (the Llama parts and the dispatch benchmark, with --device cpu; test_cuda_graphs.py as
it is, its stand-in tests) on CPU instead of skipping them: their code and the check's reading
of their results, without a GPU.

--suite multi is scripts/multi_gpu_check.sh's list instead: what only 2 to 8 GPUs prove (real
NCCL between GPUs: ordering across communicators, the bucket stream, grouped gathers, transfers
between meshes, relays), in at most 10 minutes; docs/design/cuda.md says which step proves what.

    python scripts/gpu_check.py [--suite one|multi] [--smoke | --cpu-dry-run] [--out DIR] [--only NAME,...]
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
BUDGETS = {"one": BUDGET_S, "multi": 600}   # the multi-GPU check: 10 minutes
# A CPU dry run proves the code, not the times: its steps get this many times their GPU limit, and no
# budget (CI's 2 shared cores start a session several times slower than the GPU machine's 16).
DRY_RUN_SLACK = 10
PYTEST = [sys.executable, "-m", "pytest", "tests/test_cuda.py", "-q", "-rs", "-p", "no:cacheprovider"]
SHARED = {"DTORCH_SHARE_GPU": "1"}
GRAPHS = [sys.executable, "-m", "pytest", "tests/test_cuda_graphs.py", "-q", "-rs", "-p", "no:cacheprovider"]

VERSIONS = """
import json, sys, torch
found = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
         "gpus": torch.cuda.device_count()}
if torch.cuda.is_available():
    found["card"] = torch.cuda.get_device_name(0)
    try:   # a tuple in recent torch, an int in older ones
        found["torch_nccl"] = str(torch.cuda.nccl.version())
    except Exception as error:
        found["torch_nccl"] = f"not available: {error}"
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
    gpus: int = 1              # GPUs it needs (when cuda)
    needs_env: str = ""        # an environment variable it needs set (skipped, saying so, without)


def llama(part: str, limit_s: int, *extra: str, env: dict = SHARED, gpus: int = 1, name: str = "") -> Step:
    return Step(name or f"llama {part}", limit_s, [sys.executable, "scripts/gpu_llama.py", part, *extra], env=env,
                dry_run=["--device", "cpu"], gpus=gpus)


# Limits add up to BUDGET_S: 20 + 10 + 65 + 100 + 50 + 45 + 60 + 25 + 30 + 30 + 30 + 15 = 480.
STEPS = [
    Step("versions", 20, [sys.executable, "-c", VERSIONS], cuda=False, figures="stdout-json"),
    Step("nvidia-smi", 10, ["nvidia-smi"], figures="none"),
    Step("test_cuda.py, one worker per GPU (NCCL)", 65, PYTEST, figures="pytest"),
    Step("test_cuda.py, shared-GPU mode (meshes up to 4 ranks)", 100, PYTEST, env=SHARED, figures="pytest"),
    Step("test_cuda.py -m cuda, NCCL forced on one-rank groups", 50,
         PYTEST + ["-m", "cuda", "-k", "cuda1 or one_rank or dtype"], env={"DTORCH_NCCL_SINGLE_RANK": "1"},
         figures="pytest"),
    # Its CPU dry run is the same command: the stand-in tests run, the GPU ones skip saying why.
    # One compile thread: inductor's compile pool takes longer to start than these few kernels take.
    Step("test_cuda_graphs.py: fused runs as CUDA graphs", 45, GRAPHS, figures="pytest", dry_run=[],
         env={"TORCHINDUCTOR_COMPILE_THREADS": "1"}),
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


NCCL = {"DTORCH_SHARE_GPU": "0"}   # one worker per GPU: real NCCL between GPUs
# Limits add up to BUDGETS["multi"]: 20 + 10 + 240 + 120 + 40 + 120 + 30 + 20 = 600.
MULTI_STEPS = [
    STEPS[0],
    Step("nvidia-smi topo -m", 10, ["nvidia-smi", "topo", "-m"], figures="none"),
    Step("test_cuda.py over NCCL, one worker per GPU (cuda2; cuda22 with 4+ GPUs)", 240, PYTEST, env=NCCL,
         figures="pytest", gpus=2),
    llama("parity", 120, "--layouts", "dp2,fsdp2,tp2", env=NCCL, gpus=2, name="llama parity over NCCL"),
    llama("compiled", 40, env=NCCL, gpus=2, name="llama compiled step over NCCL"),
    Step("llama parity over NCCL through dtorch-launch relays (DTORCH_CHECK_HOSTFILE)", 120,
         ["dtorch-launch", "--hostfile", os.environ.get("DTORCH_CHECK_HOSTFILE", "-"), sys.executable,
          "scripts/gpu_llama.py", "parity", "--layouts", "dp2,tp2"], env=NCCL, gpus=2,
         needs_env="DTORCH_CHECK_HOSTFILE"),
    STEPS[-2],
    llama("bench", 20, "--reps", "5", env=NCCL),
]
SUITES = {"one": STEPS, "multi": MULTI_STEPS}


def step_reason(step: Step, gpus: int) -> str | None:
    """Why this CUDA step is skipped on a machine with `gpus` GPUs, or None."""
    if step.gpus > gpus:
        return f"needs {step.gpus} GPUs (real NCCL, one worker per GPU); torch sees {gpus}"
    if step.needs_env and not os.environ.get(step.needs_env):
        return (f"set {step.needs_env} to a hostfile of GPU hosts (dtorch-launch --hostfile; a host with "
                "2+ slots runs a relay)")
    return None


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
    limit_s = step.limit_s * (DRY_RUN_SLACK if dry_run else 1)
    result_file = os.path.join(scratch, re.sub(r"\W+", "_", step.name) + ".json")
    if step.figures == "json":
        command += ["--json", result_file]
    log.write(f"\n=== {step.name} (limit {limit_s}s): {' '.join(command)[:300]}\n")
    log.flush()
    started = time.monotonic()
    try:
        process = subprocess.Popen(command, cwd=ROOT, env={**os.environ, **step.env}, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, start_new_session=True)
    except FileNotFoundError as error:
        return {"status": "skipped", "seconds": 0.0, "reason": f"not installed: {error}", "figures": {}}
    try:
        output, _ = process.communicate(timeout=limit_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)   # its workers too: they share its session
        output, _ = process.communicate()
        timed_out = True
    seconds = round(time.monotonic() - started, 1)
    log.write(output)
    log.flush()
    if timed_out:
        return {"status": "timed_out", "seconds": seconds, "reason": f"ran past its {limit_s}s limit",
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


def run_check(steps: list, smoke: bool, out: str, dry_run: bool = False, budget_s: int | None = None) -> list:
    skip_cuda = cuda_reason(smoke, dry_run)
    budget_s = BUDGET_S if budget_s is None else budget_s
    gpus = 0 if skip_cuda else _gpus()
    records, started = [], time.monotonic()
    with open(os.path.join(out, "gpu_check.log"), "w") as log, tempfile.TemporaryDirectory() as scratch:
        for step in steps:
            left = budget_s - (time.monotonic() - started)
            dry = dry_run and step.dry_run is not None
            skip = step.cuda and not dry and (skip_cuda or step_reason(step, gpus))
            if skip:
                record = {"status": "skipped", "seconds": 0.0, "reason": skip, "figures": {}}
            elif step.limit_s > left and not dry_run:
                record = {"status": "skipped", "seconds": 0.0, "figures": {},
                          "reason": f"the check's {budget_s}s budget has {left:.0f}s left; this step may take "
                                    f"{step.limit_s}s"}
            else:
                record = run_step(step, scratch, log, dry)
            records.append({"name": step.name, **record})
            print(f"{record['status']:>9}  {record['seconds']:6.1f}s  {step.name}  {record.get('reason', '')}",
                  flush=True)
    return records


def _gpus() -> int:
    import torch
    return torch.cuda.device_count()


def report(records: list, out: str, smoke: bool, suite: str = "one") -> str:
    """Writes gpu_check.json and gpu_report.md; returns the report's text."""
    total = sum(r["seconds"] for r in records)
    header = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit(), "smoke": smoke,
              "suite": suite, "seconds": round(total, 1), "budget_s": BUDGETS[suite]}
    with open(os.path.join(out, "gpu_check.json"), "w") as file:
        json.dump({**header, "steps": records}, file, indent=1)
    versions = next((r["figures"] for r in records if r["name"] == "versions"), {})
    lines = [f"# dtorch {'multi-' if suite == 'multi' else ''}GPU check, {header['date']}, commit {header['commit']}",
             "", f"card: {versions.get('card', 'none')} x {versions.get('gpus', 0)}; torch {versions.get('torch')}, "
             f"CUDA {versions.get('cuda')}, NCCL {versions.get('torch_nccl')} (torch) / {versions.get('cupy_nccl')} "
             f"(cupy); {total:.0f}s of {BUDGETS[suite]}s", "",
             "| step | status | seconds | figures or reason |", "|---|---|---|---|"]
    for r in records:
        detail = r.get("reason") or json.dumps(r["figures"])[:400]
        lines.append(f"| {r['name']} | {r['status']} | {r['seconds']:.1f} | {detail} |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "gpu_report.md"), "w") as file:
        file.write(text)
    return text


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
    parser.add_argument("--suite", choices=sorted(SUITES), default="one",
                        help="one: the one-GPU check (8 minutes); multi: what 2-8 GPUs prove (10 minutes)")
    args = parser.parse_args()
    steps = [s for s in SUITES[args.suite] if not args.only or s.name in args.only.split(",")]
    os.makedirs(args.out, exist_ok=True)
    records = run_check(steps, args.smoke, args.out, args.cpu_dry_run, BUDGETS[args.suite])
    text = report(records, args.out, args.smoke, args.suite)
    if args.suite == "multi":   # the report to send back
        print("\n" + text)
    print(f"results: {args.out}/gpu_check.json, {args.out}/gpu_report.md (whole output: {args.out}/gpu_check.log)")
    return 1 if any(r["status"] in ("failed", "timed_out") for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())

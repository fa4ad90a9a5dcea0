#!/usr/bin/env bash
# The GPU check: one command on a machine with one or more GPUs, torch and cupy installed.
#   scripts/gpu_check.sh            (report: $OUT/gpu_report.md, or ./gpu_report.md)
# Installs what python lacks from .whl/ (scripts/gpu_wheels.sh; no network needed), prints versions and nvidia-smi,
# runs tests/test_cuda.py twice (as is, then with NCCL forced on for one-rank groups so a single
# GPU exercises the NCCL path end to end), the mixed CPU/CUDA test, and the GPU dispatch
# benchmark. Each step has its own time limit; the whole script stays under 10 minutes.
set -u
cd "$(dirname "$0")/.."
REPORT="${OUT:-.}/gpu_report.md"
LOG="${OUT:-.}/gpu_check.log"
: > "$LOG"

# Install only what this python lacks (the machine's own torch and cupy stay), from .whl/
# (scripts/gpu_wheels.sh fills it), into /tmp/site: no network, nothing system-wide.
MISSING=$(python3 -c '
import importlib.util
need = {"zmq": "pyzmq", "msgpack": "msgpack", "pytest": "pytest", "pytest_timeout": "pytest-timeout",
        "pytest_asyncio": "pytest-asyncio"}
print(" ".join(package for module, package in need.items() if importlib.util.find_spec(module) is None))')
if [ -n "$MISSING" ]; then
    echo "installing from .whl/: $MISSING" >> "$LOG"
    python3 -m pip install -q --no-index --find-links .whl --target /tmp/site $MISSING >> "$LOG" 2>&1 \
        || echo "could not install $MISSING from .whl/ (run scripts/gpu_wheels.sh first)" >> "$LOG"
    export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
# dtorch from this tree without installing it (no build tools needed): the repository root for
# `dtorch`, and a link for `dtorch_launcher`, which pyproject maps from launcher/.
mkdir -p /tmp/site && ln -sfn "$PWD/launcher" /tmp/site/dtorch_launcher
export PYTHONPATH="$PWD:/tmp/site:${PYTHONPATH:-}"

step() {  # step TITLE SECONDS COMMAND...: run, log everything, put the tail in the report
    local title="$1" limit="$2"; shift 2
    local started=$SECONDS
    echo "=== $title: $*" >> "$LOG"
    timeout --kill-after=10 "$limit" "$@" > /tmp/gpu_check_step.txt 2>&1
    local rc=$?
    cat /tmp/gpu_check_step.txt >> "$LOG"
    {
        echo "## $title"
        echo
        local command="$*"
        echo "\`${command%%$'\n'*}\` -> exit $rc$([ $rc -eq 124 ] && echo " (ran past ${limit}s)") in $((SECONDS - started))s"
        echo
        echo '```'
        tail -n "${TAIL:-25}" /tmp/gpu_check_step.txt
        echo '```'
        echo
    } >> "$REPORT"
}

{
    echo "# dtorch GPU check"
    echo
    echo "$(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo
} > "$REPORT"

TAIL=40 step "versions" 30 python3 -c '
import sys, torch
print("python", sys.version.split()[0])
print("torch", torch.__version__, "CUDA", torch.version.cuda, "GPUs", torch.cuda.device_count())
for name in ("cupy", "zmq", "msgpack", "pytest"):
    try:
        module = __import__(name)
        print(name, getattr(module, "__version__", "?"))
    except Exception as error:
        print(name, "NOT IMPORTABLE:", error)
try:
    from cupy.cuda import nccl
    print("NCCL", nccl.get_version(), "(cupy build:", nccl.get_build_version(), ")")
except Exception as error:
    print("NCCL NOT AVAILABLE:", error)
'
TAIL=30 step "nvidia-smi" 15 nvidia-smi
# Time limits add up to under 10 minutes (575 s).
PYTEST=(python3 -m pytest tests/test_cuda.py -q -rs -p no:cacheprovider)
step "tests/test_cuda.py" 200 "${PYTEST[@]}" -k "not one_program"
step "tests/test_cuda.py -m cuda, DTORCH_NCCL_SINGLE_RANK=1 (NCCL runs even with one rank)" 150 \
    env DTORCH_NCCL_SINGLE_RANK=1 "${PYTEST[@]}" -m cuda -k "not one_program"
step "mixed CPU/CUDA program (cross-mesh redistribute)" 60 "${PYTEST[@]}" -k one_program
step "GPU dispatch benchmark" 120 python3 scripts/gpu_dispatch.py --ops 10000 --reps 3

echo "report: $REPORT (full output: $LOG)"

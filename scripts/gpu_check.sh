#!/usr/bin/env bash
# The GPU check (issue 47): one command, at most 8 minutes, on a machine with a GPU and torch.
#   scripts/gpu_check.sh            results under $OUT (or .): gpu_check.json, gpu_report.md, gpu_check.log
#   scripts/gpu_check.sh --smoke    the same structure on CPU, every CUDA step skipped saying why (CI runs it)
# Installs what python lacks from .whl/ (scripts/gpu_wheels.sh fills it; no network needed), then
# runs scripts/gpu_check.py's steps: versions, nvidia-smi, tests/test_cuda.py with one worker per
# GPU and in shared-GPU mode (DTORCH_SHARE_GPU=1, meshes up to 4 ranks on one GPU), NCCL forced
# on one-rank groups, tests/test_cuda_graphs.py (fused runs replayed as CUDA graphs), Llama
# training parity against transformers on the GPU (fp32 and bf16 on dp2, fsdp2, tp2), generate,
# a compiled and a fused step, the dispatch benchmark against torch eager, and the Llama step
# against transformers. Record the results in docs/design/cuda.md.
set -u
cd "$(dirname "$0")/.."

# Install only what this python lacks (the machine's own torch and cupy stay), from .whl/, into
# /tmp/site: no network, nothing system-wide.
MISSING=$(python3 -c '
import importlib.util
need = {"zmq": "pyzmq", "msgpack": "msgpack", "pytest": "pytest", "pytest_timeout": "pytest-timeout",
        "pytest_asyncio": "pytest-asyncio", "transformers": "transformers"}
print(" ".join(package for module, package in need.items() if importlib.util.find_spec(module) is None))')
mkdir -p /tmp/site
if [ -n "$MISSING" ]; then
    echo "installing from .whl/: $MISSING"
    python3 -m pip install -q --no-index --find-links .whl --target /tmp/site $MISSING \
        || echo "could not install $MISSING from .whl/ (run scripts/gpu_wheels.sh first); steps that need them fail"
fi
# dtorch from this tree without installing it (no build tools needed): the repository root for
# `dtorch`, and a link for `dtorch_launcher`, which pyproject maps from launcher/.
ln -sfn "$PWD/launcher" /tmp/site/dtorch_launcher
export PYTHONPATH="$PWD:/tmp/site:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
exec python3 scripts/gpu_check.py "$@"

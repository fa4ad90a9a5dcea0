#!/usr/bin/env bash
# What one GPU cannot prove, for a user with 2 to 8 GPUs on one machine: real NCCL between GPUs,
# one worker per GPU (docs/design/cuda.md, "What one GPU cannot prove", says which step proves what).
#   scripts/multi_gpu_check.sh                 at most 10 minutes; prints a report to send back
#   DTORCH_CHECK_HOSTFILE=hosts scripts/multi_gpu_check.sh   also through dtorch-launch's per-host relays
#   scripts/multi_gpu_check.sh --smoke         the structure on CPU, every CUDA step skipped saying why
# Needs torch with CUDA, cupy (pip install 'dtorch[cuda]'), pytest and transformers. Results under
# $OUT or --out DIR (default .): gpu_check.json, gpu_report.md (the report), gpu_check.log (everything).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
exec python3 scripts/gpu_check.py --suite multi "$@"

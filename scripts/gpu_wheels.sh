#!/usr/bin/env bash
# Fetch into .whl/ the wheels scripts/gpu_check.sh installs on a GPU machine that has torch and
# cupy but no network: pyzmq, msgpack, pytest, pytest-timeout and pytest-asyncio with their
# dependencies (the device image lacks pyzmq and pytest-asyncio), for CPython 3.10-3.13 on x86_64
# Linux; the check installs only what its python lacks, picking the matching wheels. transformers
# (the Llama steps' reference) is in the image; WITH_TRANSFORMERS=1 fetches it too, for one without.
# .whl/ is git-ignored; carry it with the working tree (the device runner: carry [".whl"]).
set -eu
cd "$(dirname "$0")/.."
packages="pyzmq msgpack pytest pytest-timeout pytest-asyncio"
[ "${WITH_TRANSFORMERS:-0}" = 1 ] && packages="$packages transformers"
for version in 3.10 3.11 3.12 3.13; do
    python3 -m pip download -q --only-binary=:all: --python-version "$version" \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl $packages
done
du -sh .whl && ls .whl

#!/usr/bin/env bash
# Fetch into .whl/ the wheels scripts/gpu_check.sh installs on a GPU machine that has torch and
# cupy but no network: pyzmq, msgpack and pytest with their dependencies, for CPython 3.10-3.13 on
# x86_64 Linux (the check installs only what its python lacks, picking the matching wheels).
# .whl/ is git-ignored; carry it with the working tree (the device runner: carry [".whl"]).
set -eu
cd "$(dirname "$0")/.."
for version in 3.10 3.11 3.12 3.13; do
    python3 -m pip download -q --only-binary=:all: --python-version "$version" \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl pyzmq msgpack pytest pytest-timeout pytest-asyncio
done
du -sh .whl && ls .whl

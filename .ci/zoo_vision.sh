#!/usr/bin/env bash
# The zoo's timm and torchvision models (tests/zoo), in a virtual environment of their own.
#
# PyPI's torchvision wheels are CUDA builds: their _C.so needs libtorch_cuda.so, so they import
# only beside a CUDA build of torch, never beside the CPU build the rest of the suite runs on
# (`import torchvision` fails with "operator torchvision::nms does not exist"), and timm imports
# torchvision. Here they get PyPI's pair, torch 2.14.1 + torchvision 0.29.1 (a CUDA build that runs
# on the CPU; about 5.5 GB, which this project's machines hold in pip's local wheel store, so the
# install takes about a minute), with dtorch and its test extra on top. The venv is kept between
# runs (DTORCH_VISION_VENV), so a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."

venv="${DTORCH_VISION_VENV:-/tmp/dtorch-vision-venv}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q "torch==2.14.1" "torchvision==0.29.1" timm -e ".[test]"
"$venv/bin/python" -c "import torch, torchvision, timm; print('zoo_vision: torch', torch.__version__,
      'torchvision', torchvision.__version__, 'timm', timm.__version__)"
"$venv/bin/python" -m pytest -q -p no:cacheprovider --timeout=300 tests/zoo -k "timm or torchvision" "$@"

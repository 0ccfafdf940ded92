#!/usr/bin/env bash
# Download the pure-Python wheels the GPU machine lacks into .whl/ (git-ignored), so a device
# call can carry them (carry: [".whl"]) and scripts/gpu_suite.sh installs them there.
# Today: liger-kernel, for the recipes' loss comparison (benchmarks/e2e_finetune.py).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
version=$(sed -n 's/^liger-kernel==//p' requirements/constraints.txt)
python3 -m pip download -q --no-deps --only-binary=:all: -d .whl "liger-kernel==${version:?pin missing}"
ls -l .whl

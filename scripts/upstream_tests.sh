#!/usr/bin/env bash
# Upstream tests against hf_flash: flash-attn's tests/test_flash_attn.py through the test-only
# `flash_attn` shim, and transformers' own FlashAttention-2 model tests with "hf_flash" in place of
# "flash_attention_2". tests/README.md ("Upstream tests") says where the sources come from.
#
#   scripts/upstream_tests.sh layout [tests/upstream/layout.py options]   # writes .upstream/
#   scripts/upstream_tests.sh run OUT [FAMILY...]                        # junit XML + logs in OUT
#
# run: flash-attn's cases need CUDA (the file asks the device's capability at import); the
# transformers tree laid out for the installed release runs the tests named flash_attn_2,
# flash_attention_2 or fa2 of each family folder (all laid out ones by default), in
# HF_FLASH_UPSTREAM_JOBS processes (default 1) beside the flash-attn process.
# HF_FLASH_UPSTREAM_PER_TEST (default 16) cases per flash-attn test function.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
cmd="${1:-}"; shift || true
case "$cmd" in
layout) exec python "$here/tests/upstream/layout.py" --out "$here/.upstream" "$@" ;;
run) ;;
*) echo "usage: $0 layout [options] | run OUT [FAMILY...]" >&2; exit 2 ;;
esac
out="$(mkdir -p "$1" && cd "$1" && pwd)"; shift
# .upstream/site: pure-Python test dependencies the GPU image lacks (parameterized), unpacked
# from their wheels by `layout --wheel`
export PYTHONPATH="$here:$here/tests/upstream:$here/.upstream/site${PYTHONPATH:+:$PYTHONPATH}"
export RUN_SLOW=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export HF_FLASH_UPSTREAM_PER_TEST="${HF_FLASH_UPSTREAM_PER_TEST:-16}"
jobs="${HF_FLASH_UPSTREAM_JOBS:-1}"
# HF_FLASH_UPSTREAM_TIMEOUT=S: interrupt each pytest after S seconds (SIGINT: it still writes
# its junit XML with what ran)
pytest_=(timeout -s INT -k 30 "${HF_FLASH_UPSTREAM_TIMEOUT:-0}" python -m pytest -c "$here/tests/upstream/pytest.ini" -p hf_flash_upstream -q -rfEs
         -o junit_family=xunit1 --tb=short --continue-on-collection-errors)
python - > "$out/env.txt" <<'PY'
import hf_flash, torch, triton, transformers
print("hf_flash", hf_flash.__file__)
print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)
print("device", torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (Triton interpreter)")
PY
cat "$out/env.txt"
pids=()
if python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  ( cd "$here/.upstream/flash-attn" &&
    PYTHONPATH="$here/tests/upstream/shim:$PYTHONPATH" HF_FLASH_UPSTREAM_LOG="$out/flash_attn.progress" \
    "${pytest_[@]}" tests/test_flash_attn.py --junitxml "$out/flash_attn.xml" > "$out/flash_attn.log" 2>&1
    echo "flash-attn exit $?" >> "$out/flash_attn.log" ) &
  pids+=($!)
else
  echo "flash-attn: not run (its test file needs a CUDA device at import)" | tee "$out/flash_attn.log"
fi
version="$(python -c 'import transformers; print(transformers.__version__)')"
tree="$here/.upstream/transformers-$version"
[ -d "$tree" ] || { echo "no $tree: lay out the transformers-$version sdist first" >&2; exit 2; }
# test_pipeline_mixin.py reads transformers' sources from the tree's src/: the installed package
mkdir -p "$tree/src"
ln -sfn "$(python -c 'import os, transformers; print(os.path.dirname(transformers.__file__))')" "$tree/src/transformers"
families=("$@")
[ ${#families[@]} -gt 0 ] || families=($(python -c "import json,sys; print(' '.join(json.load(open(sys.argv[1]))['families']))" "$tree/PROVENANCE.json"))
for ((j = 0; j < jobs; j++)); do
  files=()
  for ((i = j; i < ${#families[@]}; i += jobs)); do
    files+=($(cd "$tree" && ls tests/models/${families[i]}/test_modeling_*.py))
  done
  [ ${#files[@]} -gt 0 ] || continue
  ( cd "$tree" && HF_FLASH_UPSTREAM_LOG="$out/transformers-$j.progress" \
    "${pytest_[@]}" "${files[@]}" -k "flash_attn_2 or flash_attention_2 or fa2" \
      --junitxml "$out/transformers-$j.xml" > "$out/transformers-$j.log" 2>&1
    echo "transformers shard $j exit $?" >> "$out/transformers-$j.log" ) &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p" || true; done
python "$here/tests/upstream/summary.py" "$out" | tee "$out/summary.txt"

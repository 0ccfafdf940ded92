#!/usr/bin/env bash
# Real weights (SmolLM2-135M-Instruct, hf_flash.pretrained) on the lent GPU. A device call carries
# at most 64 MiB and the GGUF file is 98 MB, so it travels in two halves over two consecutive
# calls on the same warm machine (the second within its idle window):
#
#   bash scripts/fetch_pretrained_parts.sh                     # here: .models/ (git-ignored)
#   run: bash benchmarks/pretrained_device_run.sh stage $OUT   carry [".models/gguf-0.19.0-py3-none-any.whl", ".models/part-aa"]
#   run: bash benchmarks/pretrained_device_run.sh STEPS $OUT   carry [".models/part-ab", ".models/sha256"]
#
# `stage` copies the first half and installs the gguf reader under /root/hf_flash_models; the
# second call joins the halves (checking the sha256 recorded by the fetch script) and runs STEPS,
# a comma list of:
#   tests  pytest tests/pretrained (bf16 parity, Dynamic/Static cache, padded batch) -> tests.log
#   demo   python -m hf_flash.demo (the real model)                                 -> demo.log
#   study  python -m hf_flash.recipes.long_context_study --model smollm2 $STUDY_ARGS         -> study.tar
# A later call on the same machine needs no part (carry nothing): the joined file stays there.
set -u
step=${1:?usage: pretrained_device_run.sh stage|STEPS OUT_DIR}
out=${2:?usage: pretrained_device_run.sh stage|STEPS OUT_DIR}
mkdir -p "$out"
store=/root/hf_flash_models
mkdir -p "$store"
export PYTHONUNBUFFERED=1

if [ "$step" = stage ]; then
  cp .models/part-aa "$store/" && python3 -m pip install -q --no-index --no-deps --no-compile \
    --target "$store/site" .models/*.whl && ls -la "$store" | tee "$out/stage.log"
  exit $?
fi

gguf=$store/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$gguf" ]; then
  [ -f "$store/part-aa" ] && [ -f .models/part-ab ] || {
    echo "no staged first half on this machine (run the stage call first, then this one at once)"; exit 3; }
  cat "$store/part-aa" .models/part-ab > "$gguf.tmp"
  want=$(cat .models/sha256 2>/dev/null || true)
  got=$(sha256sum "$gguf.tmp" | cut -d' ' -f1)
  if [ -n "$want" ] && [ "$want" != "$got" ]; then echo "joined GGUF sha256 $got != $want"; exit 4; fi
  mv "$gguf.tmp" "$gguf"
fi
export HF_FLASH_SMOLLM2_GGUF=$gguf HF_FLASH_CACHE=$store/cache HF_FLASH_REQUIRE_MODELS=1
export PYTHONPATH=$store/site:$PWD

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c 'import torch, triton, transformers, gguf; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__, "gguf", __import__("importlib.metadata").metadata.version("gguf"))'
} > "$out/env.txt" 2>&1
cat "$out/env.txt"

rc=0
for s in ${step//,/ }; do
  case $s in
    tests)
      timeout 300 python3 -m pytest tests/pretrained -q -p no:cacheprovider -x -rA > "$out/tests.log" 2>&1 || rc=1
      tail -5 "$out/tests.log" ;;
    demo)
      timeout 300 python3 -m hf_flash.demo > "$out/demo.log" 2>&1 || rc=1
      tail -40 "$out/demo.log" ;;
    study)
      rm -rf /tmp/study-smollm2
      timeout ${STUDY_TIMEOUT_S:-540} python3 -m hf_flash.recipes.long_context_study --model smollm2 \
        --out /tmp/study-smollm2 ${STUDY_ARGS:-} > "$out/study.log" 2>&1 || rc=1
      tail -30 "$out/study.log"
      (cd /tmp && tar cf "$out/study.tar" --exclude='ft-*' --exclude='*.jsonl' study-smollm2) ;;
    *) echo "unknown step $s"; rc=2 ;;
  esac
done
exit $rc

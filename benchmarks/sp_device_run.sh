#!/usr/bin/env bash
# One device call for sequence parallelism (DeepSpeed Ulysses over hf_flash's kernels) on a host
# with two or more GPUs (nvidia-h200-x2): install the carried wheels, the GPU correctness checks,
# then the benchmark. Each step has its own time limit (100 + 150 + 270 s): under 9 minutes in all.
#
#   bash scripts/fetch_device_wheels.sh          # here, once: .whl/ with deepspeed and its needs
#   bash benchmarks/sp_device_run.sh OUT_DIR     # there, carry [".whl"]
#
# 1. tests/integration/test_sequence_parallel.py on the GPUs: 2 ranks (NCCL, one GPU each) against
#    one process, losses and LoRA gradients within hf_flash.reference's error rule, packed documents
#    crossing the rank boundary (the 4-rank case runs where there are 4 GPUs);
# 2. the recipe on the embedded tiny model (float32) on one GPU and on 2 GPUs with FSDP2 and
#    sp_size 2: the same losses and gradient norms, step by step;
# 3. benchmarks/sp_finetune.py: the 8B Llama shape (SP_LAYERS layers, default 8) at SP_SEQ tokens
#    (default 131072) on one GPU against 2 GPUs with sp_size 2 at twice that context.
# Writes OUT_DIR/{env.txt,tests.log,recipe_check.log,recipe_check.json,bench.log,sp_finetune-*.json}.
# SP_SKIP_CHECKS=1 skips steps 1-2 (a second call for a deeper benchmark, e.g. SP_LAYERS=32).
# SP_POINTS (default one,sp; sp_same adds 2 GPUs at the one-GPU context, as SP_SAME_CONTEXT=1
# does). On a machine with one GPU the 2-rank checks skip themselves (saying why) and only the
# one-GPU baseline point runs, reported as BLOCKED for the rest.
set -u
out=${1:?usage: sp_device_run.sh OUT_DIR}
mkdir -p "$out"
# NVLink multicast stays off (KINDS.md): keep the image's settings, also in every child process
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
export NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}
export PYTHONUNBUFFERED=1 DS_ACCELERATOR=cuda

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/sp_site \
    .whl/*.whl >"$out/install.log" 2>&1 || { echo "wheel install failed"; cat "$out/install.log"; exit 1; }
  export PYTHONPATH=/tmp/sp_site:$PWD
else
  export PYTHONPATH=$PWD
fi

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c 'import torch, triton, transformers, accelerate, peft, deepspeed; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__, "accelerate", accelerate.__version__, "peft", peft.__version__, "deepspeed", deepspeed.__version__, "gpus", torch.cuda.device_count())'
  env | grep -E '^(NCCL_NVLS_ENABLE|TORCH_SYMM_MEM_DISABLE_MULTICAST|NVSHMEM_DISABLE_NVLS)='
} >"$out/env.txt" 2>&1
cat "$out/env.txt"

gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
if [ "${SP_SKIP_CHECKS:-0}" != 1 ]; then
  timeout 100 python3 -m pytest tests/integration/test_sequence_parallel.py -q -p no:cacheprovider \
    >"$out/tests.log" 2>&1
  echo "sp tests rc $?"; tail -n 4 "$out/tests.log"

  if [ "$gpus" -lt 2 ]; then echo "BLOCKED: the recipe check needs 2 GPUs, this machine has $gpus"; else
  timeout 150 python3 - "$out" >"$out/recipe_check.log" 2>&1 <<'EOF'
import json, os, subprocess, sys
from pathlib import Path
out = Path(sys.argv[1])
from hf_flash.reference import floor_for
import torch
args = ["-m", "hf_flash.recipes.lora_long_context", "--config", "recipes/configs/tiny.yaml", "--seq_len", "4096",
        "--max_steps", "3", "--learning_rate", "1e-2", "--warmup_steps", "1", "--lora_dropout", "0",
        "--progress", "false", "--save_adapter", "false", "--save_every", "0", "--synthetic_documents", "24",
        "--gradient_checkpointing", "true"]
runs = {"one": [sys.executable] + args,
        "fsdp_sp2": [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                     "recipes/configs/accelerate_fsdp.yaml", "--num_processes", "2", "--mixed_precision", "no"]
                    + args + ["--sp_size", "2"]}
rows = {}
for name, cmd in runs.items():
    d = Path("/tmp/sp_check") / name
    try:
        p = subprocess.run(cmd + ["--output_dir", str(d)], capture_output=True, text=True, timeout=70)
    except subprocess.TimeoutExpired:
        print(name, "timed out after 70 s", flush=True)
        rows[name] = None
        continue
    print(name, "rc", p.returncode, p.stdout[-1500:], p.stderr[-1500:] if p.returncode else "", flush=True)
    rows[name] = [json.loads(l) for l in (d / "metrics.jsonl").read_text().splitlines()] if p.returncode == 0 else None
ok = all(rows.values())
diffs = []
if ok:
    for a, b in zip(rows["one"], rows["fsdp_sp2"]):
        diffs.append({"step": a["step"], "loss": [a["loss"], b["loss"]], "grad_norm": [a["grad_norm"], b["grad_norm"]],
                      "loss_diff": abs(a["loss"] - b["loss"]), "grad_norm_diff": abs(a["grad_norm"] - b["grad_norm"])})
    ok = all(d["loss_diff"] <= floor_for(torch.float32) and d["grad_norm_diff"] <= floor_for(torch.float32) for d in diffs)
result = {"check": "recipe tiny float32, 1 GPU vs 2 GPUs FSDP2 + sp_size 2, seq_len 4096", "pass": ok,
          "tolerance": floor_for(torch.float32), "steps": diffs}
(out / "recipe_check.json").write_text(json.dumps(result, indent=1))
print(json.dumps(result, indent=1))
sys.exit(0 if ok else 1)
EOF
  echo "recipe check rc $?"; tail -n 30 "$out/recipe_check.log"
  fi
fi

points=${SP_POINTS:-one,sp${SP_SAME_CONTEXT:+,sp_same}}
if [ "$gpus" -lt 2 ]; then
  echo "BLOCKED: sequence parallelism needs 2 GPUs, this machine has $gpus: only the one-GPU baseline runs"
  points=one
fi
timeout "${SP_BENCH_TIMEOUT:-270}" python3 benchmarks/sp_finetune.py --out "$out" --gpus 2 --points "$points" \
  --seq-len "${SP_SEQ:-131072}" --layers "${SP_LAYERS:-8}" --steps "${SP_STEPS:-3}" --timeout 150 \
  2>&1 | tee "$out/bench.log" | tail -n 25
echo "bench rc ${PIPESTATUS[0]}"

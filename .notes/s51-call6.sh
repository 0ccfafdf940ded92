set -x
L=$OUT
bash benchmarks/hopper_env.sh > $L/env.txt 2>&1; cat $L/env.txt
PYTHONPATH=. timeout 275 python benchmarks/e2e_finetune.py --out $L --points llama-8b:32768:hf_flash llama-8b:32768:sdpa --steps 4 --no-loss --keep-attention on --timeout 130 > $L/e2e8b.log 2>&1; echo "e2e rc $?"
tail -25 $L/e2e8b.log

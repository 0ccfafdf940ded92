set -x
L=$OUT
PYTHONPATH=. timeout 200 python benchmarks/diagnostics/profile_train_step.py --family gemma2 --length 4096 --steps 6 --top 25 --providers hf_flash flex_attention > $L/profile-gemma2.log 2>&1; echo "rc $?"
grep -E "^=== |^kernels" $L/profile-gemma2.log
PYTHONPATH=. timeout 120 python benchmarks/diagnostics/profile_train_step.py --family gemma3 --length 4096 --steps 6 --top 25 --providers hf_flash > $L/profile-gemma3.log 2>&1; echo "rc $?"
grep -E "^=== |^kernels" $L/profile-gemma3.log

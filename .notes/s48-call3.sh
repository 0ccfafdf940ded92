set -x
L=$OUT
PYTHONPATH=. timeout 330 python -m pytest tests/hopper/test_hopper_attention_bwd_gpu.py -m gpu -q -p no:cacheprovider -n 8 > $L/tests-bwd.log 2>&1; echo "rc $?"
tail -3 $L/tests-bwd.log; grep -E "^FAILED|^ERROR" $L/tests-bwd.log | head -20; grep -E "^E " $L/tests-bwd.log | head -10
PYTHONPATH=. timeout 220 python benchmarks/attention.py --packed --head-dims 128 64 --packed-providers hf_flash hf_flash_triton flex flex_static sdpa_dense --rounds 3 --out $L/packed > $L/packed.log 2>&1; echo "rc $?"
tail -20 $L/packed.log; ls $L

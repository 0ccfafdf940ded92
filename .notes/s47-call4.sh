set -x
L=$OUT
PYTHONPATH=. timeout 240 python -m pytest tests/hopper/test_hopper_attention_bwd_gpu.py -m gpu -n 8 -q -p no:cacheprovider -k "packed" > $L/bwd-packed-tests.log 2>&1; echo "rc $?"
tail -2 $L/bwd-packed-tests.log; grep -E "^FAILED|^ERROR" $L/bwd-packed-tests.log | head
PYTHONPATH=. timeout 200 python -m pytest tests/hopper/test_hopper_attention_gpu.py -m gpu -n 8 -q -p no:cacheprovider -k "varlen" > $L/fwd-varlen-tests.log 2>&1; echo "rc $?"
tail -2 $L/fwd-varlen-tests.log; grep -E "^FAILED|^ERROR" $L/fwd-varlen-tests.log | head
PYTHONPATH=. timeout 150 python -m pytest tests/ops/test_flash_attn_gpu.py -m gpu -n 8 -q -p no:cacheprovider -k "varlen" > $L/api-varlen-tests.log 2>&1; echo "rc $?"
tail -2 $L/api-varlen-tests.log; grep -E "^FAILED|^ERROR" $L/api-varlen-tests.log | head
PYTHONPATH=. timeout 150 python benchmarks/attention.py --packed --head-dims 64 --packed-providers hf_flash hf_flash_triton flex flex_static sdpa_dense --rounds 3 --out $L/packed > $L/packed.log 2>&1; echo "rc $?"
tail -12 $L/packed.log

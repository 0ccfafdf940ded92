set -x
L=$OUT
PYTHONPATH=. timeout 200 python -m pytest tests/hopper/test_hopper_attention_bwd_gpu.py -m gpu -q -p no:cacheprovider -n 8 -k "softcap or windowed_public or test_dq_every_variant_matches" > $L/tests-softcap.log 2>&1; echo "rc $?"
tail -3 $L/tests-softcap.log; grep -E "^FAILED|^ERROR" $L/tests-softcap.log | head -20; grep -E "^E " $L/tests-softcap.log | head -10
PYTHONPATH=. timeout 120 python -m pytest tests/hopper/test_hopper_attention_bwd_gpu.py -m gpu -q -p no:cacheprovider -n 4 -k "test_ordered_dq_repeats_bitwise and full and 128" > $L/tests-oom.log 2>&1; echo "rc $?"
tail -3 $L/tests-oom.log; grep -E "^FAILED|^ERROR" $L/tests-oom.log | head
PYTHONPATH=. timeout 120 python -m pytest tests/ops/test_flash_attn_gpu.py -m gpu -q -p no:cacheprovider -n 8 -k "softcap or path_choice" > $L/tests-api.log 2>&1; echo "rc $?"
tail -3 $L/tests-api.log; grep -E "^FAILED|^ERROR" $L/tests-api.log | head
timeout 150 env PYTHONPATH=. python benchmarks/hopper_attention_bwd.py $L/d256cap.json --head-dims 256 --seqlens 4096 16384 --softcap 50 --variants kv64-m64-s2-splitd+triton kv64-m64-s2-splitd+dq2x64-n32-s3 --no-triton-backward --rounds 3 > $L/d256cap.log 2>&1; echo "rc $?"; grep -E "^d256" $L/d256cap.log
timeout 80 env PYTHONPATH=. python benchmarks/hopper_attention_bwd.py $L/d256capw.json --head-dims 256 --seqlens 16384 --masks causal --window 4096 --softcap 50 --variants kv64-m64-s2-splitd+triton kv64-m64-s2-splitd+dq2x64-n32-s3 --no-triton-backward --rounds 3 > $L/d256capw.log 2>&1; echo "rc $?"; grep -E "^d256" $L/d256capw.log
timeout 120 env PYTHONPATH=. python benchmarks/hopper_attention_bwd.py $L/d128cap.json --head-dims 128 --seqlens 4096 16384 --softcap 50 --variants kv64-m64-s2-splitd --library-default --rounds 3 > $L/d128cap.log 2>&1; echo "rc $?"; grep -E "^d128" $L/d128cap.log

set -x
L=$OUT
F="timeout 110 env PYTHONPATH=. python benchmarks/diagnostics/packed_forms.py"
$F $L/p128c.json --head-dim 128 --forms ws2x4-overlap-fma/kv2x64-m64-s2+dq2x64-n64-s3 ws2x4-overlap-fma/kv2x64-m64-s2+dq2x64-n64-s4 --rounds 5 > $L/p128c.log 2>&1; echo "rc $?"; grep -v "^{" $L/p128c.log | grep TFLOP
$F $L/p128f.json --head-dim 128 --non-causal --forms ws2x4-overlap-fma/kv2x64-m64-s2-dqwld ws2x4-overlap-fma/kv2x64-m64-s2+dq2x64-n64-s3 ws2x4-overlap-fma/kv2x64-m64-s2+dq2x64-n64-s4 ws2x4-overlap-fma/kv2x64-m64-s2-dqwl --rounds 5 > $L/p128f.log 2>&1; echo "rc $?"; grep -v "^{" $L/p128f.log | grep TFLOP
$F $L/p64c.json --head-dim 64 --forms ws3x4-pp-s3/kv2x64-m64-s2+dq3x64-n64-s3 ws3x4-pp-s3/kv2x64-m64-s2+dq3x64-n64-s4 ws3x4-pp-s3/kv2x64-m64-s2-dqa --rounds 5 > $L/p64c.log 2>&1; echo "rc $?"; grep -v "^{" $L/p64c.log | grep TFLOP
$F $L/p64f.json --head-dim 64 --non-causal --forms ws2x4-overlap-fma/kv2x64-m64-s2+triton ws2x4-overlap-fma/kv2x64-m64-s2+dq3x64-n64-s3 ws2x4-overlap-fma/kv2x64-m64-s2+dq3x64-n64-s4 ws2x4-overlap-fma/kv2x64-m64-s2-dqa --rounds 5 > $L/p64f.log 2>&1; echo "rc $?"; grep -v "^{" $L/p64f.log | grep TFLOP
$F $L/p256c.json --head-dim 256 --forms ws2x4-overlap-fma-d256/kv64-m64-s2-splitd+triton ws2x4-overlap-fma-d256/kv64-m64-s2-splitd+dq2x64-n32-s2 --rounds 3 --profile 3 > $L/p256c.log 2>&1; echo "rc $?"; grep -v "^{" $L/p256c.log | grep -v Warn | tail -16
timeout 150 env PYTHONPATH=. python benchmarks/hopper_attention_bwd.py $L/d256.json --head-dims 256 --seqlens 4096 16384 --variants kv64-m64-s2-splitd+triton kv64-m64-s2-splitd+dq2x64-n32-s2 kv64-m64-s2-splitd+dq2x64-n32-s3 --no-triton-backward --rounds 3 > $L/d256.log 2>&1; echo "rc $?"; tail -30 $L/d256.log

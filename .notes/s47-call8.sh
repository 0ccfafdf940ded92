set -x
L=$OUT
for d in 64 128; do
PYTHONPATH=. timeout 150 python benchmarks/diagnostics/packed_forms.py $L/profile-d$d.json --head-dim $d --forms triton/triton $( [ $d = 64 ] && echo ws3x4-pp-s3 || echo ws2x4-overlap-fma )/kv2x64-m64-s2 --rounds 1 --profile 5 > $L/profile-d$d.log 2>&1; echo "rc $?"
grep -A12 "device us" $L/profile-d$d.log
done

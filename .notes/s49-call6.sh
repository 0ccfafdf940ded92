set -x
L=$OUT
PYTHONPATH=. timeout 270 python benchmarks/attention.py --out $L/cap --providers hf_flash hf_flash_triton flex --head-dims 128 256 --masks softcap --seqlens 4096 16384 --rounds 3 --min-calls 3 > $L/cap.log 2>&1; echo "rc $?"
tail -30 $L/cap.log; ls -R $L

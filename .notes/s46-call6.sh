set -x
L=$OUT
PYTHONPATH=. timeout 60 python - > $L/counter-cost.log 2>&1 <<'PY'
import time, torch
from hf_flash.kernels.hopper import attention_fwd as hk
dev = torch.device("cuda", 0)
torch.zeros(1, device=dev)
for name, fn in [("item_counter", lambda: hk.item_counter(dev)),
                 ("is_current_stream_capturing", torch.cuda.is_current_stream_capturing),
                 ("getCurrentRawStream", lambda: torch._C._cuda_getCurrentRawStream(0)),
                 ("torch.zeros(1) int32", lambda: torch.zeros(1, dtype=torch.int32, device=dev))]:
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(10000):
            fn()
        us = (time.perf_counter() - t) / 10000 * 1e6
    torch.cuda.synchronize()
    print(f"{name:32} {us:7.2f} us")
PY
cat $L/counter-cost.log
for i in 1 2; do PYTHONPATH=. timeout 60 python benchmarks/diagnostics/attention_host_time.py --seqlen 512 > $L/host-512-$i.log 2>&1; grep -E "hopper_attention|SDPA forward \(" $L/host-512-$i.log; done
PYTHONPATH=. timeout 60 python benchmarks/diagnostics/attention_host_time.py --seqlen 256 > $L/host-256.log 2>&1; grep -E "hopper_attention|SDPA forward \(" $L/host-256.log

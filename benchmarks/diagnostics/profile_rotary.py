"""Where the fused rotary backward spends its time (diagnostic; prints a short report).

    PYTHONPATH=. python benchmarks/diagnostics/profile_rotary.py

For T in 4K, 16K, 32K tokens (bf16, 32/8 heads, head_dim 128, Llama layout): the device
kernels one backward launches and their time (torch.profiler), and the wall time per backward
(100 calls, then a synchronize). At 4K, where the host dominates, cProfile of the main thread
and of the kernel launcher (which runs on the autograd engine's device thread).
"""

import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.rope import _rotary_inputs  # noqa: E402
from hf_flash.rotary import apply_rotary_pos_emb as fused  # noqa: E402


def _op_profile(bwd):
    """cProfile the kernel launcher inside the backward (it runs on the autograd engine's device
    thread, which a main-thread profiler does not see) and time it against the whole call."""
    import hf_flash.rotary as rotary

    real = rotary._launch
    prof = cProfile.Profile()
    spent = []

    def wrapped(*args, **kwargs):
        t0 = time.perf_counter()
        prof.enable()
        out = real(*args, **kwargs)
        prof.disable()
        spent.append(time.perf_counter() - t0)
        return out

    rotary._launch = wrapped
    try:
        t0 = time.perf_counter()
        for _ in range(50):
            bwd()
        torch.cuda.synchronize()
        total = (time.perf_counter() - t0) / 50
    finally:
        rotary._launch = real
    print(f"--- backward {total * 1e3:.3f} ms per call (profiled), of which "
          f"{sum(spent) / max(len(spent), 1) * 1e3:.3f} ms in the launcher ({len(spent)} launches)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(15)


def main():
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    for tokens in (4096, 16384, 32768):
        q, k, cos, sin = _rotary_inputs(tokens)
        qg, kg = q.detach().requires_grad_(), k.detach().requires_grad_()
        qo, ko = fused(qg, kg, cos, sin)
        gq, gk = torch.randn_like(qo), torch.randn_like(ko)

        def bwd():
            return torch.autograd.grad((qo, ko), (qg, kg), (gq, gk), retain_graph=True)

        for _ in range(5):
            bwd()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                bwd()
            torch.cuda.synchronize()
        print(f"\n=== T={tokens}: profiler, 10 backward calls")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=60))
        t0 = time.perf_counter()
        for _ in range(100):
            bwd()
        torch.cuda.synchronize()
        host_ms = (time.perf_counter() - t0) / 100 * 1e3
        if tokens == 4096:
            prof_py = cProfile.Profile()
            prof_py.enable()
            for _ in range(50):
                bwd()
            torch.cuda.synchronize()
            prof_py.disable()
            print("--- cProfile, 50 backward calls (main thread; the autograd engine's device thread")
            print("    is invisible to cProfile, so its work shows as time inside run_backward)")
            pstats.Stats(prof_py).sort_stats("tottime").print_stats(12)
            _op_profile(bwd)
        print(f"T={tokens}: wall per backward {host_ms:.3f} ms")


if __name__ == "__main__":
    main()

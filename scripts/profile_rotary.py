"""Where the fused rotary backward spends its time (diagnostic; prints a short report).

    PYTHONPATH=. python scripts/profile_rotary.py

For T in 4K, 16K, 32K tokens (bf16, 32/8 heads, head_dim 128, Llama layout): the device
kernels one backward launches (torch.profiler), and the backward timed three ways: as
``benchmarks/rope.py`` does (events around ``torch.autograd.grad``), with a synchronize before
the host clock, and as a CUDA-graph replay (device time only, no host overhead).
"""

import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.rope import _rotary_inputs
from hf_flash.rotary import apply_rotary_pos_emb as fused


def main():
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
        graph_ms = float("nan")
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                bwd()
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                bwd()
            g.replay()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(100):
                g.replay()
            end.record()
            torch.cuda.synchronize()
            graph_ms = start.elapsed_time(end) / 100
        except Exception as err:  # diagnostic: report and go on
            print("graph capture failed:", type(err).__name__, err)
        print(f"T={tokens}: wall per backward {host_ms:.3f} ms, graph replay {graph_ms:.3f} ms")


if __name__ == "__main__":
    main()

"""Where a LoRA training step spends its time: hf_flash beside sdpa (diagnostic).

    PYTHONPATH=. python benchmarks/diagnostics/profile_train_step.py [--length 4096] [--steps 6] [--family llama]

The model, LoRA and gradient checkpointing of benchmarks/e2e_train.py (``--family``: its 1.2B
Llama shape by default, or any family it builds, e.g. gemma2), one unpadded sequence of
``--length`` tokens. For each attention implementation it prints:

* wall ms per step (median of ``--steps``) and host ms per step (time until the step's work is
  queued, i.e. the loop without the final synchronize); host ~ wall means host-bound;
* from torch.profiler over one step: kernels launched, device busy ms, device syncs
  (cudaStreamSynchronize / cudaDeviceSynchronize / cudaMemcpy to host), and the top host
  operators by self CPU time;
* cProfile of one step: the Python functions with the most own time.

e2e_train's short 4K row measured hf_flash at 0.57x-0.63x sdpa tokens/s while the attention
kernels alone are >= 0.7x cuDNN at that shape and attention is a small part of the step: this
script says whether the gap is host time, syncs or device time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.e2e_train import build, make_batch, set_checkpointing  # noqa: E402

SYNC_OPS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync", "cudaMemcpy")


def one_step(model, optimizer, batch):
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def report(name: str, model, optimizer, batch, steps: int, top: int) -> dict:
    for _ in range(2):
        one_step(model, optimizer, batch)
    torch.cuda.synchronize()
    walls, hosts = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        one_step(model, optimizer, batch)
        hosts.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
    walls.sort()
    hosts.sort()
    wall, host = walls[len(walls) // 2] * 1e3, hosts[len(hosts) // 2] * 1e3
    print(f"\n=== {name}: wall {wall:.1f} ms/step, host {host:.1f} ms/step "
          f"(all walls: {', '.join(f'{w * 1e3:.0f}' for w in walls)})", flush=True)  # fmt: skip

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        one_step(model, optimizer, batch)
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    busy = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    syncs = {e.key: e.count for e in events if e.key in SYNC_OPS}
    print(f"kernels {kernels}, device busy {busy / 1e3:.1f} ms, sync-like calls {syncs}")
    print(events.table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60))

    pr = cProfile.Profile()
    pr.enable()
    one_step(model, optimizer, batch)
    torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(top)
    print(s.getvalue())
    return {"wall_ms": wall, "host_ms": host, "kernels": kernels, "device_busy_ms": busy / 1e3}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--providers", nargs="+", default=["sdpa", "hf_flash"])
    parser.add_argument("--family", default="llama", help="a family benchmarks/e2e_train.py builds")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    import hf_flash

    hf_flash.register()
    model = build(args.family, smoke=False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    batch, _ = make_batch("single", args.length, model.config.vocab_size)
    set_checkpointing(model, False)
    results = {}
    for provider in args.providers:
        model.base_model.model.set_attn_implementation(provider)
        results[provider] = report(provider, model, optimizer, batch, args.steps, args.top)
    print("\n=== summary:", results)


if __name__ == "__main__":
    main()

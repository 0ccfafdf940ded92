"""Where a decode step spends its time on the GPU: hf_flash beside sdpa (diagnostic).

    PYTHONPATH=. python benchmarks/diagnostics/profile_decode.py [--prompt 4096] [--steps 32]

The 1.2B Llama of benchmarks/e2e_generate.py (random weights, bf16), batch 1, a ``--prompt``
token prompt prefilled once, then ``--steps`` greedy decode steps through ``model(...)`` with the
DynamicCache, as generate() runs them. For each attention implementation it prints:

* wall ms per step (synchronised at the end of the loop only, so host and device overlap as in
  generate) and the host ms per step (time until the loop has queued everything);
* from torch.profiler over the same loop: kernels launched per step, device busy ms per step
  (sum of kernel times) and the top host-side operators by self CPU time;
* cProfile of the loop: the Python functions with the most own time.

If host ms/step ~ wall ms/step the step is host-bound; the launch counts and the hotspots say
where that host time goes. With ``--cache static`` (default: both) it also profiles generate()
with the static cache (compiled, CUDA graphs: device-bound) and lists the kernels of a decode
step by device time (a run of ``--steps`` new tokens minus a run of one).
benchmarks/diagnostics/decode_host_overhead.py measures the Python part on a CPU.

``--host-breakdown`` (static cache only) times where a compiled generate() step spends its host
time: generate's own pieces (``prepare_inputs_for_generation``, the compiled forward call until
it returns, ``_update_model_kwargs_for_generation``, the stop check, which waits for the device)
are wrapped with perf_counter on this model instance, and cProfile plus torch.profiler's CPU
operators show what inside the compiled call costs (dynamo guards, AOT wrappers, CUDA-graph tree
bookkeeping, the graph launch).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import pstats
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.e2e_generate import build_model  # noqa: E402


def decode_loop(model, ids, steps: int):
    """A function that prefills ``ids`` into a fresh DynamicCache (untimed), then times ``steps``
    one-token greedy steps; it returns (host seconds to queue them, wall seconds to finish)."""
    from transformers import DynamicCache

    prompt_len = ids.shape[1]

    def run():
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            out = model(input_ids=ids, past_key_values=cache, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for i in range(steps):
                pos = torch.full((1, 1), prompt_len + i, device=ids.device)
                logits = model(input_ids=tok, past_key_values=cache, position_ids=pos,
                               use_cache=True).logits  # fmt: skip
                tok = logits[:, -1:].argmax(-1)
            host = time.perf_counter() - t0
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        return host, wall

    return run


def report_static(name: str, model, ids, steps: int, top: int) -> None:
    """generate() with the static cache (compiled decode step, CUDA graphs): device time per
    step by kernel, from torch.profiler over a run of ``steps`` new tokens minus a run of 1."""
    gen = dict(do_sample=False, pad_token_id=128004, cache_implementation="static",
               attention_mask=torch.ones_like(ids))  # fmt: skip
    with torch.no_grad():
        for n in (steps, 1):  # warm-up: compilation, graph capture
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, **gen)
        per_kernel = {}
        for n, sign in ((steps, 1), (1, -1)):
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                model.generate(ids, max_new_tokens=n, min_new_tokens=n, **gen)
                torch.cuda.synchronize()
            for e in prof.key_averages():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    t, c = per_kernel.get(e.key, (0.0, 0))
                    per_kernel[e.key] = (t + sign * e.self_device_time_total, c + sign * e.count)
    decode = {k: v for k, v in per_kernel.items() if v[1] > 0}
    busy = sum(t for t, _ in decode.values()) / (steps - 1)
    print(f"\n=== {name} static (compiled): device busy {busy / 1e3:.3f} ms/step over "
          f"{sum(c for _, c in decode.values()) / (steps - 1):.0f} kernels/step")
    rows = sorted(decode.items(), key=lambda kv: -kv[1][0])[:top]
    for key, (t, c) in rows:
        print(f"  {t / (steps - 1):9.1f} us/step  {c / (steps - 1):6.1f}/step  {key[:90]}")


def host_breakdown_static(name: str, model, ids, steps: int, top: int) -> None:
    """Host microseconds per decode step of a compiled static-cache generate(), by piece."""
    from collections import defaultdict

    import transformers.generation.utils as gen_utils

    gen = dict(do_sample=False, pad_token_id=128004, cache_implementation="static",
               attention_mask=torch.ones_like(ids))  # fmt: skip
    spans = defaultdict(list)

    def timed(label, fn):
        @functools.wraps(fn)  # generate inspects prepare_inputs_for_generation's signature
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spans[label].append(time.perf_counter() - t0)
        return wrapper

    real_get = model.get_compiled_call
    stop_cls = gen_utils.StopCheck
    real_stop = stop_cls.__call__
    model.prepare_inputs_for_generation = timed("prepare_inputs_for_generation",
                                                model.prepare_inputs_for_generation)
    model._update_model_kwargs_for_generation = timed("_update_model_kwargs_for_generation",
                                                      model._update_model_kwargs_for_generation)
    model.get_compiled_call = lambda cfg: timed("compiled forward call", real_get(cfg))
    stop_cls.__call__ = timed("stop check (waits for the device)", real_stop)
    real_masks = gen_utils.create_masks_for_generate
    gen_utils.create_masks_for_generate = timed("  of which create_masks_for_generate", real_masks)
    try:
        with torch.no_grad():
            for n in (steps, 1):  # warm-up: compilation, graph capture
                model.generate(ids, max_new_tokens=n, min_new_tokens=n, **gen)
            walls = {}
            for n in (steps, 1):
                spans.clear()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                model.generate(ids, max_new_tokens=n, min_new_tokens=n, **gen)
                torch.cuda.synchronize()
                walls[n] = time.perf_counter() - t0
                if n == steps:
                    kept = {k: list(v) for k, v in spans.items()}
            per_step = (walls[steps] - walls[1]) / (steps - 1)
            print(f"\n=== {name} static host breakdown: {per_step * 1e3:.3f} ms/step "
                  f"(generate of {steps} minus generate of 1)")
            for label, ts in kept.items():
                # the compiled call serves decode steps only; the others also ran for the prefill
                decode = ts if label == "compiled forward call" else ts[1:]
                if decode:
                    med = sorted(decode)[len(decode) // 2]
                    print(f"  {label:45s} median {med * 1e6:8.1f} us  mean "
                          f"{sum(decode) / len(decode) * 1e6:8.1f} us  over {len(decode)} calls")
            prof_py = cProfile.Profile()
            prof_py.enable()
            model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, **gen)
            prof_py.disable()
            buf = io.StringIO()
            pstats.Stats(prof_py, stream=buf).sort_stats("tottime").print_stats(top)
            print(buf.getvalue())
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, **gen)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top,
                                            max_name_column_width=60))
    finally:
        stop_cls.__call__ = real_stop
        gen_utils.create_masks_for_generate = real_masks
        for attr in ("prepare_inputs_for_generation", "_update_model_kwargs_for_generation",
                     "get_compiled_call"):
            model.__dict__.pop(attr, None)


def report(name: str, model, ids, steps: int, top: int) -> None:
    run = decode_loop(model, ids, steps)
    run()  # warm-up: Triton compilation, cuBLAS handles
    host, wall = min(run() for _ in range(3))
    print(f"\n=== {name}: wall {wall / steps * 1e3:.2f} ms/step, host {host / steps * 1e3:.2f} ms/step")

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    launches = sum(e.count for e in kernels)
    busy_us = sum(e.self_device_time_total for e in kernels)
    # the profiled run includes its prefill, so these are upper bounds
    print(f"kernels per step <= {launches / steps:.1f}, device busy <= {busy_us / steps / 1e3:.2f} ms/step "
          "(profiled run; includes the prefill)")
    print(events.table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60))

    prof_py = cProfile.Profile()
    prof_py.enable()
    run()
    prof_py.disable()
    buf = io.StringIO()
    pstats.Stats(prof_py, stream=buf).sort_stats("tottime").print_stats(top)
    print(buf.getvalue())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--top", type=int, default=25, help="rows of each profile to print")
    parser.add_argument("--attn", nargs="+", default=["sdpa", "hf_flash"])
    parser.add_argument("--cache", nargs="+", default=["dynamic", "static"],
                        choices=["dynamic", "static"])
    parser.add_argument("--host-breakdown", action="store_true",
                        help="static cache: where a compiled step's host time goes")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (benchmarks/diagnostics/decode_host_overhead.py measures the host part on a CPU)")
    import hf_flash

    hf_flash.register()
    model = build_model()
    ids = torch.randint(0, 128000, (1, args.prompt), device="cuda")
    for attn in args.attn:
        torch._dynamo.reset()  # each implementation compiles from a clean state
        model.set_attn_implementation(attn)
        if "dynamic" in args.cache:
            report(attn, model, ids, args.steps, args.top)
        if "static" in args.cache:
            report_static(attn, model, ids, args.steps, args.top)
            if args.host_breakdown:
                host_breakdown_static(attn, model, ids, args.steps, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())

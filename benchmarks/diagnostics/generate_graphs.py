"""How often generate() with the static cache compiles and records CUDA graphs, call by call.

    PYTHONPATH=. python benchmarks/diagnostics/generate_graphs.py [--prompt 4096] [--new 32] [--calls 3] [--log]

The 1.2B Llama of benchmarks/e2e_generate.py, batch 1. For each attention implementation
(from a clean compiler state) and each way of getting a static cache (``cache_implementation=
"static"``, which generate sizes to the request, and a StaticCache object passed in and reset
between calls, as e2e_generate does), ``--calls`` identical generate() calls are made; each
prints the dynamo frames it compiled, the CUDA graphs it recorded (cudagraph trees'
``record_function``) and its wall time. A steady state records nothing after the first call:
a graph recorded on every call costs its capture (~10-20 ms) and memory each time.
``--log`` turns on torch's recompile and cudagraph logs (re-record reasons).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.e2e_generate import build_model  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--attn", nargs="+", default=["hf_flash", "sdpa"])
    parser.add_argument("--log", action="store_true", help="torch's recompile/cudagraph logs")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (CUDA graphs)")
    import logging

    import torch._inductor.cudagraph_trees as trees
    from torch._dynamo.utils import counters
    from transformers import StaticCache

    import hf_flash

    if args.log:
        torch._logging.set_logs(recompiles=True, cudagraphs=True)
        logging.getLogger("torch._inductor.cudagraph_trees").setLevel(logging.DEBUG)
    records = [0]
    real_record = trees.CUDAGraphTreeManager.record_function

    def record_function(self, *a, **k):
        records[0] += 1
        return real_record(self, *a, **k)

    trees.CUDAGraphTreeManager.record_function = record_function
    hf_flash.register()
    model = build_model()
    ids = torch.randint(0, 128000, (1, args.prompt), device="cuda")
    for attn in args.attn:
        model.set_attn_implementation(attn)
        for how in ("cache_implementation", "cache object"):
            torch._dynamo.reset()
            counters.clear()
            kw = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False,
                      pad_token_id=128004, attention_mask=torch.ones_like(ids))  # fmt: skip
            cache = None
            if how == "cache object":
                cache = StaticCache(config=model.config, max_cache_len=args.prompt + args.new + 8)
            else:
                kw["cache_implementation"] = "static"
            print(f"=== {attn}, static cache by {how}")

            def call(n):
                if cache is not None:
                    cache.reset()
                    kw["past_key_values"] = cache
                kw["max_new_tokens"] = kw["min_new_tokens"] = n
                frames, recorded = counters["stats"]["unique_graphs"], records[0]
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                with torch.no_grad():
                    model.generate(ids, **kw)
                torch.cuda.synchronize()
                ms = (time.perf_counter() - t0) * 1e3
                return ms, counters["stats"]["unique_graphs"] - frames, records[0] - recorded

            for i in range(args.calls):
                ms, frames, recorded = call(args.new)
                one, *_ = call(1)  # the prefill and set-up alone
                print(f"  call {i}: {frames} frames compiled, {recorded} CUDA graphs recorded, "
                      f"{ms:.1f} ms = {one:.1f} ms (a 1-token call) + "
                      f"{(ms - one) / (args.new - 1):.2f} ms per further token")
            del cache
    return 0


if __name__ == "__main__":
    sys.exit(main())

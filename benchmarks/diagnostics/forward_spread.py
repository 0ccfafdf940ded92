"""Round-to-round spread of one attention pass, hf_flash beside SDPA, with the GPU's clock
sampled while each round runs (diagnostic).

The bar's rows are each provider's median round, and the rounds of one provider can differ by
10% (H200, d128 causal 16K forward: 3.13-3.15 ms in two rounds, 3.43-3.48 ms in three). This
separates three explanations:

* the GPU's clock or power state moved between rounds: the rounds' mean SM clock (nvidia-smi
  sampling every 10 ms through the run) follows the time, for SDPA as for us;
* the kernel has slow and fast modes of its own (which SMs take which items, where the output
  lands): the per-call times of a round are bimodal, or rounds differ at equal clocks;
* drift over the run: the paired ratio of each round (SDPA's time / ours, the two measured back
  to back in alternating order) is steadier than the ratio of the two medians.

    PYTHONPATH=. python benchmarks/diagnostics/forward_spread.py --shapes 128:causal:16384 \\
        128:full:8192 --rounds 12 --out DIR

``--variants`` adds forward variants run through the Hopper launcher directly, with one output
buffer for every call (no allocation), next to the public path (``hf_flash``). Shapes as in
benchmarks/attention.py (bf16, Hq=32, Hkv=8, batch 16K / S). Forward only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from benchmarks import attention as bench
from benchmarks.diagnostics.hopper_bwd_ncu import forward_call

FLUSH_BYTES = 256 * 2**20


class ClockStream:
    """``nvidia-smi`` sampling the SM clock (MHz) and power (W) every ``period_ms`` for the whole
    run (a read-only query); :meth:`window` summarises the samples between two ``time.time()``
    stamps. Without nvidia-smi the rounds are still timed and ``error`` says why."""

    def __init__(self, device: int, period_ms: int = 10):
        import shutil
        import subprocess
        import tempfile

        self.error, self._proc, self.samples = None, None, []
        exe = shutil.which("nvidia-smi")
        if exe is None:
            self.error = "nvidia-smi not found"
            return
        # a file, not a pipe: nothing reads a pipe until the run ends, and a full one (~64 KB,
        # ~1,700 samples) would stall nvidia-smi
        self._log = tempfile.TemporaryFile(mode="w+")
        self._proc = subprocess.Popen(
            [exe, "-i", str(device), "--query-gpu=timestamp,clocks.sm,power.draw", "--format=csv,noheader,nounits",
             f"-lms={period_ms}"],
            stdout=self._log, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip

    def stop(self) -> None:
        import datetime

        if self._proc is None:
            return
        self._proc.terminate()
        self._proc.wait()
        self._log.seek(0)
        text = self._log.read()
        self._log.close()
        for line in text.splitlines():
            parts = [x.strip() for x in line.split(",")]
            try:
                stamp = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                self.samples.append((stamp, float(parts[1]), float(parts[2])))
            except (ValueError, IndexError):
                continue
        if not self.samples:
            self.error = f"no samples parsed; nvidia-smi said: {text[:200]!r}"

    def window(self, t0: float, t1: float) -> dict:
        inside = [(c, w) for t, c, w in self.samples if t0 <= t <= t1]
        if not inside:
            return {}
        clocks, power = zip(*inside)
        return {"sm_mhz_mean": statistics.fmean(clocks), "sm_mhz_min": min(clocks), "sm_mhz_max": max(clocks),
                "power_w_mean": statistics.fmean(power), "samples": len(clocks)}  # fmt: skip


def time_calls(fn, calls: int, flush: torch.Tensor) -> list[float]:
    """Device time (ms) of each of ``calls`` calls, the L2 emptied (zeroed buffer) before each."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(calls)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(calls)]
    for s, e in zip(starts, ends):
        flush.zero_()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def run_shape(spec: str, args, flush) -> dict:
    head_dim, mask, seqlen = spec.split(":")
    head_dim, seqlen = int(head_dim), int(seqlen)
    if mask not in ("causal", "full"):
        raise SystemExit(f"mask must be causal or full, got {mask!r}")
    batch = max(1, bench.TOKENS // seqlen)
    shape = {"head_dim": head_dim, "mask": mask, "seqlen": seqlen, "batch": batch}
    gen = torch.Generator(device="cuda").manual_seed(seqlen * 1000 + head_dim)

    def randn(h):
        return torch.randn(batch, seqlen, h, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)

    q, k, v, dout = randn(bench.NHEADS_Q), randn(bench.NHEADS_KV), randn(bench.NHEADS_KV), randn(bench.NHEADS_Q)
    build = bench.builders("static")
    fns = {}
    for name in ("hf_flash", "sdpa"):
        fns[name] = build[name](shape, q, k, v, dout)[0]
    for variant in args.variants:
        fns[variant] = forward_call(q, k, v, mask == "causal", variant)
    names = list(fns)
    rounds = {name: [] for name in names}
    with torch.no_grad():
        for fn in fns.values():  # compile and warm up
            for _ in range(3):
                fn()
        torch.cuda.synchronize()
        for r in range(args.rounds):
            order = names if r % 2 == 0 else names[::-1]
            for name in order:
                t0 = time.time()
                calls = time_calls(fns[name], args.calls, flush)
                rounds[name].append({"round": r, "calls_ms": calls, "median_ms": statistics.median(calls),
                                     "window": (t0, time.time())})  # fmt: skip
    result = {"shape": shape, "rounds": rounds, "summary": {}}
    sdpa = [x["median_ms"] for x in rounds["sdpa"]]
    for name in names:
        meds = [x["median_ms"] for x in rounds[name]]
        paired = [s / m for s, m in zip(sdpa, meds)]
        result["summary"][name] = {
            "median_of_rounds_ms": statistics.median(meds), "min_round_ms": min(meds), "max_round_ms": max(meds),
            "ratio_of_medians": statistics.median(sdpa) / statistics.median(meds),
            "median_paired_ratio": statistics.median(paired),
            "paired_ratios": paired,
        }  # fmt: skip
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["128:causal:16384", "128:full:8192"],
                   help="HEAD_DIM:MASK:SEQLEN, MASK causal or full")  # fmt: skip
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--calls", type=int, default=30, help="timed calls per provider per round")
    p.add_argument("--variants", nargs="*", default=[], help="forward variants run through the launcher")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("forward_spread needs a CUDA GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device="cuda")
    stream = ClockStream(torch.cuda.current_device())
    results = [run_shape(spec, args, flush) for spec in args.shapes]
    stream.stop()
    for res in results:
        for rows in res["rounds"].values():
            for x in rows:
                x.update(stream.window(*x["window"]))
    for spec, res in zip(args.shapes, results):
        print(spec)
        for name, s in res["summary"].items():
            rows = res["rounds"][name]
            clocks = [round(x.get("sm_mhz_mean", 0)) for x in rows]
            print(f"  {name:32s} rounds {[round(x['median_ms'], 3) for x in rows]}")
            print(f"  {'':32s} mhz {clocks}  median-paired {s['median_paired_ratio']:.3f} "
                  f"ratio-of-medians {s['ratio_of_medians']:.3f}")  # fmt: skip
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rounds": args.rounds,
            "calls": args.calls, "clock_samples": stream.error or len(stream.samples)}  # fmt: skip
    (args.out / "forward_spread.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))


if __name__ == "__main__":
    main()

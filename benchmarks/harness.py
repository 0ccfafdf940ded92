"""Shared benchmark harness: timing, environment description and result files.

Every benchmark script imports this module so that all results carry the same fields:
GPU name, library versions, shapes, and per-provider median / p20 / p80 times. Results are
written as JSON to the folder given on the command line (``--out``), defaulting to
``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
from pathlib import Path
from typing import Callable, Iterable

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def env_info() -> dict:
    """GPU and library versions, recorded with every result file."""
    info = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    for name in ("triton", "transformers", "accelerate", "peft"):
        try:
            info[name] = __import__(name).__version__
        except Exception:  # pragma: no cover - optional packages
            info[name] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = props.name
        info["gpu_count"] = torch.cuda.device_count()
        info["sm_count"] = props.multi_processor_count
        info["capability"] = f"{props.major}.{props.minor}"
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
    else:
        info["gpu"] = None
    return info


def bench_ms(
    fn: Callable[[], object], *, warmup_ms: float = 25, rep_ms: float = 100, flush: str = "zero",
    min_calls: int = 1,
) -> dict:
    """Median, p20 and p80 of ``fn``'s device time in milliseconds (CUDA events, L2 flushed
    before every call).

    The timed calls fill ``rep_ms`` (at least one); ``min_calls`` > 1 sets a floor on their
    number: one call is timed first and ``rep_ms`` grows to hold that many. Without it a call
    longer than ``rep_ms`` is timed once, and one call's reading depends on the GPU's clock and
    thermal state at that moment (d128 forward+backward at 32K, ~120 ms a call: 120-134 ms in
    single-call readings, 113 ms as the median of 20 calls in a row).

    ``flush`` says how the L2 is emptied between calls:

    * ``"zero"`` (Triton's ``do_bench``, the default): a 256 MB buffer is zeroed. That leaves the
      whole L2 (50 MB on an H100) holding *dirty* lines, and the timed call pays their write-back
      to DRAM as it evicts them. Measured on an H100 (decode attention and a plain read kernel
      alike): ~2 us for a call reading 17 MB (it evicts only that much), ~10 us for 134-537 MB,
      lost in the noise of multi-millisecond calls.
    * ``"read"``: the same buffer is read (a reduction) instead, so the L2 holds clean lines and
      the timed call's DRAM traffic is its own. Memory-bound kernels that run after other kernels
      which mostly read (decode attention after the weight GEMVs) see this state.
    """
    if min_calls < 1:
        raise ValueError(f"min_calls must be at least 1, got {min_calls}")
    if min_calls > 1:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        # a margin over the count: the timing loop divides rep_ms by its own estimate
        rep_ms = max(rep_ms, 1.1 * min_calls * start.elapsed_time(end))
    if flush == "zero":
        import triton.testing

        med, p20, p80 = triton.testing.do_bench(
            fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5, 0.2, 0.8]
        )
        return {"ms": med, "p20_ms": p20, "p80_ms": p80}
    if flush != "read":
        raise ValueError(f"flush must be 'zero' or 'read', got {flush!r}")
    buf = torch.ones(256 * 2**20 // 4, dtype=torch.int32, device="cuda")

    def runs(n: int) -> torch.Tensor:  # n calls, each after a reading flush: their times in ms
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(n)]  # fmt: skip
        for start, end in events:
            buf.amax()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return torch.tensor([s.elapsed_time(e) for s, e in events], dtype=torch.float64)

    fn()
    torch.cuda.synchronize()
    estimate = max(runs(5).mean().item(), 1e-3)
    for _ in range(max(1, int(warmup_ms / estimate))):
        fn()
    times = runs(max(1, int(rep_ms / estimate)))
    q = torch.tensor([0.5, 0.2, 0.8], dtype=torch.float64)
    med, p20, p80 = torch.quantile(times, q).tolist()
    return {"ms": med, "p20_ms": p20, "p80_ms": p80}


def base_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--out", type=Path, default=RESULTS_DIR, help="folder for the JSON result file"
    )
    parser.add_argument("--quick", action="store_true", help="a reduced grid, for smoke runs")
    return parser


def write_results(name: str, rows: Iterable[dict], out_dir: Path, **meta) -> Path:
    """Write ``{"benchmark", "env", "meta", "rows"}`` to ``out_dir/<name>-<gpu>.json``."""
    env = env_info()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    gpu = (env.get("gpu") or "cpu").replace(" ", "_").replace("/", "_")
    path = out_dir / f"{name}-{gpu}.json"
    payload = {"benchmark": name, "env": env, "meta": meta, "rows": list(rows)}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=str))
    os.replace(tmp, path)
    return path


def print_table(rows: list[dict], columns: list[str]) -> None:
    """Plain fixed-width table on stdout (the device tool returns the tail of the output)."""
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns} if rows else {}
    print("  ".join(c.rjust(widths.get(c, len(c))) for c in columns))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(widths[c]) for c in columns))


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"
    return "-" if x is None else str(x)

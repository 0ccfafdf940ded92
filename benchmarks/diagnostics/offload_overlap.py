"""Why the activation-offload overlap test depends on the d128 backward variant (diagnostic).

With ``kv2x64-m64-s2-dqwldfp`` as the d128 backward the GPU test
``tests/training/test_training_gpu.py::test_offload_copies_run_on_the_side_stream_and_overlap_compute``
failed three times (its host-to-device prefetch copies had no kernel under them; compute idle
~330 us before each copy and resuming 1-17 us after it), and it passed with
``kv2x64-m64-s2-dqwldf`` on the same machine (session 25). This runs the test's own model and
step (8 layers, ``--seq`` tokens, MHA d128, LoRA, offloaded checkpoints) once per named variant,
in one process, and records what separates the hypotheses. Found with it (2026-11-28): the
8192-token step is host-bound under the profiler with either variant (kernels busy 41 of
182-208 ms; every prefetch started ahead of its use, none on demand; no copy under compute with
either), so the test now runs 32768 tokens (``OVERLAP_SEQ``). The records:

- prefetch decisions: for every ``_OffloadedInput.unpack`` (one per layer, in backward order),
  whether its copy had been started by the previous recomputation (a prefetch) or starts now
  (an on-demand fetch: the compute stream then waits for it), and whether the box of the layer
  recomputed next was still alive to prefetch (a dead weakref means the next fetch is on demand);
- host time of every backward attention launch (``hopper_attention_backward``), and the host gap
  between consecutive unpacks (how far apart the layers' backwards are on the host);
- from the profiler trace: per copy, the kernels under it and the compute idle before / after it;
  the backward kernels' durations; CUDA runtime calls longer than 200 us (a synchronising launch,
  a local-memory resize, a pinned allocation); the caching allocator's device mallocs, frees,
  retries and all-stream synchronisations during the step;
- ``--sync-debug``: one more step under ``torch.cuda.set_sync_debug_mode("warn")``, counting the
  synchronising calls torch reports and their first messages.

    PYTHONPATH=. python benchmarks/diagnostics/offload_overlap.py OUT.json \
        [--variants kv2x64-m64-s2-dqwldf kv2x64-m64-s2-dqwldfp] [--rounds 2] [--sync-debug] [--seq N]

Needs a Hopper GPU (the Gluon backward), peft and transformers; the variants alternate within
each round. The JSON holds every record; the printed summary one line per (round, variant).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "training"))  # the GPU test's model, inputs and step

import test_training_gpu as case  # noqa: E402

from hf_flash.kernels.hopper import attention_bwd  # noqa: E402
from hf_flash.training import offload  # noqa: E402

LONG_CALL_US = 200


class _Recorder:
    """Wraps the offload boxes' unpack and the Gluon backward launcher while installed."""

    def __init__(self) -> None:
        self.unpacks: list = []
        self.launches: list = []
        self._saved = {}

    def install(self) -> None:
        rec = self
        unpack, launch = offload._OffloadedInput.unpack, attention_bwd.hopper_attention_backward
        self._saved = {"unpack": unpack, "launch": launch}

        def traced_unpack(box):
            prefetched = box._fetched is not None
            following = box._step.before(box._index)
            t0 = time.perf_counter_ns()
            out = unpack(box)
            rec.unpacks.append({
                "index": box._index, "host_ns": t0, "host_us": (time.perf_counter_ns() - t0) / 1e3,
                "prefetched": prefetched, "next_box_alive": following is not None or box._index == 0,
                "boxes_in_step": len(box._step.boxes),
            })  # fmt: skip
            return out

        def traced_launch(*args, **kwargs):
            t0 = time.perf_counter_ns()
            out = launch(*args, **kwargs)
            rec.launches.append({"host_ns": t0, "host_us": (time.perf_counter_ns() - t0) / 1e3})
            return out

        offload._OffloadedInput.unpack = traced_unpack
        attention_bwd.hopper_attention_backward = traced_launch

    def uninstall(self) -> None:
        if self._saved:
            offload._OffloadedInput.unpack = self._saved["unpack"]
            attention_bwd.hopper_attention_backward = self._saved["launch"]
            self._saved = {}


def _trace_summary(events: list, layer_bytes: int) -> dict:
    kernels = [e for e in events if e.get("cat") == "kernel"]
    copies = [e for e in events if e.get("cat") == "gpu_memcpy" and e.get("args", {}).get("bytes") == layer_bytes]
    t0 = min(e["ts"] for e in kernels + copies)
    rows = case.copy_rows(kernels, copies)
    for r in rows:
        r["kind"] = "HtoD" if "HtoD" in r.pop("name") else "DtoH"
    bwd = [e for e in kernels if "attn_bwd" in e["name"]]
    runtime = [
        {"name": e["name"], "dur_us": e["dur"], "at_us": e["ts"] - t0}
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and e.get("dur", 0) > LONG_CALL_US
    ]  # fmt: skip
    busy = sum(k["dur"] for k in kernels)
    span = max(k["ts"] + k["dur"] for k in kernels) - min(k["ts"] for k in kernels)
    return {
        "copies": rows,
        "htod_overlapped": sum(r["kernels_under"] > 0 for r in rows if r["kind"] == "HtoD"),
        "dtoh_overlapped": sum(r["kernels_under"] > 0 for r in rows if r["kind"] == "DtoH"),
        "backward_kernels": [{"name": e["name"][:60], "dur_us": e["dur"], "at_us": e["ts"] - t0} for e in bwd],
        "long_runtime_calls": runtime,
        "kernels": len(kernels), "kernel_busy_us": busy, "kernel_span_us": span,
    }  # fmt: skip


def _sync_debug_step(model, inputs) -> dict:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            case._measured_step(model, inputs)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    messages = [str(w.message).splitlines()[0][:200] for w in caught]
    return {"sync_warnings": len(messages), "first": messages[:8]}


def run_variant(model, inputs, variant: str, sync_debug: bool) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with attention_bwd.pinned(variant, (128,)):  # the variant at every length
        rec = _Recorder()
        try:
            case._measured_step(model, inputs)  # compiles the variant; primes the allocators
            rec.install()
            stats_before = torch.cuda.memory_stats()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                case._measured_step(model, inputs)
            stats_after = torch.cuda.memory_stats()
            rec.uninstall()
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "trace.json"
                prof.export_chrome_trace(str(path))
                events = json.loads(path.read_text())["traceEvents"]
            result = {"variant": variant, **_trace_summary(events, case.layer_bytes(inputs["input_ids"].shape[1]))}
            # the caching allocator during the profiled step: device mallocs/frees and its
            # synchronising paths (retries after a failed malloc, waits on every stream's events)
            result["allocator"] = {
                key: stats_after.get(key, 0) - stats_before.get(key, 0)
                for key in ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")
            }  # fmt: skip
            gaps = [(b["host_ns"] - a["host_ns"]) / 1e3 for a, b in zip(rec.unpacks, rec.unpacks[1:])]
            result.update(unpacks=rec.unpacks, unpack_gaps_us=gaps, launches=rec.launches)
            if sync_debug:
                result.update(_sync_debug_step(model, inputs))
            return result
        finally:
            rec.uninstall()


def _summary(res: dict, sync_debug: bool) -> str:
    hits = sum(u["prefetched"] for u in res["unpacks"])
    dead = sum(not u["next_box_alive"] for u in res["unpacks"])
    launch = sorted(x["host_us"] for x in res["launches"])
    median = launch[len(launch) // 2] if launch else 0.0
    calls = [(c["name"], round(c["dur_us"])) for c in res["long_runtime_calls"]][:6]
    line = (
        f"round {res['round']} {res['variant']:24s} HtoD under compute {res['htod_overlapped']}/{case.LAYERS} "
        f"DtoH {res['dtoh_overlapped']}/{case.LAYERS}; prefetched {hits}/{len(res['unpacks'])}, next box dead "
        f"{dead}; unpack gaps (us) {[round(g) for g in res['unpack_gaps_us']]}; backward launch host us median "
        f"{median:.0f} max {max(launch, default=0):.0f}; kernels busy {res['kernel_busy_us'] / 1e3:.1f} of "
        f"{res['kernel_span_us'] / 1e3:.1f} ms; allocator {res['allocator']}; calls > {LONG_CALL_US} us {calls}"
    )
    if sync_debug:
        line += f"; sync warnings {res['sync_warnings']} {res['first'][:2]}"
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="JSON file for every record")
    parser.add_argument("--variants", nargs="+", default=["kv2x64-m64-s2-dqwldf", "kv2x64-m64-s2-dqwldfp"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sync-debug", action="store_true")
    parser.add_argument("--seq", type=int, default=case.SEQ,
                        help=f"tokens (the test: {case.OVERLAP_SEQ}; {case.SEQ} is host-bound under the profiler)")
    args = parser.parse_args()
    d128 = [name for name, var in attention_bwd.VARIANTS.items() if 128 in var.head_dims]
    unknown = [v for v in args.variants if v not in d128]
    if unknown:
        raise SystemExit(f"not d128 backward variants: {unknown}; choose from {d128}")
    if not torch.cuda.is_available():
        raise SystemExit("offload_overlap.py needs a CUDA GPU (the Gluon backward runs on sm_90)")

    model, inputs = case._model(args.seq), case._inputs(args.seq)
    offload.offload_checkpoints(model)
    results = []
    for r in range(args.rounds):
        for variant in args.variants:
            res = run_variant(model, inputs, variant, args.sync_debug)
            res["round"] = r
            results.append(res)
            print(_summary(res, args.sync_debug), flush=True)
    Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "results": results}, indent=1))


if __name__ == "__main__":
    main()

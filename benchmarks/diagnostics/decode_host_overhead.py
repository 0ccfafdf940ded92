"""Host (Python) time of one DynamicCache decode step: hf_flash beside sdpa, kernels stubbed.

    PYTHONPATH=. python benchmarks/diagnostics/decode_host_overhead.py [--steps 64] [--repeats 5] [--batch 1]

What this measures, and what it does not: the CPU time the Python side of ``model.generate``
spends per decode step. It is NOT GPU time and says nothing about kernel speed or about the
overlap of host and device work. It runs on the CPU (no GPU needed) with Triton's interpreter
switched on only so that hf_flash accepts CPU tensors; every hf_flash Triton kernel launch
(``kernel[grid](...)``) is replaced by a stub that returns without running anything. The stub
does what Triton's launcher does in Python before its driver call (bind and specialise the
arguments, build the compiled-kernel cache key; ``--no-binder`` skips that), so the cost of many
kernel arguments shows; the driver call itself is not timed. On a GPU (Triton 3.6) repeated
decode, combine and rotary launches skip that work (hf_flash.kernels.launch), so the binder rows
here overstate their cost there; ``--no-binder`` is the closer picture of it, and
benchmarks/diagnostics/launch_host_time.py measures both launch paths on the GPU. hf_flash's
validation, dispatch, launch planning and small torch ops run as usual. Launches per step and arguments per launch
are printed. The sdpa rows run transformers' real sdpa path on tiny CPU kernels; torch ops on a
GPU cost more host time per op (a CUDA launch) than these CPU ones.

Launch planning runs as on an H100 (132 SMs, the GPU's tile sizes: ``configs.interpreting``
and ``sm_count`` are overridden; ``--no-gpu-plan`` keeps the interpreter's), because the
split-KV search's host work depends on the SM count and on the number of key tiles.

Model: a randomly initialised Llama with the 1.2B benchmark's attention layout (16 layers,
32 query / 8 key-value heads of dim 64, Llama-3 RoPE) but hidden size 64, MLP 64 and vocab 256,
float32 (CPU bf16 attention is a slow path that would add compute to the sdpa rows), so the
matmuls cost next to nothing and per-step time is dominated by Python and op dispatch.
Prompt: ``--prompt`` random tokens (default 64), ``attention_mask`` of ones (row 0 left-padded
when ``--batch`` > 1), greedy decoding of ``--steps`` tokens. transformers >= 5.2x drops an
all-ones mask inside generate; 5.17 (the GPU machine's version) keeps it, so its steps run the
mask function.

Per-step time: a logits processor records a timestamp after every forward pass; the gaps
between consecutive stamps are whole decode steps (input preparation, forward, cache and mask
update, token selection). The median over steps is taken per run, then the best of
``--repeats`` runs. A table then gives the host time of one layer's hf_flash attention call and
fused RoPE call at several context lengths (the context changes host work only through the
launch plan; a short prompt keeps the CPU's DynamicCache copies and sdpa compute small in the
generate rows). Last, a profiled run of each backend prints the functions with the most
cumulative time per step and the hf_flash functions among them.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

# before hf_flash defines its kernels: lets hf_flash take CPU tensors (no kernel runs anyway)
os.environ["TRITON_INTERPRET"] = "1"

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import hf_flash  # noqa: E402
from hf_flash.kernels import decode as _decode_mod  # noqa: E402
from hf_flash.kernels import flash_common as _common_mod  # noqa: E402
from hf_flash.kernels import flash_fwd as _fwd_mod  # noqa: E402
from hf_flash.kernels import key_mask as _key_mask_mod  # noqa: E402
from hf_flash.kernels import rotary as _rotary_mod  # noqa: E402

# (module, name) of every kernel a generate() call can launch
_KERNELS = [
    (_decode_mod, "_decode_kernel"),
    (_decode_mod, "_combine_kernel"),
    (_rotary_mod, "_rotary_kernel"),
    (_fwd_mod, "_flash_fwd_kernel"),
    (_common_mod, "_dropout_mask_kernel"),
    (_key_mask_mod, "_key_mask_kernel"),
]


def _key_mask_results(mask, out, stats, *_ints, **_meta):
    """The padding-mask kernel's outputs, written by the integration's torch version of it: the
    mask function reads them (is every row contiguous?), so a stub that leaves them unset would
    make it refuse the mask. These few CPU ops count as host time, slightly overstating the
    kernel's launch."""
    from hf_flash.integration.masks import mask_rows_torch

    o, s = mask_rows_torch(mask, out.shape[1])
    out.copy_(o)
    stats.copy_(s)


# kernels whose outputs the host reads back: their stubs write them (see _key_mask_results)
_RESULTS = {"_key_mask_kernel": _key_mask_results}


class _StubKernel:
    """Stands in for ``kernel[grid](*args, **kwargs)``: counts the launch and its arguments and,
    with ``binder``, does what Triton's ``JITFunction.run`` does in Python before it calls the
    driver: bind the arguments, specialise them (alignment, divisibility by 16, dtypes) and
    build the compiled-kernel cache key. The driver call, and the kernel, never happen."""

    def __init__(self, name: str, kernel, binder: bool):
        self.name = name
        self.launches = 0
        self.args = 0
        self._binder = _make_binder(kernel) if binder else None
        self._key_cache: dict = {}
        self._results = _RESULTS.get(name)
        if binder:
            from triton import knobs
            from triton.runtime.jit import compute_cache_key

            self._knobs, self._cache_key = knobs, compute_cache_key

    def __getitem__(self, grid):
        return self._launch

    def _launch(self, *args, **kwargs):
        self.launches += 1
        self.args += len(args) + len(kwargs)
        if self._binder is not None:
            knobs = self._knobs
            kwargs["debug"] = kwargs.get("debug", False) or knobs.runtime.debug
            kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
            bound, specialization, options = self._binder(*args, **kwargs)
            self._cache_key(self._key_cache, specialization, options)
            tuple(bound.values())
        if self._results is not None:
            self._results(*args)


def _make_binder(kernel):
    """Triton's per-kernel argument binder, built for an sm_90 CUDA target (no GPU needed)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    jit = JITFunction(kernel.fn)
    backend = make_backend(GPUTarget("cuda", 90, 32))
    return create_function_from_signature(jit.signature, jit.params, backend)


def stub_kernels(binder: bool = True) -> list[_StubKernel]:
    from hf_flash.kernels.launch import CachedLauncher

    launchers = [v for m in {m for m, _ in _KERNELS} for v in vars(m).values()
                 if isinstance(v, CachedLauncher)]  # fmt: skip
    stubs = []
    for module, name in _KERNELS:
        kernel = getattr(module, name)
        stub = _StubKernel(name, kernel, binder)
        setattr(module, name, stub)
        # launch sites that go through a CachedLauncher (which, under the interpreter, calls
        # kernel[grid](...) every time)
        for launcher in launchers:
            if launcher.kernel is kernel:
                launcher.kernel = stub
        stubs.append(stub)
    return stubs


def build_model(dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=64, intermediate_size=64, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=256, max_position_embeddings=131072,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


class _StepClock:
    """Logits processor: a timestamp after every forward pass. From the end of the prefill on
    (the first call) it resets the launch counters and, if given, runs the profiler, so both
    cover decode steps only."""

    def __init__(self, stubs, profiler=None):
        self.stamps: list[float] = []
        self.stubs = stubs
        self.profiler = profiler

    def __call__(self, input_ids, scores):
        self.stamps.append(time.perf_counter())
        if len(self.stamps) == 1:
            for s in self.stubs:
                s.launches = s.args = 0
            if self.profiler is not None:
                self.profiler.enable()
        return scores

    def step_ms(self) -> list[float]:
        return [(b - a) * 1e3 for a, b in zip(self.stamps, self.stamps[1:])]


def _generate(model, ids, mask, steps: int, clock: _StepClock):
    from transformers import LogitsProcessorList

    with torch.no_grad():
        model.generate(
            ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
            do_sample=False, pad_token_id=0, logits_processor=LogitsProcessorList([clock]),
        )  # fmt: skip
    if clock.profiler is not None:
        clock.profiler.disable()


def measure(model, ids, mask, attn: str, steps: int, repeats: int, stubs) -> dict:
    model.set_attn_implementation(attn)
    _generate(model, ids, mask, 4, _StepClock(stubs))  # warm-up
    best = None
    for _ in range(repeats):
        clock = _StepClock(stubs)
        _generate(model, ids, mask, steps + 1, clock)
        ms = statistics.median(clock.step_ms())
        best = ms if best is None else min(best, ms)
    launches = {
        s.name: (s.launches / steps, s.args / max(s.launches, 1)) for s in stubs if s.launches
    }
    prof = cProfile.Profile()
    _generate(model, ids, mask, steps + 1, _StepClock(stubs, prof))  # +1: prefill not profiled
    return dict(attn=attn, ms=best, profile=prof, launches=launches)


def _report_profile(result: dict, steps: int, top: int) -> None:
    stats = pstats.Stats(result["profile"])
    rows = []
    for (path, line, func), (_cc, ncalls, tottime, cumtime, _callers) in stats.stats.items():
        rows.append((cumtime, tottime, ncalls, path, line, func))
    print(f"\n--- {result['attn']}: top {top} by cumulative time per step (profiled, so slower)")
    print(f"{'cum ms':>8} {'self ms':>8} {'calls':>7}  function")
    rows.sort(reverse=True)
    for cum, tot, n, path, line, func in rows[:top]:
        where = func if path == "~" else f"{_short(path)}:{line}({func})"
        print(f"{cum / steps * 1e3:8.3f} {tot / steps * 1e3:8.3f} {n / steps:7.1f}  {where}")
    ours = [r for r in rows if f"{os.sep}hf_flash{os.sep}" in r[3]]
    if ours:
        print(f"--- {result['attn']}: hf_flash functions by self time per step")
        ours.sort(key=lambda r: -r[1])
        for cum, tot, n, path, line, func in ours[:top]:
            print(f"{cum / steps * 1e3:8.3f} {tot / steps * 1e3:8.3f} {n / steps:7.1f}  "
                  f"{_short(path)}:{line}({func})")  # fmt: skip
    reads = sum(n for cum, tot, n, path, line, func in rows
                if path == "~" and any(f"'{m}' of 'torch._C.TensorBase'" in func
                                       for m in ("tolist", "item", "cpu")))  # fmt: skip
    print(f"--- {result['attn']}: tensor .tolist/.item/.cpu calls per step (each a device sync "
          f"on a GPU): {reads / steps:.1f}")


def _short(path: str) -> str:
    for name in ("hf_flash", "transformers", "torch"):
        marker = f"{os.sep}{name}{os.sep}"
        if marker in path:
            return marker.strip(os.sep) + os.sep + path.split(marker, 1)[1]
    return os.path.basename(path)


def per_call_us(contexts, dtype: torch.dtype, calls: int) -> list[tuple[int, float, float]]:
    """(context, attention us, RoPE us) per layer call of hf_flash's decode-shaped attention
    function and fused RoPE on the benchmark's layer shapes (B=1, 32/8 heads, d=64), kernels
    stubbed. The context only changes host work through the split-KV launch plan."""
    from hf_flash.integration.attention import hf_flash_attention_forward
    from hf_flash.rotary import apply_rotary_pos_emb

    module = torch.nn.Module()
    module.is_causal = True
    rows = []
    for ctx in contexts:
        q = torch.randn(1, 1, 32, 64, dtype=dtype).transpose(1, 2)  # (B, H, 1, D) views
        k = torch.randn(1, 8, ctx, 64, dtype=dtype)
        v = torch.randn(1, 8, ctx, 64, dtype=dtype)
        kn = torch.randn(1, 1, 8, 64, dtype=dtype).transpose(1, 2)
        cos = torch.randn(1, 1, 64, dtype=dtype)
        sin = torch.randn(1, 1, 64, dtype=dtype)
        times = []
        for fn in (
            lambda: hf_flash_attention_forward(module, q, k, v, None, scaling=0.125),
            lambda: apply_rotary_pos_emb(q, kn, cos, sin),
        ):
            for _ in range(20):
                fn()
            best = float("inf")
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                best = min(best, (time.perf_counter() - t0) / calls * 1e6)
            times.append(best)
        rows.append((ctx, *times))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=64, help="decode steps per run")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1,
                        help="rows; with more than one, row 0 is left-padded (a padding mask)")
    parser.add_argument("--dtype", default="float32", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--no-gpu-plan", action="store_true",
                        help="plan launches for the interpreter (4 SMs, small tiles) instead of "
                             "for an H100 (132 SMs, the GPU tile sizes)")
    parser.add_argument("--contexts", default="64,4096,32768",
                        help="context lengths of the per-call table")
    parser.add_argument("--no-binder", action="store_true",
                        help="stubs skip the emulation of Triton's argument binding")
    parser.add_argument("--top", type=int, default=20, help="profile rows to print")
    parser.add_argument("--attn", default="sdpa,hf_flash")
    args = parser.parse_args()
    if torch.cuda.is_available():
        print("note: a GPU is present, but this script measures host work on the CPU only")
    torch.set_num_threads(1)  # steadier timings; the work is tiny
    torch.set_flush_denormal(True)  # stubbed kernels leave garbage in their outputs
    hf_flash.register()
    stubs = stub_kernels(binder=not args.no_binder)
    if not args.no_gpu_plan:
        # launch planning (tile sizes, the split-KV search) as on an H100: its host work grows
        # with the SM count and the number of key tiles
        from hf_flash.kernels import configs

        configs.interpreting = lambda: False
        _decode_mod.sm_count = lambda device: 132
    model = build_model(getattr(torch, args.dtype))
    torch.manual_seed(1)
    ids = torch.randint(3, 256, (args.batch, args.prompt))
    mask = torch.ones_like(ids)
    if args.batch > 1:
        mask[0, : args.prompt // 4] = 0
    results = [
        measure(model, ids, mask, a, args.steps, args.repeats, stubs) for a in args.attn.split(",")
    ]
    import transformers

    print("Host (Python) time per DynamicCache decode step on the CPU, hf_flash kernels stubbed")
    print(f"(16 layers, 32/8 heads, d=64, hidden 64, {args.dtype}; B={args.batch}"
          f"{' (row 0 left-padded)' if args.batch > 1 else ''}, prompt {args.prompt}, "
          f"{args.steps} steps, best of {args.repeats} medians; transformers "
          f"{transformers.__version__}, torch {torch.__version__}). Not GPU time.")  # fmt: skip
    for r in results:
        launches = ", ".join(
            f"{name} {n:.0f} x {a:.0f} args" for name, (n, a) in r["launches"].items()
        )
        extra = f"   [launches/step: {launches}]" if launches else ""
        print(f"  {r['attn']:>9}: {r['ms']:7.3f} ms/step{extra}")
    contexts = [int(c) for c in args.contexts.split(",") if c]
    if contexts and "hf_flash" in args.attn:
        print(f"\nhf_flash per layer call, decode shapes (B=1, 32/8 heads, d=64, {args.dtype}), "
              "kernels stubbed:")
        print(f"{'context':>9} {'attention us':>13} {'RoPE us':>9}")
        for ctx, attn_us, rope_us in per_call_us(contexts, getattr(torch, args.dtype), 400):
            print(f"{ctx:>9} {attn_us:13.1f} {rope_us:9.1f}")
    for r in results:
        _report_profile(r, args.steps, args.top)


if __name__ == "__main__":
    main()

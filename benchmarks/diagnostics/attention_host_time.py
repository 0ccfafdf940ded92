"""Host time per attention call on the GPU: the public ``flash_attn_func`` (forward alone, and
forward + backward) beside the Gluon forward launched directly and SDPA, on a call small enough
that the GPU keeps up, so the loop measures what the host spends queueing one call (diagnostic).

    PYTHONPATH=. python benchmarks/diagnostics/attention_host_time.py [--seqlen 256] [--profile]

Each row is the best of ``--repeats`` loops of ``--calls`` calls, the time until the loop has
queued everything divided by the calls (the device is synchronised between loops, outside the
timing; triton.testing.do_bench on a short call counts this time where it exceeds the kernel's).
``--profile``: also cProfiles of the public forward and of forward + backward (the backward on
the calling thread), by own and by cumulative time. ``--stages``: also the host time of each
layer of the path on its own (the dispatch checks, the launchers, the allocations, the autograd
backward on a kept graph), without a profiler's distortion. ``--sync-check``: one forward +
backward under ``torch.cuda.set_sync_debug_mode("warn")``, listing the calls that synchronise the
host with the device (a host time that includes device time). ``--device-time``: the kernels
one public forward + backward runs and their device time (torch.profiler, the median of
``--calls`` // 10 iterations, at least 3), to set the host time beside. ``--primitives``: the
building blocks of those layers on their own (torch's allocations and device switch, the
interface's checks, one TMA descriptor built and encoded, autograd around a no-op).
``--split``: a forward + backward loop's time in its forward and its ``autograd.grad``, with the
backward on autograd's device thread and on the calling thread. ``--thread-cost``: that thread's
extra cost for a no-op autograd Function running a given amount of Python; ``--thread-parts``:
the same for the pieces of the real backward (allocations, fills, launches, the whole of it).
``--floor``: forward + backward with the launchers called directly (no checks, dispatch or
custom-op layer; the same kernels, gradients checked equal) beside the public path and SDPA: the
host time the layers above the launchers add.
Older-against-newer package comparisons: host_ab.py.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.diagnostics.launch_host_time import host_us  # noqa: E402
from hf_flash import flash_attn_func  # noqa: E402


def call_tensors(seqlen: int, head_dim: int):
    """(q, k, v, the three as leaves that require grad, dout) of the timed call: B=1, 32 query
    heads over 8 K/V heads, bf16, on the GPU."""
    q = torch.randn(1, seqlen, 32, head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, seqlen, 8, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    return q, k, v, qg, kg, vg, torch.randn_like(q)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=256)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--stages", action="store_true")
    parser.add_argument("--sync-check", action="store_true")
    parser.add_argument("--device-time", action="store_true")
    parser.add_argument("--primitives", action="store_true")
    parser.add_argument("--split", action="store_true")
    parser.add_argument("--thread-cost", action="store_true")
    parser.add_argument("--thread-parts", action="store_true")
    parser.add_argument("--floor", action="store_true")
    args = parser.parse_args()
    from hf_flash.kernels.hopper import attention_fwd as hk

    dev, s, d = "cuda", args.seqlen, args.head_dim
    q, k, v, qg, kg, vg, dout = call_tensors(s, d)
    out = torch.empty_like(q)
    lse = torch.empty(1, 32, s, device=dev, dtype=torch.float32)
    qh, kh, vh = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    scale = d**-0.5

    def public_fwd():
        with torch.no_grad():
            return flash_attn_func(q, k, v, causal=True)

    def public_fwd_grad():  # the graph is dropped with the output
        return flash_attn_func(qg, kg, vg, causal=True)

    def public_fwd_bwd_kept():  # the graph kept after the backward (no release of saved tensors)
        o = flash_attn_func(qg, kg, vg, causal=True)
        return torch.autograd.grad(o, (qg, kg, vg), dout, retain_graph=True)

    def public_fwd_bwd():
        o = flash_attn_func(qg, kg, vg, causal=True)
        return torch.autograd.grad(o, (qg, kg, vg), dout)

    def kernel(variant):
        def call():
            hk.hopper_attention_forward(q, k, v, out, lse, softmax_scale=scale, causal=True, variant=variant)

        return call

    def sdpa_fwd():
        with torch.no_grad():
            return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)

    qhg, khg, vhg = (t.clone().requires_grad_() for t in (qh, kh, vh))
    douth = dout.transpose(1, 2).contiguous()

    def sdpa_fwd_bwd():
        o = F.scaled_dot_product_attention(qhg, khg, vhg, is_causal=True, enable_gqa=True)
        return torch.autograd.grad(o, (qhg, khg, vhg), douth)

    def public_fwd_bwd_parts():
        return flash_attn_func(qg, kg, vg, causal=True), (qg, kg, vg)

    def sdpa_fwd_bwd_parts():
        return F.scaled_dot_product_attention(qhg, khg, vhg, is_causal=True, enable_gqa=True), (qhg, khg, vhg)

    default = hk.default_variant(d, True, seqlen_q=s)
    rows = [
        ("flash_attn_func forward (no grad)", public_fwd),
        ("flash_attn_func forward + backward", public_fwd_bwd),
        ("flash_attn_func forward (grad enabled)", public_fwd_grad),
        ("flash_attn_func forward + backward, graph kept", public_fwd_bwd_kept),
        (f"hopper_attention_forward {default}", kernel(default)),
        ("hopper_attention_forward ws2x4-overlap-fma", kernel("ws2x4-overlap-fma")),
        ("SDPA forward (no grad)", sdpa_fwd),
        ("SDPA forward + backward", sdpa_fwd_bwd),
    ]
    print(f"Host us per call, B=1 S={s} Hq=32 Hkv=8 d={d} causal bf16, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}")  # fmt: skip
    for label, fn in rows:
        print(f"{label:48} {host_us(fn, args.calls, args.repeats):8.1f}")
    if args.sync_check:
        import warnings

        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                public_fwd_bwd()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        print(f"== synchronising calls in one forward + backward: {len(seen)}")
        for w in seen:
            print(f"  {w.filename}:{w.lineno}: {str(w.message).splitlines()[0][:200]}")
    if args.device_time:
        _device_time(public_fwd_bwd, max(args.calls // 10, 3))
    if args.stages:
        print(f"== stages (host us per call; causal, {default} forward)")
        for label, fn in _stages(q, k, v, qg, kg, vg, dout, out, lse, scale):
            print(f"{label:48} {host_us(fn, args.calls, args.repeats):8.1f}")
    if args.split:
        _split(public_fwd_bwd_parts, sdpa_fwd_bwd_parts, dout, douth, args.calls, args.repeats)
    if args.thread_cost:
        _thread_cost(q, dout, args.calls, args.repeats)
    if args.thread_parts:
        _thread_parts(q, k, v, dout, args.calls, args.repeats)
    if args.floor:
        _floor(qg, kg, vg, dout, public_fwd_bwd, sdpa_fwd_bwd, args.calls, args.repeats)
    if args.primitives:
        print("== primitives (host us per call)")
        for label, fn in _primitives(q, k, v, dout, out, lse, scale):
            print(f"{label:48} {host_us(fn, args.calls, args.repeats):8.1f}")
    if args.profile:
        # the backward on this thread (autograd's device threads are invisible to cProfile)
        with torch.autograd.set_multithreading_enabled(False):
            for label, fn in rows[:2]:  # the public forward, forward + backward
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(args.calls):
                    fn()
                prof.disable()
                torch.cuda.synchronize()
                for key in ("tottime", "cumulative"):
                    buf = io.StringIO()
                    pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(30)
                    print(f"== {label}, {args.calls} calls, by {key}\n{buf.getvalue()}")


def _split(ours, sdpa, dout, douth, calls: int, repeats: int) -> None:
    """Forward + backward loops timed in parts: the forward call, ``autograd.grad`` (the backward,
    the hand-off to autograd's device thread and the graph's release), each summed over the loop
    (best of ``repeats``), as they are (autograd's device threads on) and with the backward on the
    calling thread (``torch.autograd.set_multithreading_enabled(False)``), with Python's garbage
    collector off too: what running the backward on another thread adds, for ours and SDPA's."""
    import gc
    import time

    def loop(fn, grad_out):
        best = None
        for _ in range(repeats + 1):
            torch.cuda.synchronize()
            t_f = t_b = 0.0
            for _ in range(calls):
                t0 = time.perf_counter()
                o, leaves = fn()
                t1 = time.perf_counter()
                torch.autograd.grad(o, leaves, grad_out)
                t2 = time.perf_counter()
                t_f += t1 - t0
                t_b += t2 - t1
            if best is None or t_f + t_b < sum(best):
                best = (t_f, t_b)
        torch.cuda.synchronize()
        return tuple(x / calls * 1e6 for x in best)

    print("== forward + backward in parts (host us per call: forward, autograd.grad, sum)")
    for label, threads, collect in (("device threads on", True, True), ("backward on the calling thread", False, True),
                                    ("calling thread, gc off", False, False)):  # fmt: skip
        for name, fn, grad_out in (("hf_flash", ours, dout), ("SDPA", sdpa, douth)):
            if not collect:
                gc.disable()
            try:
                with torch.autograd.set_multithreading_enabled(threads):
                    f, b = loop(fn, grad_out)
            finally:
                gc.enable()
            print(f"{name + ', ' + label:48} {f:8.1f} {b:8.1f} {f + b:8.1f}")


class _Stub(torch.autograd.Function):
    """A no-op attention stand-in whose forward runs ``before()`` and whose backward runs
    ``after()``: the cost of running a backward's work on autograd's device thread, read against
    that work."""

    @staticmethod
    def forward(ctx, x, before, after):
        ctx.after = after
        before()
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, dout):
        ctx.after()
        return dout, None, None


def _device_and_calling(call, calls: int, repeats: int, turns: int = 3) -> tuple:
    """(host us with the backward on autograd's device thread, on the calling thread): the best of
    ``repeats`` loops each, the two modes alternating for ``turns`` turns."""
    best = {True: float("inf"), False: float("inf")}
    for _ in range(turns):
        for threads in (True, False):
            with torch.autograd.set_multithreading_enabled(threads):
                best[threads] = min(best[threads], host_us(call, calls, repeats))
    return best[True], best[False]


_OBJECTS = [[0] for _ in range(8192)]


def _touch(n: int) -> None:
    """Python that writes ``n`` small objects (as a launcher's bookkeeping touches its dicts, plans
    and module state)."""
    for o in _OBJECTS[:n]:
        o[0] += 1


def _thread_cost(q, dout, calls: int, repeats: int) -> None:
    """Forward + backward of :class:`_Stub` running a few amounts of Python in each direction."""
    leaf = q.clone().requires_grad_()
    print("== thread cost: _Stub forward + backward, us per call (device thread, calling thread, excess)")
    for n in (0, 512, 2048, 8192):
        def work(n=n):
            _touch(n)

        def call():
            torch.autograd.grad(_Stub.apply(leaf, work, work), (leaf,), dout)

        device, calling = _device_and_calling(call, calls, repeats)
        print(f"{'objects written ' + str(n):48} {device:8.1f} {calling:8.1f} {device - calling:8.1f}")


def _thread_parts(q, k, v, dout, calls: int, repeats: int) -> None:
    """The pieces of the public backward, each run as the backward of :class:`_Stub`, on autograd's
    device thread and on the calling thread: which kind of work carries the device thread's extra
    cost."""
    from hf_flash import interface
    from hf_flash.kernels import flash_bwd
    from hf_flash.kernels.hopper import attention_fwd as hk

    s = q.shape[1]
    options = interface._call_options(q, s, s, 0.0, None, True, (-1, -1), 0.0)
    with torch.no_grad():
        out, lse = interface.attention_forward(q, k, v, **options)
    out2, lse2 = torch.empty_like(out), torch.empty_like(lse)
    one = torch.zeros(1, device=q.device)
    variant = hk.default_variant(q.shape[-1], True, seqlen_q=s)
    parts = [
        ("nothing", lambda: None),
        ("4 allocations (dq, dk, dv, delta)",
         lambda: (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(lse))),
        ("2 int32 zero-fills (1 and 256 counters)",
         lambda: (torch.zeros(1, dtype=torch.int32, device=q.device),
                  torch.zeros(256, dtype=torch.int32, device=q.device))),
        ("4 torch kernels (add_ on one float)", lambda: [one.add_(1) for _ in range(4)]),
        ("backward preprocess (alloc + Triton launch)",
         lambda: flash_bwd.backward_preprocess(out, dout, None, lse, cu_seqlens_q=None, max_seqlen_q=s)),
        ("Gluon forward launch (ready buffers)",
         lambda: hk.hopper_attention_forward(q, k, v, out2, lse2, softmax_scale=options["softmax_scale"],
                                             causal=True, variant=variant)),
        ("the public backward (interface._bwd_grads)",
         lambda: interface._bwd_grads(dout, None, q, k, v, out, lse, None, None, None, None, None, None, None,
                                      **options)),
    ]  # fmt: skip
    leaf = q.clone().requires_grad_()
    print("== thread parts: _Stub forward + backward, us per call (device thread, calling thread, excess)")
    for label, work in parts:
        def call(work=work):
            torch.autograd.grad(_Stub.apply(leaf, lambda: None, work), (leaf,), dout)

        device, calling = _device_and_calling(call, calls, repeats)
        print(f"{label:48} {device:8.1f} {calling:8.1f} {device - calling:8.1f}")


class _Floor(torch.autograd.Function):
    """One dense causal forward + backward with the least host work hf_flash's kernels allow:
    the Hopper launchers and the backward preprocess called directly (variants fixed, no checks,
    no dispatch, no custom-op layer). What the layers above the launchers cost is the public
    path's time less this one's."""

    @staticmethod
    def forward(ctx, q, k, v, variants):
        from hf_flash.kernels.hopper import attention_fwd as hk

        b, s, h, _ = q.shape
        out = torch.empty_like(q)
        lse = torch.empty(b, h, s, device=q.device, dtype=torch.float32)
        scale = q.shape[-1] ** -0.5
        hk.hopper_attention_forward(q, k, v, out, lse, softmax_scale=scale, causal=True, variant=variants[0])
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.variant = variants[1]
        return out

    @staticmethod
    def backward(ctx, dout):
        from hf_flash.kernels import flash_bwd
        from hf_flash.kernels.hopper import attention_bwd as hb

        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        delta, stats = flash_bwd.backward_preprocess(out, dout, None, lse, cu_seqlens_q=None, max_seqlen_q=q.shape[1],
                                                     stats_m=hb.VARIANTS[ctx.variant].stats_rows)  # fmt: skip
        if not hb.hopper_attention_backward(q, k, v, dout, lse, delta, dq, dk, dv, softmax_scale=q.shape[-1] ** -0.5,
                                            causal=True, variant=ctx.variant, stats=stats):  # fmt: skip
            raise RuntimeError(f"--floor needs a backward variant that writes dQ; {ctx.variant} does not")
        return dq, dk, dv, None


def _floor(qg, kg, vg, dout, public_fwd_bwd, sdpa_fwd_bwd, calls: int, repeats: int) -> None:
    """Forward + backward: the public path, :class:`_Floor` (the same kernels), SDPA; each with
    the backward on autograd's device thread and on the calling thread."""
    from hf_flash.kernels.hopper import attention_bwd as hb
    from hf_flash.kernels.hopper import attention_fwd as hk

    s, d = qg.shape[1], qg.shape[-1]
    variants = (hk.default_variant(d, True, seqlen_q=s), hb.variant_for(d, True, seqlen_q=s))

    def floor():
        return torch.autograd.grad(_Floor.apply(qg, kg, vg, variants), (qg, kg, vg), dout)

    ref = public_fwd_bwd()
    got = floor()
    torch.cuda.synchronize()
    if not all(torch.equal(a, b) for a, b in zip(ref, got)):
        raise RuntimeError("the floor's gradients differ from the public path's: not the same kernels")
    rows = [("public flash_attn_func", public_fwd_bwd), (f"floor ({variants[0]}, {variants[1]})", floor),
            ("SDPA", sdpa_fwd_bwd)]  # fmt: skip
    print("== floor: forward + backward, us per call (device thread, calling thread)")
    for label, fn in rows:
        device, calling = _device_and_calling(fn, calls, repeats)
        print(f"{label:48} {device:8.1f} {calling:8.1f}")


def _device_time(fn, iters: int) -> None:
    """Print each kernel of one ``fn()`` call with its device time (us; median over ``iters``
    profiled calls) and the sum, beside the span from the first kernel's start to the last one's
    end of one call (the gaps between them are where the device waited for the host)."""
    import statistics

    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
            torch.cuda.synchronize()
    dur = lambda e: e.time_range.elapsed_us()  # noqa: E731
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA" and dur(e) > 0]
    kernels.sort(key=lambda e: e.time_range.start)
    per_call = len(kernels) // iters
    if not per_call or len(kernels) % iters:
        print(f"== device time: {len(kernels)} kernels in {iters} calls, not a whole number per call")
        return
    calls = [kernels[i * per_call:(i + 1) * per_call] for i in range(iters)]
    print(f"== device time of one forward + backward ({per_call} kernels; median of {iters} calls, us: "
          "duration, start after the call's first kernel)")
    for j, e in enumerate(calls[0]):
        start = statistics.median(c[j].time_range.start - c[0].time_range.start for c in calls)
        print(f"  {statistics.median(dur(c[j]) for c in calls):8.1f} {start:8.1f}  {e.name[:80]}")
    busy = statistics.median(sum(dur(e) for e in c) for c in calls)
    span = statistics.median(c[-1].time_range.end - c[0].time_range.start for c in calls)
    print(f"  {busy:8.1f}  kernels' sum; first start to last end {span:.1f}")


def _primitives(q, k, v, dout, out, lse, scale):
    """(label, call) for the building blocks each layer of the public path is made of: torch's
    allocations and device switches, the interface's checks, one TMA descriptor (built, and
    encoded as Triton's launcher encodes it), the autograd machinery around a no-op function, and
    the forward kernel's compiled launcher called with ready arguments."""
    from hf_flash import _checks, interface
    from hf_flash._runtime import direct_call
    from hf_flash.kernels import launch
    from hf_flash.kernels.hopper import attention_fwd as hk

    dev = q.device
    desc = hk._descriptor(q, 128)
    q_g, k_g, v_g = (t.clone().requires_grad_() for t in (q, k, v))

    def device_switch():
        with torch.cuda.device(dev):
            pass
    prims = [
        ("torch.empty_like(q)", lambda: torch.empty_like(q)),
        ("torch.empty lse (float32)", lambda: torch.empty((1, q.shape[2], q.shape[1]), device=dev,
                                                          dtype=torch.float32)),
        ("torch.zeros(1) int32", lambda: torch.zeros(1, dtype=torch.int32, device=dev)),
        ("torch.empty(1) int32 + zero_()", lambda: torch.empty(1, dtype=torch.int32, device=dev).zero_()),
        ("with torch.cuda.device(dev): pass", device_switch),
        ("torch.cuda.current_device()", torch.cuda.current_device),
        ("torch.compiler.is_compiling()", torch.compiler.is_compiling),
        ("direct_call(q, k, v)", lambda: direct_call(q, k, v)),
        ("torch.is_grad_enabled + requires_grad x3", lambda: torch.is_grad_enabled() and any(
            t.requires_grad for t in (q, k, v))),
        ("checks of dense_attention", lambda: (
            _checks.check_tensor_basics(q, k, v), _checks.check_heads(32, 8, 8, *(t.shape[3] for t in (q, k, v))),
            _checks.check_options(dropout_p=0.0, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                                  alibi_slopes=None, nheads=32, batch=1, learnable_sink=None, device=dev))),
        ("interface._call_options", lambda: interface._call_options(q, 512, 512, 0.0, None, True, (-1, -1), 0.0)),
        ("attention_fwd.tma_compatible(q)", lambda: hk.tma_compatible(q)),
        ("attention_fwd._descriptor(q)", lambda: hk._descriptor(q, 128)),
        ("launch.tensor_spec(4 descriptors, 2 tensors)", lambda: launch.tensor_spec((desc, desc, desc, desc, out,
                                                                                     lse))),
    ]
    # the forward's compiled launcher, found by one public call
    from hf_flash import flash_attn_func as public

    with torch.no_grad():
        public(q, k, v, causal=True)
    directs = [entry[3] for entry in hk._FORWARD._spec.values() if entry[3] is not None and entry[3].descriptors]
    if directs:
        metadata = next(iter(directs[0].descriptors.values()))
        prims.append(("make_tensordesc_arg (encode one descriptor)", lambda: launch._encode(desc, metadata)))
    prims += _launch_layers(q, k, v, out, lse, scale)
    prims += [
        ("autograd.Function apply, no-op (3 inputs)", lambda: _Noop.apply(q_g, k_g, v_g)),
        ("autograd.grad of that no-op", lambda: torch.autograd.grad(_Noop.apply(q_g, k_g, v_g), (q_g, k_g, v_g),
                                                                    dout)),
    ]
    return prims


def _launch_layers(q, k, v, out, lse, scale):
    """(label, call) for the layers of one Gluon forward launch from its kept plan down to the
    driver: the plan's pointer arguments rebuilt (descriptors), the cached launcher
    (:class:`~hf_flash.kernels.launch.CachedLauncher`: keys, then the compiled kernel's
    launcher), the launch of a plan bound to its kernel (``run_plan``), Triton's
    ``CompiledKernel.run`` (``CudaLauncher``: scratch, then its descriptor wrapper) with ready
    arguments, and the generated C launcher alone with every descriptor already encoded
    (argument parsing, pointer checks, ``cuLaunchKernelEx``)."""
    from hf_flash.kernels import launch
    from hf_flash.kernels.hopper import attention_fwd as hk

    variant = hk.default_variant(q.shape[-1], True, seqlen_q=q.shape[1])
    hk.hopper_attention_forward(q, k, v, out, lse, softmax_scale=scale, causal=True, variant=variant)
    counter = hk.item_counter(q.device) if hk.VARIANTS[variant].dynamic else None
    tensors = (q, k, v, out, lse, None, None, None, counter)
    plan = hk._plan(tensors, variant, True, (-1, 0), 0.0, scale)
    ptrs = plan.pointers(tensors)
    launcher = hk._FORWARD
    launcher(plan.grid, ptrs, plan.ints, plan.floats, plan.meta)  # (an exact entry for these arguments)
    bound = hk._plan(tensors, variant, True, (-1, 0), 0.0, scale)
    for _ in range(2):  # the second fast launch goes through the bound plan
        launcher.run_plan(bound, tensors)
    layers = [
        ("launch: plan.pointers (4 descriptors built)", lambda: plan.pointers(tensors)),
        ("launch: CachedLauncher, ready pointers", lambda: launcher(plan.grid, ptrs, plan.ints, plan.floats,
                                                                    plan.meta)),
        ("launch: run_plan, the plan bound" + ("" if bound.bound else " (not bound)"),
         lambda: launcher.run_plan(bound, tensors)),
    ]
    found = launcher._kept(ptrs, plan.ints, plan.meta)
    if found is None:
        return layers
    (run, function, packed, direct), _device = found
    grid = tuple(plan.grid) + (1,) * (3 - len(plan.grid))
    stream = torch.cuda.current_stream().cuda_stream
    tail = (*launch.tensor_spec(ptrs)[0], *plan.ints, *plan.floats, *plan.meta.tail)
    layers.append(("launch: CompiledKernel.run, ready arguments",
                   lambda: run(*grid, stream, function, packed, None, None, None, *tail)))  # fmt: skip
    if direct is None:
        return layers
    expanded = []
    for i, arg in enumerate(tail):
        if i in direct.descriptors:
            expanded.extend(launch._encode(arg, direct.descriptors[i]))
        else:
            expanded.append(arg)
    base = (*grid, stream, function, direct.cooperative, direct.pdl, None, None, packed, None, None, None)
    layers.append(("launch: C launcher, descriptors encoded", lambda: direct.raw(*base, *expanded)))
    return layers


class _Noop(torch.autograd.Function):
    """The autograd machinery alone: returns a view-free new tensor, gradients passed through."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, dout):
        q, k, v = ctx.saved_tensors
        return dout, torch.empty_like(k), torch.empty_like(v)


def _stages(q, k, v, qg, kg, vg, dout, out, lse, scale):
    """(label, call) for each layer of the public path, called with the arguments it gets there."""
    from hf_flash.kernels import flash_bwd, flash_fwd
    from hf_flash.kernels.hopper import attention_bwd as hb
    from hf_flash.kernels.hopper import attention_fwd as hk

    d = q.shape[-1]
    opts = dict(cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=q.shape[1], max_seqlen_k=k.shape[1],
                softmax_scale=scale, causal=True, window_left=-1, window_right=0, softcap=0.0,
                alibi_slopes=None, dropout_p=0.0, rng_state=None)  # fmt: skip
    path = dict(varlen=False, causal=True, window_left=-1, window_right=0, softcap=0.0, alibi_slopes=None,
                dropout_p=0.0, softmax_scale=scale)  # fmt: skip
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    flash_fwd.flash_attn_forward(q, k, v, out, lse, **opts)
    variant = hb.variant_for(d, True, False, q.shape[1], (-1, 0))
    stats_m = hb.VARIANTS[variant].stats_rows
    delta, stats = flash_bwd.backward_preprocess(out, dout, None, lse, cu_seqlens_q=None, max_seqlen_q=q.shape[1],
                                                 stats_m=stats_m)  # fmt: skip
    var = hb.VARIANTS[variant]
    dq_accum = hb.dq_accum_for(q, variant)
    dq_sem = torch.zeros(hb.dq_sem_count(q, variant), device=q.device, dtype=torch.int32)
    o = flash_attn_func(qg, kg, vg, causal=True)

    def launch_args():
        hb.launch_args(q, k, v, dout, lse, delta, dk, dv, dq_accum, dq_sem, stats, softmax_scale=scale, causal=True,
                       variant=variant, window=(-1, 0))  # fmt: skip

    from hf_flash import interface

    plan_args = (0.0, None, True, (-1, -1), 0.0, None, False, None, None, None)
    plan = interface._dense_plan(qg, kg, vg, *plan_args)
    planned = []
    if plan is not None:
        saved = (q, k, v, *plan.attend(q, k, v))
        planned = [
            ("interface._dense_plan (kept plan)", lambda: interface._dense_plan(qg, kg, vg, *plan_args)),
            ("_DensePlan.attend (forward, allocations)", lambda: plan.attend(q, k, v)),
            ("_DensePlan.grads (backward, allocations)", lambda: plan.grads(dout, *saved)),
        ]
    return [
        *planned,
        ("forward_path", lambda: flash_fwd.forward_path(q, k, v, out, **path)),
        ("attention_fwd.supports", lambda: hk.supports(q, k, v, causal=True, window=(-1, 0), softmax_scale=scale)),
        ("flash_fwd.flash_attn_forward", lambda: flash_fwd.flash_attn_forward(q, k, v, out, lse, **opts)),
        ("backward_path", lambda: flash_bwd.backward_path(q, k, v, out, dout, dk, dv, **path)),
        ("attention_bwd.supports", lambda: hb.supports(q, k, v, out, dout, dk, dv, causal=True, window=(-1, 0),
                                                       softmax_scale=scale)),  # fmt: skip
        ("backward_preprocess", lambda: flash_bwd.backward_preprocess(out, dout, None, lse, cu_seqlens_q=None,
                                                                      max_seqlen_q=q.shape[1], stats_m=stats_m)),
        (f"attention_bwd.launch_args {variant}", launch_args),
        ("hopper_attention_backward", lambda: hb.hopper_attention_backward(
            q, k, v, dout, lse, delta, dq, dk, dv, softmax_scale=scale, causal=True, variant=variant,
            window=(-1, 0), stats=stats)),
        *([("dq_frag_to_bshd", lambda: hb.dq_frag_to_bshd(dq_accum, dq, var.block_m, var.consumers))]
          if var.dq_frag else []),
        ("dq_accum_for (allocation)", lambda: hb.dq_accum_for(q, variant)),
        ("torch.zeros dq_sem", lambda: torch.zeros(hb.dq_sem_count(q, variant), device=q.device,
                                                   dtype=torch.int32)),
        ("flash_bwd.flash_attn_backward", lambda: flash_bwd.flash_attn_backward(
            dout, None, q, k, v, out, lse, dq, dk, dv, **opts)),
        ("autograd backward (kept graph)", lambda: torch.autograd.grad(o, (qg, kg, vg), dout, retain_graph=True)),
    ]


if __name__ == "__main__":
    main()

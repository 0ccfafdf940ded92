"""Attention kernels: forward, backward and forward+backward TFLOP/s, hf_flash beside its peers.

Run on a GPU from the repository root::

    PYTHONPATH=. python benchmarks/attention.py --out OUTDIR [--quick]
    PYTHONPATH=. python benchmarks/attention.py --sweep-configs --out OUTDIR

Providers, all timed in one process on the same inputs (bf16, Hq=32, Hkv=8):

  hf_flash    ``hf_flash.flash_attn_func``, layout (B, S, H, D); GQA by K/V head indexing. On an
              H100 the forward runs the Gluon Hopper kernel where it covers the call; every
              row records the kernels that ran (``paths``, from ``attention_paths``) and, where
              they are the Gluon kernels, which variants (``variants``).
  hf_flash_triton  the same with the Gluon kernel switched off (``configs.use_hopper(False)``):
              the portable Triton kernels, what other GPUs run.
  sdpa        ``F.scaled_dot_product_attention(..., enable_gqa=True)``, no backend forced: what
              transformers' "sdpa" runs for unmasked attention.
  sdpa_flash  the same under ``sdpa_kernel(FLASH_ATTENTION)`` (FlashAttention-2 in PyTorch).
  sdpa_cudnn  the same under ``sdpa_kernel(CUDNN_ATTENTION)``.
  flex        ``torch.compile(flex_attention)`` with ``enable_gqa=True`` and a block mask from
              ``create_block_mask`` (causal / sliding window; none for full attention).

GQA with a forced SDPA backend: ``enable_gqa=True`` is tried first; if that backend refuses it,
K and V are expanded to Hq heads (``repeat_interleave`` on the head axis, the same head mapping)
once, outside the timed region, and the result records ``"gqa": "expanded"``. FLOPs depend on
Hq only, so every provider is credited with the same count.

Softcap (``--masks softcap``): causal attention with Gemma 2's score cap, scores ``50 *
tanh(s / 50)`` (flash-attn ``softcap=50``); FlexAttention gets it as a ``score_mod`` beside its
causal block mask; SDPA has no softcap (recorded as unsupported). Credited with causal FLOPs.

Sliding window W=4096 means causal attention where query i sees keys (i - W, i]
(flash-attn ``window_size=(W - 1, 0)``). SDPA has no window argument: ``sdpa`` gets K/V expanded
and a materialised boolean mask (what transformers' sdpa path does with any mask), ``sdpa_cudnn``
is tried with the same mask, and ``sdpa_flash`` (which takes no mask) is recorded as unsupported.
Window rows are only run for S > W: for S <= W they are the causal rows.

FLOPs (identical for every provider): fwd = 4 * B * Hq * D * pairs, where pairs = S^2 (full),
S^2 / 2 (causal) or the exact number of visible (query, key) pairs (window);
bwd = 2.5 x fwd; fwd+bwd = 3.5 x fwd.

Timing (``harness.bench_ms``: CUDA events, L2 flushed, median with p20/p80):
  fwd      the forward under ``torch.no_grad()`` (prefill);
  bwd      ``torch.autograd.grad`` of an output whose graph is retained (backward kernels only);
  fwd+bwd  forward with autograd, then ``torch.autograd.grad``.
With ``--rounds N`` every shape's providers take turns N times (in reverse order on odd rounds)
and each row holds a provider's median round (``rounds_ms``: every round's time), so a drift of
the GPU's clock over the run lands in the spread, not in one provider's number (default 1 for
the grid). ``ratio`` is the ratio of the median rounds; ``ratio_paired`` the median over rounds
of each round's own ratio, which cancels a drift slower than one round.

FlexAttention is compiled once (``--flex-compile dynamic``, the default: one graph per mask,
pass and head dim serves every S, which keeps the full grid inside ~5 minutes) or per shape
(``static``: Inductor then also knows S divides the tile; fairer per shape, slower to compile).
The mode is recorded in every flex result.

Packed rows (``--packed``): 12 documents of random lengths (fixed seed) packed into 16K tokens,
causal within each document, d128 and d64, q (T, 32, D), k/v (T, 8, D). Providers: ``hf_flash``
(``hf_flash.interface.varlen_attention`` with ``check_cu_seqlens=False``: ``flash_attn_varlen_func``
without its host-side cu_seqlens check, as transformers' integration calls it; the library's
default paths: on an H100 the Triton forward (the packed Gluon forward is opt-in) and, at d128,
the Gluon backward), ``hf_flash_gluon_varlen`` (the packed Gluon forward switched on),
``hf_flash_triton`` (every Gluon kernel off), ``hf_flash_triton_bwd`` /
``hf_flash_gluon_varlen_triton_bwd`` (those two with the Gluon backward off: the Triton
backward behind the same forward), ``gluon_longest`` / ``gluon_docorder`` (the Gluon launcher
called directly, the schedule longest first / in document order; forward only), ``gluon_ws2x4`` (d64: the
two-consumer variant instead of the packed default; forward only), ``flex`` (FlexAttention with a
document-causal block mask, the peer), and ``sdpa_dense`` (SDPA, no backend forced, causal over
the same 16K tokens as one sequence: context, credited with its own dense FLOPs). Packed FLOPs:
fwd = 4 * Hq * D * sum(L_i^2) / 2. Providers take turns over ``--rounds`` rounds; rows hold the
median of the rounds (passes fwd, bwd and fwd+bwd; ``--packed-providers`` picks a subset).
``host_ms``: the host time of one forward call with the device idle.

Every row also records ``max_abs_diff_vs_sdpa``: hf_flash's forward output against ``sdpa``'s on
the same inputs (a spot check; the tests hold the real numerical bar).
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import sys
import time
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from benchmarks.bars import bar_checks, summary_lines, window_speedup
from benchmarks.harness import base_parser, bench_ms, print_table, write_results

NHEADS_Q = 32
NHEADS_KV = 8
TOKENS = 16384  # tokens per batch: B = TOKENS // S (at least 1)
WINDOW = 4096
SOFTCAP = 50.0  # Gemma 2's attention logit cap
DEVICE = "cuda"
SEQLENS = (1024, 2048, 4096, 8192, 16384, 32768)
HEAD_DIMS = (128, 64)
MASKS = ("causal", "full", "window", "softcap")
PROVIDERS = ("hf_flash", "hf_flash_triton", "sdpa", "sdpa_flash", "sdpa_cudnn", "flex")
PEERS = PROVIDERS[1:]
PASSES = ("fwd", "bwd", "fwd+bwd")
PASS_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}
QUICK_SHAPES = ((128, "causal", 4096), (128, "causal", 32768), (128, "window", 32768),
                (64, "causal", 4096))  # fmt: skip


# --------------------------------------------------------------------------------------------
# Shapes and FLOPs
# --------------------------------------------------------------------------------------------


def visible_pairs(seqlen: int, mask: str, window: int = WINDOW) -> float:
    """Number of (query, key) pairs each FLOP count is credited with, per batch and head."""
    if mask == "full":
        return float(seqlen * seqlen)
    if mask in ("causal", "softcap"):
        return seqlen * seqlen / 2  # the convention of the published FA2 / cuDNN numbers
    if mask == "window":
        # query i sees min(i + 1, window) keys
        w = min(window, seqlen)
        return float(w * (w + 1) // 2 + (seqlen - w) * w)
    raise ValueError(f"unknown mask {mask!r}")


def fwd_flops(batch: int, seqlen: int, head_dim: int, mask: str) -> float:
    return 4.0 * batch * NHEADS_Q * head_dim * visible_pairs(seqlen, mask)


def grid(args) -> list[tuple[int, str, int]]:
    if args.quick:
        shapes = list(QUICK_SHAPES)
    else:
        # --head-dims and --seqlens may name values outside the default grid (head dim 512, 512
        # queries)
        shapes = [(d, m, s) for d in (args.head_dims or HEAD_DIMS) for m in MASKS for s in (args.seqlens or SEQLENS)]
        shapes = [(d, m, s) for d, m, s in shapes if m != "window" or s > WINDOW]
    keep = lambda d, m, s: (  # noqa: E731
        (not args.head_dims or d in args.head_dims)
        and (not args.masks or m in args.masks)
        and (not args.seqlens or s in args.seqlens)
    )
    return [x for x in shapes if keep(*x)]


# --------------------------------------------------------------------------------------------
# Providers. Each builder gets the shape and the shared (B, S, H, D) inputs and returns
# (attn, leaves, dout, info[, context]): attn() runs the forward on leaves; info is recorded in
# the row; context (a context-manager factory) wraps the timing of every pass, backward included.
# --------------------------------------------------------------------------------------------


class Unsupported(Exception):
    """The provider cannot run this shape by design (recorded, not an error of the run)."""


def _error(e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:240]}"


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().requires_grad_(True)


def _bhsd(t: torch.Tensor) -> torch.Tensor:
    """(B, S, H, D) -> contiguous (B, H, S, D), the layout SDPA and FlexAttention are fast in."""
    return t.transpose(1, 2).contiguous()


def _window_mask(seqlen: int, device) -> torch.Tensor:
    """Boolean (1, 1, S, S) mask, True where query i may see key j: i - W < j <= i."""
    m = torch.ones(seqlen, seqlen, dtype=torch.bool, device=device)
    m.tril_().triu_(-(WINDOW - 1))
    return m.view(1, 1, seqlen, seqlen)


def _hf_flash_builder(hopper: bool):
    """``hf_flash`` (the kernels hf_flash chooses: the Gluon forward on an H100 where it
    covers the call) or, with ``hopper=False``, ``hf_flash_triton`` (the portable Triton
    kernels only). Each row records the kernels that ran (``paths``) and their Gluon variants
    (``variants``)."""

    def build(shape, q, k, v, dout):
        from hf_flash import flash_attn_func
        from hf_flash.interface import attention_paths, attention_variants
        from hf_flash.kernels import configs

        mask = shape["mask"]
        kw = {"causal": mask != "full"}
        if mask == "window":
            kw["window_size"] = (WINDOW - 1, 0)
        if mask == "softcap":
            kw["softcap"] = SOFTCAP
        leaves = (_leaf(q), _leaf(k), _leaf(v))

        # hf_flash_triton switches the Gluon kernel off; hf_flash runs what hf_flash picks
        switch = contextlib.nullcontext if hopper else (lambda: configs.use_hopper(False))

        def attn():
            with switch():
                return flash_attn_func(*leaves, **kw)

        with switch():
            paths = attention_paths(*leaves, **kw)
            variants = attention_variants(*leaves, **kw)
        # the switch also wraps the timing (run_shape): autograd runs the backward outside
        # attn(), and the backward reads the configs then
        return attn, leaves, dout, {"paths": paths, "variants": variants}, switch

    return build


_SDPA_BACKENDS = {"sdpa": None, "sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION"}


def _sdpa_builder(name: str):
    def build(shape, q, k, v, dout):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = _SDPA_BACKENDS[name]
        mask = shape["mask"]
        if mask == "window" and name == "sdpa_flash":
            raise Unsupported("SDPA's flash backend takes no attention mask or window")
        if mask == "softcap":
            raise Unsupported("SDPA has no softcap")
        if backend is None:
            ctx = contextlib.nullcontext
        else:
            ctx = lambda: sdpa_kernel(getattr(SDPBackend, backend))  # noqa: E731
        attn_mask = _window_mask(shape["seqlen"], q.device) if mask == "window" else None
        is_causal = mask == "causal"
        qs, ks, vs, ds = _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(dout)
        group = NHEADS_Q // NHEADS_KV

        def make(kk, vv, gqa):
            leaves = (_leaf(qs), _leaf(kk), _leaf(vv))

            def attn():
                with ctx():
                    return F.scaled_dot_product_attention(
                        *leaves, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=gqa
                    )

            return attn, leaves

        # With a mask, the unforced dispatcher would route enable_gqa to the math kernel (an
        # S x S score matrix); transformers expands K/V there instead, and so do we.
        if not (name == "sdpa" and attn_mask is not None):
            attn, leaves = make(ks, vs, True)
            try:
                with torch.no_grad():
                    attn()
                return attn, leaves, ds, {"gqa": "native"}
            except RuntimeError as e:
                if backend is None:
                    raise
                refused = _error(e)
                del attn, leaves
        else:
            refused = "masked path (as transformers' sdpa)"
        attn, leaves = make(ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1), False)
        return attn, leaves, ds, {"gqa": "expanded", "gqa_native_error": refused}

    return build


_FLEX: dict[str, Callable] = {}
_FLEX_DYNAMIC_ERROR: list[str] = []  # once dynamic shapes failed, later shapes compile statically


def _flex_fn(mode: str) -> Callable:
    if mode not in _FLEX:
        import torch._dynamo
        from torch.nn.attention.flex_attention import flex_attention

        # every (mask, pass, head dim, S) may add a graph; never fall back to eager flex
        for knob in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, knob):
                setattr(torch._dynamo.config, knob, 256)
        for knob in ("accumulated_recompile_limit", "accumulated_cache_size_limit"):
            if hasattr(torch._dynamo.config, knob):
                setattr(torch._dynamo.config, knob, 4096)
        _FLEX[mode] = torch.compile(flex_attention, dynamic=(mode == "dynamic"))
    return _FLEX[mode]


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _sliding(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < WINDOW)


def _softcap(score, b, h, q_idx, kv_idx):
    return SOFTCAP * torch.tanh(score / SOFTCAP)


def build_flex(shape, q, k, v, dout, mode: str = "dynamic"):
    from torch.nn.attention.flex_attention import create_block_mask

    mask, seqlen = shape["mask"], shape["seqlen"]
    block_mask = None
    if mask != "full":
        mod = _sliding if mask == "window" else _causal
        block_mask = create_block_mask(mod, None, None, seqlen, seqlen, device=q.device)
    extra = {"score_mod": _softcap} if mask == "softcap" else {}
    leaves = (_leaf(_bhsd(q)), _leaf(_bhsd(k)), _leaf(_bhsd(v)))
    if mode == "dynamic" and _FLEX_DYNAMIC_ERROR:
        mode = "static"
    info = {"compile": mode}
    state = {"fn": _flex_fn(mode)}

    def attn():
        try:
            return state["fn"](*leaves, block_mask=block_mask, enable_gqa=True, **extra)
        except Exception as e:
            # a dynamic-shape compile failure must not lose the peer: compile this shape alone
            if info["compile"] != "dynamic":
                raise
            info.update({"compile": "static", "dynamic_error": _error(e)})
            _FLEX_DYNAMIC_ERROR.append(info["dynamic_error"])
            state["fn"] = _flex_fn("static")
            return state["fn"](*leaves, block_mask=block_mask, enable_gqa=True, **extra)

    return attn, leaves, _bhsd(dout), info


def builders(flex_mode: str) -> dict[str, Callable]:
    return {
        "hf_flash": _hf_flash_builder(True),
        "hf_flash_triton": _hf_flash_builder(False),
        **{name: _sdpa_builder(name) for name in _SDPA_BACKENDS},
        "flex": lambda *a: build_flex(*a, mode=flex_mode),
    }


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def time_passes(attn, leaves, dout, passes, timing) -> dict:
    """{pass: {"ms", "p20_ms", "p80_ms"} or {"error"}} for one provider on one shape."""
    res = {}
    if "fwd" in passes:
        try:
            with torch.no_grad():
                attn()
                res["fwd"] = bench_ms(attn, **timing)
        except Exception as e:
            res["fwd"] = {"error": _error(e)}
        _free()
    if "bwd" in passes:
        try:
            out = attn()
            torch.autograd.grad(out, leaves, dout, retain_graph=True)
            res["bwd"] = bench_ms(
                lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True), **timing
            )
        except Exception as e:
            res["bwd"] = {"error": _error(e)}
        out = None
        _free()
    if "fwd+bwd" in passes:
        try:
            torch.autograd.grad(attn(), leaves, dout)
            res["fwd+bwd"] = bench_ms(lambda: torch.autograd.grad(attn(), leaves, dout), **timing)
        except Exception as e:
            res["fwd+bwd"] = {"error": _error(e)}
        _free()
    # A compiled graph may refuse a second backward (retain_graph): fall back to the difference
    # of fwd+bwd and the (no-grad) forward, flagged as derived.
    bwd, both, fwd = res.get("bwd", {}), res.get("fwd+bwd", {}), res.get("fwd", {})
    if "error" in bwd and "ms" in both and "ms" in fwd and both["ms"] > fwd["ms"]:
        res["bwd"] = {"ms": both["ms"] - fwd["ms"], "derived": "fwd+bwd - fwd",
                      "bwd_error": bwd["error"]}  # fmt: skip
    return res


def median_round(runs: list[dict]) -> dict:
    """One provider's result for one pass over several rounds: the round with the median time,
    with every timed round's ms in ``rounds_ms``; the last round's error when none was timed."""
    ok = [x for x in runs if "ms" in x]
    if not ok:
        return runs[-1]
    mid = sorted(ok, key=lambda x: x["ms"])[len(ok) // 2]
    return {**mid, "rounds_ms": [x["ms"] for x in ok]}


def paired_ratio(ours: dict, peer: dict) -> Optional[float]:
    """The median over rounds of the peer's time / ours in the same round (the two timed close
    together, so a drift of the GPU's clock over the run cancels), or None without at least two
    rounds timed for both (a round that errored leaves the rounds unpaired). ``ratio`` is the
    ratio of the two median rounds."""
    a, b = ours.get("rounds_ms") or [], peer.get("rounds_ms") or []
    if len(a) < 2 or len(a) != len(b):
        return None
    return statistics.median(y / x for x, y in zip(a, b))


def spot_check(built: dict) -> tuple[Optional[float], Optional[str]]:
    """max |hf_flash - sdpa| of the forward outputs, in (B, S, H, D)."""
    if "hf_flash" not in built or "sdpa" not in built:
        return None, "hf_flash or sdpa unavailable"
    try:
        with torch.no_grad():
            a = built["hf_flash"][0]().float()
            b = built["sdpa"][0]().transpose(1, 2).float()
            return float((a - b).abs().max()), None
    except Exception as e:
        return None, _error(e)


def run_shape(head_dim, mask, seqlen, args, build, timing) -> list[dict]:
    batch = max(1, TOKENS // seqlen)
    shape = {"head_dim": head_dim, "mask": mask, "seqlen": seqlen, "batch": batch}
    gen = torch.Generator(device=DEVICE).manual_seed(seqlen * 1000 + head_dim)

    def randn(h):
        return torch.randn(batch, seqlen, h, head_dim, device=DEVICE, dtype=torch.bfloat16,
                           generator=gen)  # fmt: skip

    q, k, v, dout = randn(NHEADS_Q), randn(NHEADS_KV), randn(NHEADS_KV), randn(NHEADS_Q)
    built, info, times = {}, {}, {}
    for name in args.providers:
        try:
            built[name] = build[name](shape, q, k, v, dout)
            info[name] = built[name][3]
        except Unsupported as e:
            info[name] = {"unsupported": str(e)}
        except Exception as e:
            info[name] = {"error": _error(e)}
    diff, diff_error = spot_check(built)
    _free()
    # providers take turns over the rounds, in reverse order on odd rounds (drift between them
    # shows as spread, not as bias, and no provider always follows the same one); each provider
    # is freed after its last round
    timed: dict = {name: {} for name in built}
    for r in range(args.rounds):
        for name in args.providers if r % 2 == 0 else args.providers[::-1]:
            if name not in built:
                continue
            attn, leaves, dout_p, _, *context = built[name]
            with (context[0] if context else contextlib.nullcontext)():
                res = time_passes(attn, leaves, dout_p, args.passes, timing)
            for p, x in res.items():
                timed[name].setdefault(p, []).append(x)
            if r == args.rounds - 1:
                built.pop(name)
                _free()
    for name in args.providers:
        if name in timed:
            times[name] = {p: median_round(runs) for p, runs in timed[name].items()}
        else:
            times[name] = {p: dict(info[name]) for p in args.passes}
    del q, k, v, dout
    _free()

    flops = fwd_flops(batch, seqlen, head_dim, mask)
    rows = []
    for p in args.passes:
        f = flops * PASS_FACTOR[p]
        results, tflops = {}, {}
        for name in args.providers:
            r = dict(times[name].get(p, {"error": "not run"}))
            r.update({k: v for k, v in info[name].items() if k not in ("error", "unsupported")})
            if "ms" in r:
                r["tflops"] = f / (r["ms"] * 1e-3) / 1e12
                tflops[name] = r["tflops"]
            results[name] = r
        hf = tflops.get("hf_flash")
        ratio = {peer: (hf / tflops[peer] if hf and tflops.get(peer) else None) for peer in PEERS}
        paired = {peer: paired_ratio(results.get("hf_flash", {}), results.get(peer, {})) for peer in PEERS}
        rows.append({
            **shape, "nheads_q": NHEADS_Q, "nheads_kv": NHEADS_KV, "dtype": "bfloat16",
            "window": WINDOW if mask == "window" else None, "pass": p, "flops": f,
            "tflops": tflops, "ratio": ratio, "ratio_paired": paired, "results": results,
            "max_abs_diff_vs_sdpa": diff, "spot_check_error": diff_error,
        })  # fmt: skip
    return rows


# --------------------------------------------------------------------------------------------
# --sweep-configs: hf_flash launch parameters (hf_flash.kernels.configs.override)
# --------------------------------------------------------------------------------------------


def _cfg(bm, bn, w, s):
    return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": s}


# Candidates for head_dim 128 on Hopper; shared-memory overflows show up as errors in the rows.
SWEEP = {
    "fwd": [_cfg(128, 128, 8, 2), _cfg(128, 128, 8, 3), _cfg(128, 64, 8, 3), _cfg(128, 64, 8, 4),
            _cfg(128, 64, 4, 3), _cfg(128, 32, 4, 4), _cfg(64, 128, 4, 3), _cfg(64, 64, 4, 3),
            _cfg(64, 64, 4, 4), _cfg(128, 128, 4, 2)],
    "bwd_dkdv": [_cfg(32, 128, 8, 2), _cfg(32, 128, 4, 2), _cfg(32, 128, 8, 3), _cfg(64, 128, 8, 2),
                 _cfg(64, 128, 8, 1), _cfg(64, 64, 4, 2), _cfg(64, 64, 8, 3), _cfg(16, 128, 8, 2),
                 _cfg(32, 64, 4, 3)],
    "bwd_dq": [_cfg(128, 32, 8, 2), _cfg(128, 64, 8, 2), _cfg(128, 64, 8, 1), _cfg(64, 64, 4, 2),
               _cfg(64, 32, 4, 3), _cfg(64, 128, 8, 2), _cfg(128, 32, 4, 3)],
}  # fmt: skip
# head_dim 64 (the 1.2B shape of every end-to-end benchmark): half the shared memory per tile,
# so larger tiles and fewer warps per tile become candidates. Prediction before measuring: the
# forward's best is a 128 x 128 tile (as at d=128), and the dK/dV kernel, the slowest of the
# backward, gains most from a 64-row query walk (fewer loop trips per key tile).
SWEEP_D64 = {
    "fwd": [_cfg(128, 128, 8, 3), _cfg(128, 128, 4, 3), _cfg(128, 128, 8, 2), _cfg(128, 64, 4, 3),
            _cfg(128, 64, 4, 4), _cfg(128, 64, 8, 3), _cfg(64, 128, 4, 3), _cfg(64, 64, 4, 3)],
    "bwd_dkdv": [_cfg(32, 64, 4, 3), _cfg(64, 64, 4, 3), _cfg(64, 64, 4, 2), _cfg(32, 128, 4, 3),
                 _cfg(64, 128, 8, 2), _cfg(64, 128, 8, 3), _cfg(128, 128, 8, 2)],
    "bwd_dq": [_cfg(64, 32, 4, 3), _cfg(64, 64, 4, 3), _cfg(128, 32, 4, 3), _cfg(128, 64, 8, 2),
               _cfg(128, 64, 8, 3), _cfg(128, 128, 8, 2)],
}  # fmt: skip
# head_dim 512 (Gemma 4's global layers; configs.py sizes them from shared-memory arithmetic:
# fwd (64, 32, 8, 2), dK/dV (16, 32, 8, 2), dQ (32, 32, 8, 2)). Candidates that fit 227 KB:
# fewer stages, other tile shapes. Prediction (2026-11-25): the defaults within 10% of the best.
SWEEP_D512 = {
    "fwd": [_cfg(64, 32, 8, 1), _cfg(64, 64, 8, 1), _cfg(32, 32, 4, 2), _cfg(32, 64, 4, 1)],
    "bwd_dkdv": [_cfg(16, 32, 8, 1), _cfg(16, 32, 4, 2), _cfg(32, 32, 8, 1), _cfg(16, 16, 4, 2)],
    "bwd_dq": [_cfg(32, 32, 8, 1), _cfg(64, 32, 8, 1), _cfg(32, 16, 4, 2)],
}  # fmt: skip
# head_dim 256 (Gemma 2/3): the forward runs the Gluon kernel on Hopper, so only the backward's
# Triton kernels. Their first defaults (dK/dV (32, 64, 8 warps, 1 stage), dQ (64, 32, 8, 1)) spill
# 564 / 532 bytes per thread (compile_kernel of benchmarks/diagnostics/kernel_registers.py,
# sm_90a). Spill bytes of the candidates: dK/dV (32, 64, 8, 2) 76, (16, 64, 8, 2) 12, (32, 64, 8,
# 3) 248, (32, 32, 8, 2) 0; dQ (64, 32, 8, 2) 0, (64, 64, 8, 2) 0, (64, 32, 8, 3) 0, (128, 32, 8,
# 2) 0, (64, 16, 4, 2) 0. Not candidates: 4-warp dK/dV tiles of 64 keys and 128-key tiles spill
# 3.8-4.2 KB, (64, 64, 8, 1-2) 700-940 bytes.
SWEEP_D256 = {
    "fwd": [],
    "bwd_dkdv": [_cfg(32, 64, 8, 2), _cfg(16, 64, 8, 2), _cfg(32, 64, 8, 3), _cfg(32, 32, 8, 2)],
    "bwd_dq": [_cfg(64, 32, 8, 2), _cfg(64, 64, 8, 2), _cfg(64, 32, 8, 3), _cfg(128, 32, 8, 2),
               _cfg(64, 16, 4, 2)],
}  # fmt: skip
SWEEPS = {128: SWEEP, 64: SWEEP_D64, 256: SWEEP_D256, 512: SWEEP_D512}
SWEEP_SEQLENS = (4096, 16384)


@contextlib.contextmanager
def _force_configs(configs, forced: dict):
    """``configs.override(**forced)``, made to hold on every thread.

    The override is a ContextVar, and on CUDA autograd runs backward on its own worker thread,
    where a ContextVar set by the caller is not visible (torch <= 2.12). The launchers read
    ``configs.fwd_config`` / ``configs.bwd_configs`` at launch, so these wrappers see what each
    launch was given, record whether the override reached it, and apply it where it did not.
    """
    seen = {}
    fwd, bwd = configs.fwd_config, configs.bwd_configs

    def settle(kind, cfg):
        want = forced.get(kind)
        if want is not None:
            reached = all(cfg.get(x) == y for x, y in want.items())
            seen[f"{kind}_override_reached_launcher"] = reached
            cfg = cfg if reached else {**cfg, **want}
        seen[kind] = cfg
        return cfg

    def fwd_spy(*a, **kw):
        return settle("fwd", fwd(*a, **kw))

    def bwd_spy(*a, **kw):
        dkdv, dq = bwd(*a, **kw)
        return settle("bwd_dkdv", dkdv), settle("bwd_dq", dq)

    configs.fwd_config, configs.bwd_configs = fwd_spy, bwd_spy
    try:
        with configs.override(**forced):
            yield seen
    finally:
        configs.fwd_config, configs.bwd_configs = fwd, bwd


def _time_hf_flash(q, k, v, dout, passes, timing) -> dict:
    """{"<pass>_ms": ...} for hf_flash's causal forward (no grad) and/or backward alone."""
    from hf_flash import flash_attn_func

    times = {}
    if "fwd" in passes:
        with torch.no_grad():
            flash_attn_func(q, k, v, causal=True)
            fwd = bench_ms(lambda: flash_attn_func(q, k, v, causal=True), **timing)
        times["fwd_ms"] = fwd["ms"]
    if "bwd" in passes:
        out = flash_attn_func(q, k, v, causal=True)

        def bwd():
            return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

        bwd()
        times["bwd_ms"] = bench_ms(bwd, **timing)["ms"]
    return times


def sweep_configs(args, timing) -> list[dict]:
    """hf_flash alone, causal, for each head dim of ``--head-dims`` (default 128) that has a
    candidate list in SWEEPS: the default launch parameters, then each candidate for one kernel
    at a time (the other kernels keep their defaults)."""
    head_dims = args.head_dims or [128]
    missing = [d for d in head_dims if d not in SWEEPS]
    if missing:
        raise SystemExit(f"--sweep-configs has candidates for head dims {sorted(SWEEPS)}, not {missing}")
    rows = []
    for head_dim in head_dims:
        rows += _sweep_head_dim(args, timing, head_dim, SWEEPS[head_dim])
    return rows


def _sweep_head_dim(args, timing, head_dim: int, sweep: dict) -> list[dict]:
    from hf_flash.kernels import configs

    rows = []
    for seqlen in args.seqlens or SWEEP_SEQLENS:
        batch = max(1, TOKENS // seqlen)
        gen = torch.Generator(device=DEVICE).manual_seed(seqlen)
        q, k, v, dout = (
            torch.randn(batch, seqlen, h, head_dim, device=DEVICE, dtype=torch.bfloat16,
                        generator=gen).requires_grad_(True)
            for h in (NHEADS_Q, NHEADS_KV, NHEADS_KV, NHEADS_Q)
        )  # fmt: skip
        dout = dout.detach()
        flops = fwd_flops(batch, seqlen, head_dim, "causal")
        for kernel, cands in [("default", [None])] + list(sweep.items()):
            for cand in cands:
                row = {"head_dim": head_dim, "mask": "causal", "seqlen": seqlen, "batch": batch,
                       "kernel": kernel, "config": cand}  # fmt: skip
                forced = {} if cand is None else {kernel: cand}
                passes = {"default": ("fwd", "bwd"), "fwd": ("fwd",)}.get(kernel, ("bwd",))
                try:
                    with _force_configs(configs, forced) as seen:
                        row.update(_time_hf_flash(q, k, v, dout, passes, timing))
                    if cand is None:
                        row["used"] = {x: y for x, y in seen.items() if isinstance(y, dict)}
                    elif kernel not in seen:
                        row["error"] = f"the {kernel} launcher never asked configs for parameters"
                    else:
                        reached = seen[f"{kernel}_override_reached_launcher"]
                        row["override_reached_launcher"] = reached
                except Exception as e:
                    row["error"] = _error(e)
                for p in passes:
                    if f"{p}_ms" in row:
                        tflops = flops * PASS_FACTOR[p] / (row[f"{p}_ms"] * 1e-3) / 1e12
                        row[f"{p}_tflops"] = tflops
                rows.append(row)
                _free()
                timed = " ".join(f"{p} {row[p + '_ms']:.3f} ms" for p in passes if p + "_ms" in row)
                forced_here = row.get("override_reached_launcher") is False
                note = "  (forced by the benchmark)" if forced_here else ""
                print(f"sweep d={head_dim} S={seqlen} {kernel:8s} {cand or 'default'}: "
                      f"{timed or row.get('error')}{note}", flush=True)  # fmt: skip
        del q, k, v, dout
        _free()
    return rows


# --------------------------------------------------------------------------------------------
# Packed (varlen) rows
# --------------------------------------------------------------------------------------------

PACKED_DOCS = 12
PACKED_ROUNDS = 3  # --rounds' default for the packed rows (the grid's: 1)
PACKED_PROVIDERS = ("hf_flash", "hf_flash_gluon_varlen", "hf_flash_triton", "hf_flash_triton_bwd",
                    "hf_flash_gluon_varlen_triton_bwd", "gluon_longest", "gluon_docorder", "gluon_ws2x4", "flex",
                    "flex_static", "sdpa_dense")  # fmt: skip


def packed_lengths(n_docs: int = PACKED_DOCS, tokens: int = TOKENS, seed: int = 0) -> list[int]:
    """``n_docs`` random document lengths summing to ``tokens`` (uniform cut points)."""
    g = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(tokens - 1, generator=g)[: n_docs - 1] + 1
    bounds = [0, *sorted(cuts.tolist()), tokens]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def packed_inputs(lens, head_dim):
    """The packed rows' inputs for documents of ``lens`` tokens: (q, k, v, dout, cu_seqlens,
    max_len), bf16 (total, heads, head_dim), drawn from a generator seeded with the head dim."""
    tokens = sum(lens)
    gen = torch.Generator(device=DEVICE).manual_seed(head_dim)

    def randn(*shape):
        return torch.randn(*shape, device=DEVICE, dtype=torch.bfloat16, generator=gen)

    q, k, v = randn(tokens, NHEADS_Q, head_dim), randn(tokens, NHEADS_KV, head_dim), randn(tokens, NHEADS_KV, head_dim)
    dout = randn(tokens, NHEADS_Q, head_dim)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    return q, k, v, dout, cu, max(lens)


def packed_flops(lens, head_dim, causal=True) -> float:
    """The forward FLOPs of packed attention over documents of ``lens`` tokens (each document's
    own square, halved under causal masking)."""
    return 4.0 * NHEADS_Q * head_dim * sum(n * n for n in lens) / (2 if causal else 1)


def _packed_builders(lens, head_dim, flex_mode):
    """name -> (attn, leaves, dout, info, passes, flops_fwd) on shared packed inputs."""
    from hf_flash.interface import attention_paths, attention_variants, varlen_attention
    from hf_flash.kernels import configs

    tokens = sum(lens)
    q, k, v, dout, cu, max_len = packed_inputs(lens, head_dim)
    packed_flops_fwd = packed_flops(lens, head_dim)
    dense_flops = 4.0 * NHEADS_Q * head_dim * tokens * tokens / 2
    both = ("fwd", "bwd", "fwd+bwd")
    out = {}

    def hf(hopper, gluon_bwd=True):
        leaves = (_leaf(q), _leaf(k), _leaf(v))
        # "default": the library's own choice; True: packed Gluon forward switched on (the default)
        # False: every kernel Triton; gluon_bwd=False: the Gluon backward off (Triton backward)
        fwd_switch = {"default": contextlib.nullcontext, True: lambda: configs.use_hopper_varlen(True),
                      False: lambda: configs.use_hopper(False)}[hopper]  # fmt: skip

        @contextlib.contextmanager
        def switch():
            with fwd_switch(), configs.use_hopper_backward(gluon_bwd):
                yield

        def attn():
            with switch():
                # as transformers' integration calls it: no host-side cu_seqlens check (a sync)
                return varlen_attention(*leaves, cu, cu, max_len, max_len, causal=True, check_cu_seqlens=False)

        with switch():
            paths = attention_paths(*leaves, causal=True, varlen=True)
            variants = attention_variants(*leaves, causal=True, varlen=True)
        # the switch also wraps the timing (run_packed): the backward reads the configs when
        # autograd runs it, outside attn()
        return attn, leaves, dout, {"paths": paths, "variants": variants}, both, packed_flops_fwd, switch

    out["hf_flash"] = lambda: hf("default")
    out["hf_flash_gluon_varlen"] = lambda: hf(True)
    out["hf_flash_triton"] = lambda: hf(False)
    out["hf_flash_triton_bwd"] = lambda: hf("default", gluon_bwd=False)
    out["hf_flash_gluon_varlen_triton_bwd"] = lambda: hf(True, gluon_bwd=False)

    def gluon(**kw):
        from hf_flash.kernels.hopper import attention_fwd as hk

        o = torch.empty_like(q)
        lse = torch.empty(NHEADS_Q, tokens, device=DEVICE, dtype=torch.float32)

        def attn():
            hk.hopper_attention_forward(q, k, v, o, lse, softmax_scale=head_dim**-0.5, causal=True,
                                        cu_seqlens_q=cu, cu_seqlens_k=cu, **kw)  # fmt: skip
            return o

        return attn, (), None, {"launcher": kw}, ("fwd",), packed_flops_fwd

    out["gluon_longest"] = lambda: gluon(order="longest")
    out["gluon_docorder"] = lambda: gluon(order="document")
    if head_dim == 64:
        out["gluon_ws2x4"] = lambda: gluon(variant="ws2x4-overlap-fma")

    def flex(mode):
        from torch.nn.attention.flex_attention import create_block_mask

        doc = torch.repeat_interleave(torch.arange(len(lens), device=DEVICE), torch.tensor(lens, device=DEVICE))

        def document_causal(b, h, q_idx, kv_idx):
            return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

        block_mask = create_block_mask(document_causal, None, None, tokens, tokens, device=DEVICE)
        leaves = tuple(_leaf(t.transpose(0, 1).unsqueeze(0)) for t in (q, k, v))
        fn = _flex_fn(mode)

        def attn():
            return fn(*leaves, block_mask=block_mask, enable_gqa=True)

        return attn, leaves, dout.transpose(0, 1).unsqueeze(0).contiguous(), {"compile": mode}, both, packed_flops_fwd

    out["flex"] = lambda: flex(flex_mode)
    if flex_mode != "static":  # the peer at its best too: compiled for this one shape
        out["flex_static"] = lambda: flex("static")

    def sdpa_dense():
        leaves = tuple(_leaf(t.transpose(0, 1).unsqueeze(0)) for t in (q, k, v))

        def attn():
            return F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)

        info = {"context": "one dense causal sequence of the same tokens, its own FLOPs"}
        return attn, leaves, dout.transpose(0, 1).unsqueeze(0).contiguous(), info, both, dense_flops

    out["sdpa_dense"] = sdpa_dense
    return out, (q, k, v, cu, max_len)


def _to_tokens(o: torch.Tensor) -> torch.Tensor:
    """(1, H, T, D) -> (T, H, D); packed outputs pass through."""
    return o[0].transpose(0, 1) if o.dim() == 4 else o


def _host_ms(attn, n: int = 20) -> float:
    """Median host (CPU) time of one forward call after the device is idle: the launch path's
    own cost (schedule ops, descriptors, launch), which the device hides only while the host
    runs ahead of it."""
    ts = []
    with torch.no_grad():
        for _ in range(n):
            torch.cuda.synchronize()
            t = time.perf_counter()
            attn()
            ts.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    return sorted(ts)[n // 2]


def run_packed(args, timing) -> list[dict]:
    lens = packed_lengths()
    rows = []
    for head_dim in args.head_dims or HEAD_DIMS:
        t0 = time.time()
        makers, _ = _packed_builders(lens, head_dim, args.flex_compile)
        built, info = {}, {}
        for name in PACKED_PROVIDERS:
            if name not in makers or (args.packed_providers and name not in args.packed_providers):
                continue
            try:
                built[name] = makers[name]()
                info[name] = dict(built[name][3])
            except Exception as e:
                info[name] = {"error": _error(e)}
        # spot check: every packed provider's forward against flex's document-causal output
        diffs = {}
        if "flex" in built:
            with torch.no_grad():
                ref = _to_tokens(built["flex"][0]()).float()
                for name, b in built.items():
                    if name not in ("flex", "flex_static", "sdpa_dense"):
                        try:
                            diffs[name] = (_to_tokens(b[0]()).float() - ref).abs().max().item()
                        except Exception as e:
                            info[name] = {"error": _error(e)}
            del ref
        for name in ("hf_flash", "hf_flash_gluon_varlen", "hf_flash_triton", "gluon_longest", "gluon_docorder"):
            if name in built:
                try:
                    info[name]["host_ms"] = _host_ms(built[name][0])
                except Exception as e:
                    info[name]["host_error"] = _error(e)
        times = {name: {} for name in built}
        for r in range(args.rounds):
            for name, (attn, leaves, dout, _, passes, _, *switch) in built.items():
                with (switch[0] if switch else contextlib.nullcontext)():
                    res = time_passes(attn, leaves, dout, [p for p in passes], timing)
                for p, x in res.items():
                    times[name].setdefault(p, []).append(x)
        for p in ("fwd", "bwd", "fwd+bwd"):
            tflops, results = {}, {}
            for name, b in built.items():
                runs = times[name].get(p)
                if not runs:
                    continue
                res = median_round(runs)
                if "ms" not in res:
                    results[name] = res
                    continue
                flops = b[5] * PASS_FACTOR[p]
                tflops[name] = flops / (res["ms"] * 1e-3) / 1e12
                results[name] = {**res, "tflops": tflops[name], "flops": flops, **info[name]}
            for name, i in info.items():
                if "error" in i:
                    results[name] = i
            hf = tflops.get("hf_flash")
            rows.append({
                "mask": "packed", "head_dim": head_dim, "pass": p, "doc_lengths": lens, "tokens": sum(lens),
                "nheads_q": NHEADS_Q, "nheads_kv": NHEADS_KV, "dtype": "bfloat16", "tflops": tflops,
                "ratio": {n: hf / x for n, x in tflops.items() if hf and x and n != "hf_flash"}
                | _best_flex_ratio(hf, tflops),
                "max_abs_diff_vs_flex": diffs, "results": results,
            })  # fmt: skip
        built.clear()
        _free()
        print(f"packed D={head_dim}: {time.time() - t0:.0f}s", flush=True)
    return rows


def _best_flex_ratio(hf, tflops) -> dict:
    """hf_flash against the faster FlexAttention row (dynamic or static compile): the bar's peer."""
    best = max((tflops[n] for n in ("flex", "flex_static") if tflops.get(n)), default=None)
    return {"flex_best": hf / best} if hf and best else {}


def print_packed(rows) -> None:
    short = {"hf_flash": "hf", "hf_flash_gluon_varlen": "hf-glfwd", "hf_flash_triton": "hf-tri",
             "hf_flash_triton_bwd": "hf-tribwd", "hf_flash_gluon_varlen_triton_bwd": "hf-glfwd-tribwd",
             "gluon_longest": "gl-long", "gluon_docorder": "gl-doc", "gluon_ws2x4": "gl-2x4",
             "flex": "flex", "flex_static": "flex-st", "sdpa_dense": "sdpa-dense"}  # fmt: skip
    table = []
    for r in rows:
        t = {"D": r["head_dim"], "pass": r["pass"]}
        for name in PACKED_PROVIDERS:
            x = r["tflops"].get(name)
            t[short[name]] = f"{x:.0f}" if x else "-"
        x = r["ratio"].get("flex_best")
        t["hf/best flex"] = f"{x:.2f}" if x else "-"
        d = r["max_abs_diff_vs_flex"].get("hf_flash")
        t["diff"] = f"{d:.1e}" if d is not None else "-"
        for name, key in (("hf_flash", "host-hf"), ("hf_flash_gluon_varlen", "host-glv"), ("hf_flash_triton", "host-tri"),
                          ("gluon_docorder", "host-gl-doc")):  # fmt: skip
            h = r["results"].get(name, {}).get("host_ms")
            t[key] = f"{h:.2f}" if h is not None else "-"
        table.append(t)
    print(f"\npacked: {PACKED_DOCS} documents in {TOKENS} tokens (lengths {rows[0]['doc_lengths'] if rows else []}), "
          "causal, bf16, Hq=32, Hkv=8, TFLOP/s (sdpa-dense: one causal 16K sequence, its own FLOPs)")  # fmt: skip
    print_table(table, list(table[0]) if table else [])
    for r in rows:
        for name, res in r["results"].items():
            if "error" in res:
                print(f"[{name}] D{r['head_dim']} {r['pass']}: {res['error']}")


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    p.add_argument("--passes", nargs="+", default=list(PASSES), choices=PASSES)
    p.add_argument("--head-dims", nargs="+", type=int, help="only these head dims")
    p.add_argument("--masks", nargs="+", choices=MASKS, help="only these masks")
    p.add_argument("--seqlens", nargs="+", type=int, help="only these sequence lengths (may be outside the default grid)")
    p.add_argument("--flex-compile", choices=("dynamic", "static"), default="dynamic",
                   help="compile FlexAttention with dynamic shapes or once per shape")  # fmt: skip
    p.add_argument("--warmup-ms", type=float, default=10.0)
    p.add_argument("--rep-ms", type=float, default=40.0)
    p.add_argument("--min-calls", type=int, default=1,
                   help="at least this many timed calls per measurement (long calls: rep-ms grows)")  # fmt: skip
    p.add_argument("--packed", action="store_true",
                   help="instead of the grid: the packed rows (12 documents in 16K tokens, causal)")
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds per shape, providers taking turns; rows hold each provider's median "
                        f"round and every round's time (default: {PACKED_ROUNDS} packed, 1 grid)")  # fmt: skip
    p.add_argument("--packed-providers", nargs="+", choices=PACKED_PROVIDERS, default=None,
                   help="packed rows: only these providers (default: all)")
    p.add_argument("--sweep-configs", action="store_true",
                   help="instead of the grid: time hf_flash's forward and backward under "
                        "alternative launch configs (head_dim 128, causal, S=4K, 16K)")  # fmt: skip
    args = p.parse_args(argv)
    if args.rounds is None:
        args.rounds = PACKED_ROUNDS if args.packed else 1
    return args


def _cell(r: dict, name: str) -> str:
    x = r["tflops"].get(name)
    if x is not None:
        return f"{x:.0f}"
    return "n/a" if "unsupported" in r["results"].get(name, {}) else "err"


def print_summary(rows: list[dict], providers, checks) -> None:
    short = {"hf_flash": "hf", "hf_flash_triton": "hf-tri", "sdpa": "sdpa", "sdpa_flash": "fa2",
             "sdpa_cudnn": "cudnn", "flex": "flex"}  # fmt: skip
    table = []
    for r in rows:
        t = {"D": r["head_dim"], "mask": r["mask"], "S": r["seqlen"], "pass": r["pass"]}
        for name in providers:
            t[short[name]] = _cell(r, name)
        for peer in PEERS:
            if peer in providers and "hf_flash" in providers:
                x = r["ratio"].get(peer)
                t[f"/{short[peer]}"] = f"{x:.2f}" if x else "-"
        d = r["max_abs_diff_vs_sdpa"]
        t["diff"] = f"{d:.1e}" if d is not None else "-"
        if r["mask"] == "window":
            x = window_speedup(r, rows)
            t["w/c"] = f"{x:.2f}" if x else "-"
        table.append(t)
    cols = list(dict.fromkeys(c for t in table for c in t))
    print("\nTFLOP/s (bf16, Hq=32, Hkv=8, 16K tokens per batch); /x = hf_flash / x; "
          "diff = max|hf_flash - sdpa|; w/c = window speedup over hf_flash causal")  # fmt: skip
    print_table(table, cols)
    errors = {}
    for r in rows:
        for name, res in r["results"].items():
            if "error" in res:
                where = f"D{r['head_dim']}/{r['mask']}/{r['seqlen']}/{r['pass']}"
                errors.setdefault((name, res["error"]), []).append(where)
    for (name, err), where in errors.items():
        print(f"[{name}] {err}  ({len(where)} rows, e.g. {where[0]})")
    if checks:
        print()
        print("\n".join(summary_lines(checks)))


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/attention.py needs a CUDA GPU", file=sys.stderr)
        return 2
    timing = {"warmup_ms": args.warmup_ms, "rep_ms": args.rep_ms, "min_calls": args.min_calls}
    t0 = time.time()
    if args.packed:
        rows = run_packed(args, timing)
        path = write_results("attention_packed", rows, args.out, timing=timing, rounds=args.rounds,
                             flex_compile=args.flex_compile, docs=PACKED_DOCS, tokens=TOKENS,
                             flops="fwd = 4*Hq*D*sum(L_i^2)/2; fwd+bwd = 3.5x fwd")  # fmt: skip
        print_packed(rows)
        print(f"wrote {path} in {time.time() - t0:.0f}s")
        return 0
    if args.sweep_configs:
        rows = sweep_configs(args, timing)
        path = write_results("attention_configs", rows, args.out, timing=timing,
                             head_dims=args.head_dims or [128], mask="causal",
                             tokens_per_batch=TOKENS)  # fmt: skip
        print(f"wrote {path} in {time.time() - t0:.0f}s")
        return 0

    meta = {
        "nheads_q": NHEADS_Q, "nheads_kv": NHEADS_KV, "dtype": "bfloat16",
        "tokens_per_batch": TOKENS, "window": WINDOW, "timing": timing,
        "flex_compile": args.flex_compile, "quick": args.quick,
        "flops": "fwd = 4*B*Hq*D*pairs (S^2 full, S^2/2 causal, exact for window); "
                 "bwd = 2.5x fwd; fwd+bwd = 3.5x fwd",
        "fwd_timing": "torch.no_grad forward", "rounds": args.rounds,
    }  # fmt: skip
    build = builders(args.flex_compile)
    rows: list[dict] = []
    path = None
    for head_dim, mask, seqlen in grid(args):
        t = time.time()
        rows += run_shape(head_dim, mask, seqlen, args, build, timing)
        # rewrite after every shape: a run stopped by a timeout keeps what it measured
        path = write_results("attention", rows, args.out, **meta)
        print(f"D={head_dim} {mask:6s} S={seqlen:5d}: {time.time() - t:5.1f}s "
              f"(total {time.time() - t0:.0f}s)", flush=True)  # fmt: skip
    print_summary(rows, args.providers, bar_checks(rows))
    print(f"wrote {path} in {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Fused rotary kernel: GB/s against transformers' rotary, and the training step it sits in.

Run on a GPU from the repository root::

    PYTHONPATH=. python benchmarks/rope.py --out OUTDIR [--quick] [--skip-train] [--sweep] [--compiled-peer]

Part 1, kernel (bf16, q with 32 heads and k with 8 heads, head_dim 128, batch 1, T tokens):

  hf_flash      ``hf_flash.apply_rotary_pos_emb`` (one launch rotates q and k)
  transformers  ``transformers.models.llama.modeling_llama.apply_rotary_pos_emb`` (eager)
  transformers_compiled  the same under ``torch.compile(dynamic=True)`` (``--compiled-peer``)
  copy          ``dst.copy_(src)`` of a tensor as large as q and k together: the bandwidth
                ceiling measured in the same process

q/k are the transposed views of (1, T, H, 128) projection outputs, exactly as Llama's attention
passes them; cos/sin are (1, T, 128) bf16 from ``LlamaRotaryEmbedding``. Bytes moved (every
provider credited the same): read q, k, cos, sin and write q, k, i.e.
``2 * T * (32 + 8) * 128 * 2 + 2 * T * 128 * 2``. fwd is timed under ``no_grad``; bwd is
``torch.autograd.grad`` of retained outputs (the conjugate rotation of dq, dk; same bytes).
Bar (issue 5): at T = 32K, hf_flash >= 3x transformers and >= 80% of the copy bandwidth.

Part 2, training step of the 1.2B Llama shape of docs/design.md (hidden 2048, 16 layers, 32/8 heads,
vocab 128256, random init, bf16), LoRA r=16 on q/k/v/o/gate/up/down, gradient checkpointing,
batch 1 at 32K tokens, ``--attn`` attention (default sdpa): forward + backward + AdamW step,
tokens/s with and without ``hf_flash.integration.rope_patch.patch_model`` on the same model.
"""

from __future__ import annotations

import gc
import time

import torch

from benchmarks.harness import base_parser, bench_ms, print_table, write_results
from hf_flash.checkpointing import enable_activation_checkpointing

HQ, HKV, HEAD_DIM = 32, 8, 128
TOKENS = (4096, 8192, 16384, 32768, 65536)
QUICK_TOKENS = (4096, 32768)
BAR_TOKENS = 32768


def _rotary_inputs(tokens: int, device="cuda", dtype=torch.bfloat16):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=HQ * HEAD_DIM, num_attention_heads=HQ, num_key_value_heads=HKV,
                      max_position_embeddings=max(TOKENS))  # fmt: skip
    rot = LlamaRotaryEmbedding(cfg).to(device)
    q = torch.randn(1, tokens, HQ, HEAD_DIM, device=device, dtype=dtype).transpose(1, 2)
    k = torch.randn(1, tokens, HKV, HEAD_DIM, device=device, dtype=dtype).transpose(1, 2)
    cos, sin = rot(q, torch.arange(tokens, device=device)[None])
    return q, k, cos, sin


def _bytes(tokens: int, elem: int = 2) -> int:
    qk = tokens * (HQ + HKV) * HEAD_DIM * elem
    cs = tokens * HEAD_DIM * elem
    return 2 * qk + 2 * cs


def kernel_rows(tokens_list, device="cuda", compiled_peer=False):
    from hf_flash.rotary import apply_rotary_pos_emb as fused
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as eager

    providers = {"hf_flash": fused, "transformers": eager}
    if compiled_peer:
        # one dynamic-shape graph serves every T (Inductor fuses rotate_half into one kernel)
        providers["transformers_compiled"] = torch.compile(eager, dynamic=True)
    rows = []
    for tokens in tokens_list:
        q, k, cos, sin = _rotary_inputs(tokens, device)
        nbytes = _bytes(tokens)
        src = torch.empty(tokens * (HQ + HKV) * HEAD_DIM, device=device, dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        copy = bench_ms(lambda: dst.copy_(src))
        copy_gbps = 2 * src.numel() * 2 / copy["ms"] / 1e6
        ref = eager(q, k, cos, sin)
        out = fused(q, k, cos, sin)
        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(out, ref))
        for pass_ in ("fwd", "bwd"):
            times = {}
            for name, fn in providers.items():
                if pass_ == "fwd":
                    with torch.no_grad():
                        t = bench_ms(lambda: fn(q, k, cos, sin))
                else:
                    qg, kg = q.detach().requires_grad_(), k.detach().requires_grad_()
                    qo, ko = fn(qg, kg, cos, sin)
                    gq, gk = torch.randn_like(qo), torch.randn_like(ko)
                    t = bench_ms(lambda: torch.autograd.grad((qo, ko), (qg, kg), (gq, gk), retain_graph=True))
                times[name] = t
            for name, t in times.items():
                gbps = nbytes / t["ms"] / 1e6
                rows.append({
                    "bench": "kernel", "tokens": tokens, "pass": pass_, "provider": name, **t,
                    "gbps": gbps, "copy_gbps": copy_gbps, "frac_copy": gbps / copy_gbps,
                    "speedup_vs_transformers": times["transformers"]["ms"] / t["ms"],
                    "max_abs_diff_vs_transformers": diff,
                })  # fmt: skip
        del q, k, cos, sin, src, dst
        torch.cuda.empty_cache()
    return rows


def sweep_rows(tokens: int = BAR_TOKENS, device="cuda"):
    """Forward GB/s of the fused kernel for a few tile sizes and warp counts (tuning aid)."""
    from hf_flash.kernels import rotary as kernel
    from hf_flash.rotary import apply_rotary_pos_emb as fused

    q, k, cos, sin = _rotary_inputs(tokens, device)
    saved = kernel._TILE_ELEMS, kernel._NUM_WARPS
    rows = []
    try:
        for tile in (1024, 2048, 4096):
            for warps in (2, 4, 8):
                kernel._TILE_ELEMS, kernel._NUM_WARPS = tile, warps
                with torch.no_grad():
                    t = bench_ms(lambda: fused(q, k, cos, sin))
                rows.append({"bench": "sweep", "tokens": tokens, "pass": "fwd", "provider": "hf_flash",
                             "tile": tile, "num_warps": warps, **t, "gbps": _bytes(tokens) / t["ms"] / 1e6})  # fmt: skip
    finally:
        kernel._TILE_ELEMS, kernel._NUM_WARPS = saved
    return rows


def train_rows(seqlen: int, steps: int, attn: str, device="cuda"):
    import peft
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_flash.integration.rope_patch import patch_model, revert_model

    if attn == "hf_flash":
        import hf_flash

        hf_flash.register(fused_rope=False)  # the patch is what this benchmark switches
    cfg = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                      num_attention_heads=HQ, num_key_value_heads=HKV, vocab_size=128256,
                      max_position_embeddings=max(seqlen, 8192))  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16, attn_implementation=attn)
    enable_activation_checkpointing(model, {"use_reentrant": False})
    model.config.use_cache = False
    lora = peft.LoraConfig(r=16, lora_alpha=32, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])  # fmt: skip
    model = peft.get_peft_model(model, lora)
    model.enable_input_require_grads()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, cfg.vocab_size, (1, seqlen), device=device)

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    rows = []
    for fused in (False, True):
        if fused:
            assert patch_model(model), "fused RoPE patch did not apply to the Llama benchmark model"
        step()  # warm-up (Triton compilation, allocator)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3 / steps
        rows.append({
            "bench": "train_step", "tokens": seqlen, "provider": f"{attn}+{'fused' if fused else 'eager'}_rope",
            "ms": ms, "tok_s": seqlen / ms * 1e3, "steps": steps,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        })  # fmt: skip
    revert_model(model)
    del model, opt
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def main(argv=None):
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--skip-train", action="store_true", help="kernel rows only")
    parser.add_argument("--train-seqlen", type=int, default=32768)
    parser.add_argument("--train-steps", type=int, default=None, help="timed steps (3; 2 with --quick)")
    parser.add_argument("--attn", default="sdpa", help="attn_implementation of the training model")
    parser.add_argument("--sweep", action="store_true", help="also sweep kernel tile / num_warps")
    parser.add_argument("--compiled-peer", action="store_true",
                        help="add torch.compile(transformers' rotary) as a peer (compiles once)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/rope.py needs a CUDA GPU")
    rows = kernel_rows(QUICK_TOKENS if args.quick else TOKENS, compiled_peer=args.compiled_peer)
    print_table(rows, ["tokens", "pass", "provider", "ms", "gbps", "frac_copy", "speedup_vs_transformers"])
    verdicts = []
    for r in rows:
        if r["provider"] == "hf_flash" and r["tokens"] == BAR_TOKENS:
            ok = r["speedup_vs_transformers"] >= 3.0 and r["frac_copy"] >= 0.8
            verdicts.append(f"bar {r['pass']} @ {BAR_TOKENS}: {r['speedup_vs_transformers']:.2f}x "
                            f"transformers, {100 * r['frac_copy']:.0f}% of copy -> "
                            f"{'PASS' if ok else 'FAIL'}")  # fmt: skip
    if args.sweep:
        sweep = sweep_rows()
        print_table(sweep, ["tokens", "tile", "num_warps", "ms", "gbps"])
        rows += sweep
    if not args.skip_train:
        steps = args.train_steps or (2 if args.quick else 3)
        train = train_rows(args.train_seqlen, steps, args.attn)
        print_table(train, ["tokens", "provider", "ms", "tok_s", "peak_gib"])
        rows += train
    print("\n".join(verdicts))
    path = write_results("rope", rows, args.out, quick=args.quick, bar_tokens=BAR_TOKENS, verdicts=verdicts)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

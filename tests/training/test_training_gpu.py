"""Offload and the tiled MLP on a GPU: device memory actually drops, the copies run on the side
stream and overlap the layers' compute, and offload stays bitwise.

Shape: a Llama of 8 layers, hidden 1024, MLP 2816, 8 heads, vocab 1024, bf16, LoRA r=8, one row
of 8192 tokens, hf_flash attention: each layer input is 16 MiB, each MLP temporary 44 MiB. The
overlap test runs 32768 tokens (below).
"""

from __future__ import annotations

import json

import pytest
import torch
from memory_models import LORA_TARGETS, assert_bitwise, checkpointing

from hf_flash.training import offload_checkpoints, tile_mlp, untile_mlp, unoffload_checkpoints

pytestmark = pytest.mark.gpu

LAYERS, HIDDEN, INTER, SEQ, VOCAB = 8, 1024, 2816, 8192, 1024


def layer_bytes(seq):
    """Bytes of one bf16 layer input of ``seq`` tokens (the size of each offload copy)."""
    return seq * HIDDEN * 2


LAYER_BYTES = layer_bytes(SEQ)
# Copies can only run under compute when the GPU has work queued as the host issues them. At 8192
# tokens the profiled step is host-bound (kernels busy ~41 of ~200 ms on an H100, the GPU idle as
# each prefetch is issued), so whether a copy met a kernel depended on host timing and on how fast
# the backward kernel was. At 32768 tokens attention alone is 16x the device time per layer and
# the host runs ahead, which is the regime the overlap is for.
OVERLAP_SEQ = 32768


def _model(seq=SEQ):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    import hf_flash

    hf_flash.register()
    config = LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
        num_attention_heads=8, num_key_value_heads=8, vocab_size=VOCAB,
        max_position_embeddings=seq, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="hf_flash")
    model = get_peft_model(
        model,
        LoraConfig(r=8, lora_alpha=16, init_lora_weights=False, target_modules=LORA_TARGETS),
    )
    return model.to(device="cuda", dtype=torch.bfloat16).train()


def _inputs(seq=SEQ):
    ids = torch.randint(3, VOCAB, (1, seq), generator=torch.Generator().manual_seed(5)).cuda()
    return {"input_ids": ids, "labels": ids}


def _measured_step(model, inputs):
    """(memory held after the forward, peak of the step, (loss, LoRA grads)), in bytes above
    what was allocated before the step."""
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = model(**inputs).loss
    torch.cuda.synchronize()
    torch.empty(1, device="cuda")  # the allocator frees blocks whose side-stream use has ended
    after_forward = torch.cuda.memory_allocated() - base
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return after_forward, peak, (loss.detach(), grads)


def test_offload_frees_device_memory_and_is_bitwise():
    model = _model()
    inputs = _inputs()
    checkpointing(model)
    _measured_step(model, inputs)  # warm-up: kernels compiled, allocator primed
    fwd_plain, peak_plain, ref = _measured_step(model, inputs)
    stats = offload_checkpoints(model)
    _measured_step(model, inputs)
    fwd_off, peak_off, got = _measured_step(model, inputs)
    assert stats.last_step_tensors == LAYERS and stats.last_step_bytes == LAYERS * LAYER_BYTES
    # after the forward every layer input lives on the host only
    assert fwd_plain - fwd_off >= 0.9 * LAYERS * LAYER_BYTES, (fwd_plain, fwd_off)
    # in the backward at most two are back (the one recomputed and the one prefetched)
    assert peak_plain - peak_off >= (LAYERS - 3) * LAYER_BYTES, (peak_plain, peak_off)
    assert_bitwise(ref, got, "offload vs plain checkpointing on the GPU")
    unoffload_checkpoints(model)


def test_offload_copies_run_on_the_side_stream_and_overlap_compute(tmp_path):
    """From the profiler's trace: the layer-input copies (one each way per layer; 64 MiB at
    OVERLAP_SEQ tokens) run on a stream no kernel runs on, and most of them overlap a kernel (copy
    and compute at once)."""
    from torch.profiler import ProfilerActivity, profile

    model = _model(OVERLAP_SEQ)
    inputs = _inputs(OVERLAP_SEQ)
    offload_checkpoints(model)
    _measured_step(model, inputs)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _measured_step(model, inputs)
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    copies = [
        e for e in events
        if e.get("cat") == "gpu_memcpy" and e.get("args", {}).get("bytes") == layer_bytes(OVERLAP_SEQ)
    ]  # fmt: skip
    to_host = [e for e in copies if "DtoH" in e["name"]]
    to_device = [e for e in copies if "HtoD" in e["name"]]
    assert len(to_host) == LAYERS and len(to_device) == LAYERS, [e["name"] for e in copies]
    kernel_streams = {e["args"].get("stream") for e in kernels}
    copy_streams = {e["args"].get("stream") for e in copies}
    assert len(copy_streams) == 1 and not copy_streams & kernel_streams, (copy_streams, kernel_streams)

    def overlaps(copy):
        start, end = copy["ts"], copy["ts"] + copy["dur"]
        return any(k["ts"] < end and start < k["ts"] + k["dur"] for k in kernels)

    # every copy back but the first (nothing runs before it) is a prefetch under compute
    timeline = _copy_timeline(events, kernels, to_device + to_host)
    assert sum(map(overlaps, to_device)) >= LAYERS // 2, timeline
    assert sum(map(overlaps, to_host)) >= LAYERS // 2, timeline


def copy_rows(kernels, copies):
    """Per copy of a profiler trace, in start order: its name, start (from the first kernel or
    copy) and length, the kernels running under it and the kernel-free time before and after it
    (microseconds). benchmarks/diagnostics/offload_overlap.py reads the same rows."""
    t0 = min(e["ts"] for e in kernels + copies)
    rows = []
    for c in sorted(copies, key=lambda e: e["ts"]):
        start, end = c["ts"], c["ts"] + c["dur"]
        before = max((k["ts"] + k["dur"] for k in kernels if k["ts"] + k["dur"] <= start), default=t0)
        after = min((k["ts"] for k in kernels if k["ts"] >= end), default=end)
        rows.append({
            "name": c["name"], "start_us": start - t0, "dur_us": c["dur"], "stream": c["args"].get("stream"),
            "kernels_under": sum(k["ts"] < end and start < k["ts"] + k["dur"] for k in kernels),
            "idle_before_us": start - before, "idle_after_us": after - end,
        })  # fmt: skip
    return rows


def _copy_timeline(events, kernels, copies):
    """For a failure message: per copy, its start and length, the kernels running under it, and
    the long CUDA runtime calls (the host blocked) and kernel-free gaps around it."""
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver") and e.get("dur", 0) > 50]
    t0 = min(e["ts"] for e in kernels + copies)
    lines = []
    for r in copy_rows(kernels, copies):
        start, end = r["start_us"] + t0, r["start_us"] + t0 + r["dur_us"]
        calls = [f"{e['name']} {e['dur']:.0f}us@{e['ts'] - t0:.0f}" for e in runtime
                 if e["ts"] < end + 200 and start - 2000 < e["ts"] + e["dur"]]  # fmt: skip
        lines.append(
            f"{r['name'][:12]} at {r['start_us']:.0f}us for {r['dur_us']:.0f}us: {r['kernels_under']} kernels "
            f"under it, idle {r['idle_before_us']:.0f}us before / {r['idle_after_us']:.0f}us after; long runtime "
            f"calls: {calls[:6]}"
        )
    return "\n".join(lines)


def test_tiled_mlp_lowers_the_peak():
    model = _model()
    inputs = _inputs()
    checkpointing(model)
    _measured_step(model, inputs)
    _, peak_plain, (loss_plain, _) = _measured_step(model, inputs)
    tile_mlp(model, 1024)
    _measured_step(model, inputs)
    _, peak_tiled, (loss_tiled, _) = _measured_step(model, inputs)
    inter_bytes = SEQ * INTER * 2
    # the MLP's recomputation and backward held several 44 MiB temporaries; now 1/8 of each
    assert peak_plain - peak_tiled >= 2 * inter_bytes, (peak_plain, peak_tiled)
    torch.testing.assert_close(loss_tiled, loss_plain, rtol=2e-2, atol=0)
    untile_mlp(model)


def test_liger_within_the_error_rule_and_lowers_the_peak():
    """Liger-Kernel's RMSNorm and SwiGLU (hf_flash.training.fused_ops) on the GPU: the bf16 loss
    and LoRA gradients with them are as close to a float64 run of the same model as the bf16 run
    without them (the error rule); and the checkpointed step's peak drops by at least the two
    norms' float32 copies of one layer (2 x 32 MiB at 8192 tokens x 1024)."""
    pytest.importorskip("liger_kernel")
    from memory_models import assert_within_rule, batch, step, tiny_lora_model

    from hf_flash.training import unuse_liger, use_liger

    inputs = batch(device="cuda")
    exact = step(tiny_lora_model("eager", torch.float64, device="cuda"), inputs)
    model = tiny_lora_model("hf_flash", torch.bfloat16, device="cuda")
    lowp = step(model, inputs)
    assert use_liger(model) == {"rms_norm": 5, "swiglu": 2}
    got = step(model, inputs)
    assert_within_rule(exact, lowp, got, torch.bfloat16, "Liger RMSNorm + SwiGLU")
    unuse_liger(model)

    model = _model()
    inputs = _inputs()
    checkpointing(model)
    _measured_step(model, inputs)
    _, peak_plain, _ = _measured_step(model, inputs)
    use_liger(model)
    _measured_step(model, inputs)
    _, peak_liger, _ = _measured_step(model, inputs)
    assert peak_plain - peak_liger >= 2 * SEQ * HIDDEN * 4, (peak_plain, peak_liger)

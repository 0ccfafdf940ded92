"""Recipe building blocks that need no model: packing, labels, batches, loss, config, schedule."""

import math
from pathlib import Path

import pytest
import torch

from hf_flash.recipes.config import ConfigError, RecipeConfig, load_config
from hf_flash.recipes.data import (
    IGNORE_INDEX, PackedBatches, cu_seqlens_from_positions, labels_for, pack_documents,
    synthetic_documents,
)
from hf_flash.training.loss import (
    chunked_linear_cross_entropy, default_chunk_tokens, full_linear_cross_entropy, loss_name, resolve_impl,
)
from hf_flash.recipes.model import checkpointing_kwargs, lr_lambda, predict_memory_gib


def _docs(lengths, start=1000):
    docs, t = [], start
    for n in lengths:
        docs.append(list(range(t, t + n)))
        t += n
    return docs


def test_pack_restarts_positions_per_document_and_row():
    rows = pack_documents(_docs([5, 3, 9, 2]), seq_len=6)  # 19 tokens -> 3 rows, 1 dropped
    assert rows.num_rows == 3 and rows.dropped_tokens == 1
    # a document cut by a row boundary restarts at 0 in the next row
    assert rows.position_ids.tolist() == [[0, 1, 2, 3, 4, 0], [0, 1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 0]]
    assert rows.input_ids.flatten().tolist() == list(range(1000, 1018))


def test_labels_never_cross_a_segment_start():
    ids = torch.tensor([[10, 11, 12, 20, 21, 30]])
    pos = torch.tensor([[0, 1, 2, 0, 1, 0]])
    assert labels_for(ids, pos).tolist() == [[11, 12, IGNORE_INDEX, 21, IGNORE_INDEX, IGNORE_INDEX]]
    cu, max_len = cu_seqlens_from_positions(pos[0])
    assert cu.tolist() == [0, 3, 5, 6] and cu.dtype == torch.int32 and max_len == 3


def test_batches_are_deterministic_disjoint_across_ranks_and_flattened():
    rows = pack_documents(_docs([7] * 40), seq_len=8)  # 35 rows
    per_rank = [PackedBatches(rows, 2, r, 2, seed=3, flash_kwargs=True) for r in range(2)]
    assert per_rank[0].per_epoch == 35 // 4
    seen = []
    for k in range(per_rank[0].per_epoch):
        for b in per_rank:
            batch = b.get(k, "cpu")
            assert batch["input_ids"].shape == (1, 16)
            assert batch["cu_seq_lens_q"][-1] == 16
            seen.append(tuple(batch["input_ids"][0, :8].tolist()))
    assert len(set(seen)) == len(seen)  # no row used twice within an epoch
    again = PackedBatches(rows, 2, 1, 2, seed=3, flash_kwargs=False)
    assert torch.equal(again.get(5, "cpu")["input_ids"], per_rank[1].get(5, "cpu")["input_ids"])
    # a new epoch reshuffles
    e0 = per_rank[0].get(0, "cpu")["input_ids"]
    e1 = per_rank[0].get(per_rank[0].per_epoch, "cpu")["input_ids"]
    assert not torch.equal(e0, e1)


def test_too_little_data_is_a_config_error():
    rows = pack_documents(_docs([7] * 3), seq_len=8)
    with pytest.raises(ConfigError, match="fewer than"):
        PackedBatches(rows, 2, 0, 2, seed=0, flash_kwargs=False)


def test_synthetic_documents_hold_their_pass_key():
    docs = synthetic_documents(4, seed=1, min_chars=200, max_chars=400)
    for d in docs:
        key = d.rsplit("The pass key is ", 1)[1].rstrip(".")
        assert d.count(key) == 3 and 200 <= len(d) <= 520


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("chunk", [1, 7, 64, None], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("head_grad", [False, True], ids=["frozen_head", "trainable_head"])
def test_chunked_cross_entropy_matches_full(chunk, head_grad, impl, device):
    """float64 throughout: the kernel then computes in float64 too (triton), as the torch ops do."""
    torch.manual_seed(0)
    n, h, v = 50, 16, 37
    hidden = torch.randn(n, h, dtype=torch.float64, device=device, requires_grad=True)
    weight = torch.randn(v, h, dtype=torch.float64, device=device, requires_grad=head_grad)
    labels = torch.randint(0, v, (n,), device=device)
    labels[::5] = IGNORE_INDEX
    got = chunked_linear_cross_entropy(hidden, weight, labels, chunk, impl=impl)
    (got * 0.37).backward()
    gh = hidden.grad.clone()
    gw = weight.grad.clone() if head_grad else None
    hidden.grad = None
    if head_grad:
        weight.grad = None
    ref = full_linear_cross_entropy(hidden, weight, labels)
    (ref * 0.37).backward()
    torch.testing.assert_close(got, ref.to(got.dtype))
    torch.testing.assert_close(gh, hidden.grad)
    if head_grad:
        torch.testing.assert_close(gw, weight.grad)


def _loss_and_grads(fn, hidden, weight, labels):
    hidden = hidden.detach().clone().requires_grad_()
    weight = weight.detach().clone().requires_grad_()
    loss = fn(hidden, weight, labels)
    (loss * 0.5).backward()
    return loss.detach(), hidden.grad, weight.grad


def _assert_within(what, got, truth, peer, factor):
    """hf_flash.reference's error rule with a rounding floor: max error vs the float64 truth
    <= factor x the peer's + the error of storing the truth in got's dtype."""
    err = (got.double() - truth).abs().max().item()
    peer_err = (peer.double() - truth).abs().max().item()
    floor = (truth.to(got.dtype).double() - truth).abs().max().item()
    assert err <= factor * peer_err + floor, (
        f"{what}: max error {err:.3g} > {factor} x peer's {peer_err:.3g} + floor {floor:.3g}; "
        f"mean errors {(got.double() - truth).abs().mean().item():.3g} vs "
        f"{(peer.double() - truth).abs().mean().item():.3g}"
    )


@pytest.mark.parametrize("vocab", [37, 1000, 5003])
def test_chunked_kernel_in_fp32_matches_float64_truth(vocab, device):
    """The triton path in fp32 (loss, dh, dW of a trainable head) against the full loss in
    float64, within 2x / 3x the error of the full loss computed in fp32."""
    torch.manual_seed(vocab)
    n, h = 45, 32
    hidden = torch.randn(n, h, device=device)
    weight = torch.randn(vocab, h, device=device) * 0.3
    labels = torch.randint(0, vocab, (n,), device=device)
    labels[::6] = IGNORE_INDEX
    truth = _loss_and_grads(full_linear_cross_entropy, hidden.double(), weight.double(), labels)
    fp32 = _loss_and_grads(full_linear_cross_entropy, hidden, weight, labels)
    got = _loss_and_grads(lambda a, b, y: chunked_linear_cross_entropy(a, b, y, 16, impl="triton"),
                          hidden, weight, labels)  # fmt: skip
    for what, g, t, p, factor in zip(("loss", "dh", "dW"), got, truth, fp32, (2, 3, 3)):
        assert g.dtype == torch.float32
        _assert_within(what, g, t, p, factor)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_chunked_kernel_is_no_less_accurate_than_the_torch_path(dtype, device):
    """Half-precision weights: both paths take the matmul's low-precision logits and store the
    gradient in that dtype; the kernel's errors stay within 2x / 3x of the torch path's."""
    if dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("Triton's interpreter converts float32 to bfloat16 by truncation (GPUs round)")
    torch.manual_seed(2)
    n, h, v = 40, 64, 1000
    hidden = torch.randn(n, h, device=device).to(dtype)
    weight = (torch.randn(v, h, device=device) * 0.3).to(dtype)
    labels = torch.randint(0, v, (n,), device=device)
    labels[::5] = IGNORE_INDEX
    truth = _loss_and_grads(full_linear_cross_entropy, hidden.double(), weight.double(), labels)
    runs = [_loss_and_grads(lambda a, b, y: chunked_linear_cross_entropy(a, b, y, 16, impl=impl),
                            hidden, weight, labels) for impl in ("triton", "torch")]  # fmt: skip
    for what, g, p, t, factor in zip(("loss", "dh", "dW"), *runs, truth, (2, 3, 3)):
        _assert_within(what, g, t, p, factor)


def test_default_chunk_follows_the_bytes_per_logit():
    assert default_chunk_tokens(128256) == 2048  # bf16 logits, the triton path: 512 MiB
    assert default_chunk_tokens(128256, 4) == 1024  # fp32 copy (torch path) or fp32 weights
    assert default_chunk_tokens(32000) == 8384
    assert default_chunk_tokens(10**8) == 64


def test_elementwise_impl_is_explicit(device, monkeypatch):
    """auto = the kernel wherever it runs; the torch path only where it cannot, and an explicit
    "triton" there raises; which one ran is visible (one kernel launch per chunk)."""
    from hf_flash.kernels import cross_entropy

    assert resolve_impl("auto", device) == "triton"  # CUDA, or CPU under the interpreter
    assert resolve_impl("torch", device) == "torch" and resolve_impl("auto", "meta") == "torch"
    with pytest.raises(ValueError, match="impl='triton': the cross-entropy kernel cannot run on meta"):
        resolve_impl("triton", "meta")
    with pytest.raises(ValueError, match="impl='fast'"):
        resolve_impl("fast", device)
    assert loss_name("chunked", device) == "chunked (triton)" and loss_name("full", device) == "full"

    calls = []
    real = cross_entropy.cross_entropy_rows
    monkeypatch.setattr(cross_entropy, "cross_entropy_rows", lambda *a, **k: calls.append(1) or real(*a, **k))
    hidden = torch.randn(10, 8, device=device, requires_grad=True)
    weight = torch.randn(11, 8, device=device)
    labels = torch.randint(0, 11, (10,), device=device)
    chunked_linear_cross_entropy(hidden, weight, labels, 4).backward()
    assert len(calls) == 3
    chunked_linear_cross_entropy(hidden, weight, labels, 4, impl="torch").backward()
    assert len(calls) == 3
    # a device the kernel cannot run on: auto takes the torch path, "triton" refuses
    monkeypatch.setattr(cross_entropy, "runs_on", lambda d: False)
    assert resolve_impl("auto", device) == "torch" and loss_name("chunked", device) == "chunked (torch)"
    chunked_linear_cross_entropy(hidden, weight, labels, 4).backward()
    assert len(calls) == 3
    with pytest.raises(ValueError, match="impl='triton'"):
        chunked_linear_cross_entropy(hidden, weight, labels, 4, impl="triton")


def test_liger_loss_matches_chunked():
    """loss_impl='liger' (Liger-Kernel's fused linear cross-entropy, installed with the test
    extra) computes the same sum and hidden-state gradient as the chunked loss, in fp32; its
    Triton kernels run through the interpreter here."""
    pytest.importorskip("liger_kernel", reason="liger-kernel is part of the test extra")
    from hf_flash.training.loss import liger_linear_cross_entropy

    torch.manual_seed(1)
    n, h, v = 40, 16, 37
    hidden = torch.randn(n, h, requires_grad=True)
    weight = torch.randn(v, h)
    labels = torch.randint(0, v, (n,))
    labels[::7] = IGNORE_INDEX
    got = liger_linear_cross_entropy()(hidden, weight, labels)
    (got * 0.5).backward()
    g_liger = hidden.grad.clone()
    hidden.grad = None
    ref = chunked_linear_cross_entropy(hidden, weight, labels, 8)
    (ref * 0.5).backward()
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(g_liger, hidden.grad)


def test_chunked_cross_entropy_all_ignored_is_zero():
    hidden = torch.randn(4, 8, requires_grad=True)
    weight = torch.randn(11, 8)
    loss = chunked_linear_cross_entropy(hidden, weight, torch.full((4,), IGNORE_INDEX), 2)
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(hidden.grad) == 0


def test_config_yaml_then_command_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("seq_len: 1024\nlearning_rate: 1e-4\nlora_target_modules: [q_proj, v_proj]\n")
    cfg = load_config(["--config", str(path), "--seq_len", "2048", "--resume", "--lora_dropout", "0.05"])
    assert cfg.seq_len == 2048 and cfg.learning_rate == 1e-4 and cfg.resume is True
    assert cfg.lora_target_modules == ["q_proj", "v_proj"] and cfg.lora_dropout == 0.05
    assert RecipeConfig().attn_implementation == "hf_flash"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--seq_lenn", "10"], "unrecognized arguments"),
        (["--rope_method", "magic"], "rope_method='magic'"),
        (["--max_steps", "0"], "max_steps=0 must be >= 1"),
        (["--max_steps", "5", "--profile_step", "6"], "profile_step=6 is beyond max_steps=5"),
        (["--model", "/nonexistent/model"], "does not exist"),
        (["--data", "/nonexistent/data.jsonl"], "data path /nonexistent/data.jsonl does not exist"),
        (["--learning_rate", "fast"], "learning_rate='fast' is not a valid float"),
        (["--attn_implementation", "sdpa", "--keep_attention_outputs", "true"],
         "keep_attention_outputs: true keeps hf_flash's attention op, but attn_implementation='sdpa'"),
        (["--gradient_checkpointing", "false", "--keep_attention_outputs", "true"],
         "keep_attention_outputs: true only applies with gradient_checkpointing: true"),
    ],
    ids=["typo", "rope", "steps", "profile", "model", "data", "type", "keep_sdpa", "keep_no_checkpointing"],
)
def test_bad_options(args, message, capsys):
    with pytest.raises((ConfigError, SystemExit)) as err:
        load_config(args)
    text = str(err.value) if err.type is ConfigError else capsys.readouterr().err
    assert message in text


def test_unknown_key_in_yaml_names_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("seq_len: 64\nlora_rank: 8\n")
    with pytest.raises(ConfigError, match=r"unknown option\(s\) in .*bad.yaml: lora_rank"):
        load_config(["--config", str(path)])


def test_warmup_then_cosine_to_floor():
    cfg = RecipeConfig(max_steps=110, warmup_steps=10, min_lr_ratio=0.1)
    f = lr_lambda(cfg)
    assert f(0) < f(5) < f(9) < 1.0
    assert math.isclose(f(10), 1.0) and math.isclose(f(110), 0.1)
    assert all(f(s) >= f(s + 1) for s in range(10, 110))


@pytest.mark.parametrize(
    "name", sorted(p.name for p in (Path(__file__).resolve().parents[2] / "recipes" / "configs").glob("*.yaml")
                   if not p.name.startswith("accelerate_"))
)
def test_shipped_configs_validate(name):
    path = Path(__file__).resolve().parents[2] / "recipes" / "configs" / name
    cfg = load_config(["--config", str(path)])
    assert cfg.attn_implementation == "hf_flash"
    if name != "tiny.yaml":
        k = int(name.split("-")[1].rstrip("k.yaml"))
        assert cfg.seq_len == k * 1024 and cfg.gradient_checkpointing and cfg.loss_impl == "chunked"


@pytest.mark.parametrize("name", ["accelerate_ddp.yaml", "accelerate_fsdp.yaml"])
def test_accelerate_configs_load(name):
    import yaml

    cfg = yaml.safe_load((Path(__file__).resolve().parents[2] / "recipes" / "configs" / name).read_text())
    assert cfg["distributed_type"] == ("FSDP" if "fsdp" in name else "MULTI_GPU")
    if "fsdp" in name:
        assert cfg["fsdp_config"]["fsdp_version"] == 2
        assert cfg["fsdp_config"]["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"


@pytest.mark.parametrize(
    "options, keeps",
    [
        ({}, True),
        ({"attn_implementation": "sdpa"}, False),
        ({"gradient_checkpointing": False}, False),
        ({"keep_attention_outputs": False}, False),
        ({"keep_attention_outputs": True}, True),
    ],
    ids=["default", "sdpa", "no_checkpointing", "off", "on"],
)
def test_keep_attention_outputs_default(options, keeps):
    import hf_flash

    cfg = RecipeConfig.from_dict(options)
    cfg.validate()
    assert cfg.keeps_attention_outputs() is keeps
    expected = {"use_reentrant": False}
    if keeps:
        expected["context_fn"] = hf_flash.attention_checkpoint_context
    assert checkpointing_kwargs(cfg) == expected


class _Shape(torch.nn.Module):
    """predict_memory_gib reads only the config and the parameter counts."""

    def __init__(self, **config):
        super().__init__()
        from types import SimpleNamespace

        self.config = SimpleNamespace(**config)
        self.weight = torch.nn.Parameter(torch.zeros(1000), requires_grad=False)


def test_predicted_memory_counts_kept_attention_outputs():
    model = _Shape(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                   num_attention_heads=32, head_dim=64, vocab_size=128256)  # fmt: skip
    cfg = RecipeConfig(seq_len=32768, micro_batch_size=2)
    keep = predict_memory_gib(model, cfg, 1, False)
    cfg.keep_attention_outputs = False
    plain = predict_memory_gib(model, cfg, 1, False)
    # 16 layers x 65536 tokens x 32 heads x (64 bf16 outputs + one fp32 log-sum-exp), with the
    # memory model's allocator slack (the recipe uses hf_flash.training's model)
    from hf_flash.training.plan import SLACK

    kept = 16 * 65536 * 32 * (64 * 2 + 4) * SLACK / 2**30
    assert math.isclose(keep - plain, kept, rel_tol=1e-9), (keep, plain, kept)
    cfg.gradient_checkpointing, cfg.keep_attention_outputs = False, None
    no_ckpt = predict_memory_gib(model, cfg, 1, False)
    cfg.keep_attention_outputs = True  # invalid (validate() refuses it); never counted twice
    assert predict_memory_gib(model, cfg, 1, False) == no_ckpt


def test_study_corpus_keeps_every_pass_key_prompt_whole():
    """The study's pretraining rows: exactly l0 tokens, and every pass-key segment is a whole
    evaluation prompt (BOS ... question) followed by its own key and EOS."""
    from hf_flash.eval import build_passkey_prompt
    from hf_flash.recipes.data import ByteTokenizer
    from hf_flash.recipes.long_context_study import pretraining_rows

    tok = ByteTokenizer()
    rows = pretraining_rows(tok, 512, 40, seed=3, drill_share=0.0)
    assert rows.input_ids.shape == (40, 512) and rows.position_ids.shape == (40, 512)
    intro = tok.decode(build_passkey_prompt(tok, 300, 0.5, "12345")[0])[:40]
    question = "What is the pass key? The pass key is "
    n_prompts = n_prompt_rows = 0
    for ids, pos in zip(rows.input_ids.tolist(), rows.position_ids.tolist()):
        starts = [i for i, p in enumerate(pos) if p == 0] + [len(pos)]
        segments = [ids[a:b] for a, b in zip(starts, starts[1:])]
        if not tok.decode(ids).startswith(intro):
            continue  # a row of long documents, packed the ordinary way
        n_prompt_rows += 1
        for seg in segments:
            text = tok.decode(seg)
            assert seg[0] == tok.bos_token_id and seg[-1] == tok.eos_token_id, text[:80]
            key = text[text.index("The pass key is ") + 16:][:5]
            assert text.startswith(intro) and key.isdigit() and text.endswith(question + key)
            n_prompts += 1
    assert n_prompt_rows >= 30 and n_prompts > 1.5 * n_prompt_rows  # most rows hold several prompts

    drills = pretraining_rows(tok, 512, 40, seed=3, drill_share=0.5)
    assert drills.input_ids.shape == (40, 512)
    # 20 rows of drills: several keys, each asked for right after it is given
    n_drill_rows = sum(tok.decode(ids).count("Remember it") >= 3 for ids in drills.input_ids.tolist())
    assert n_drill_rows >= 20


@pytest.mark.parametrize("name, kind", [
    ("_flash_fwd_kernel", "attention forward (hf_flash)"),
    ("_bwd_dkdv_kernel", "attention backward (hf_flash)"),
    ("_attn_fwd_kernel", "attention forward (hf_flash)"),
    ("_document_schedule_kernel", "attention forward (hf_flash)"),
    # every launch of the backward, the Gluon dQ kernel and the small ones around the kernels too
    ("_attn_bwd_dkdv_kernel", "attention backward (hf_flash)"),
    ("_attn_bwd_split_d_kernel", "attention backward (hf_flash)"),
    ("_attn_dq_kernel", "attention backward (hf_flash)"),
    ("_bwd_dq_kernel", "attention backward (hf_flash)"),
    ("_bwd_preprocess", "attention backward (hf_flash)"),
    ("_bwd_bounds_pre_pass", "attention backward (hf_flash)"),
    ("_dq_frag_to_bshd", "attention backward (hf_flash)"),
    ("_tail_sum", "attention backward (hf_flash)"),
    ("triton_tem_fused_flex_attention_backward_zeros_1", "attention (other)"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3", "attention (other)"),
    ("nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNT", "GEMM"),
    ("void at::native::elementwise_kernel<128, 2, at::native::direct_copy_kernel_cuda>", "copy / cast / fill"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>",
     "elementwise"),
    ("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer"),
])
def test_profile_kinds(name, kind):
    from hf_flash.recipes.profiling import kind_of

    assert kind_of(name) == kind


def test_every_attention_kernel_launch_is_classified_as_attention():
    """Each kernel the attention modules launch (through a CachedLauncher or ``kernel[grid]``)
    counts as attention in a step's profile (e2e_train's attention_share), so a new kernel cannot
    drop out of it unnoticed."""
    import re
    from pathlib import Path

    import hf_flash
    from hf_flash.recipes.profiling import kind_of

    root = Path(hf_flash.__file__).parent / "kernels"
    names = set()
    for f in (root / "flash_fwd.py", root / "flash_bwd.py", *sorted((root / "hopper").glob("attention_*.py"))):
        text = f.read_text()
        names |= set(re.findall(r"CachedLauncher\((\w+)\)", text)) | set(re.findall(r"\b(_[a-z]\w*)\[\(", text))
    assert {"_attn_fwd_kernel", "_attn_dq_kernel", "_bwd_dq_kernel", "_dq_frag_to_bshd"} <= names
    for name in names:
        assert kind_of(name).startswith("attention"), name


def test_attention_share_counts_every_attention_kind():
    """The e2e_train rows' attention share: hf_flash's forward and backward and other providers'
    attention kernels count, GEMMs and the rest do not; host events are ignored."""
    from types import SimpleNamespace

    import torch

    from hf_flash.recipes.profiling import attention_share

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [SimpleNamespace(name=n, device_type=t, device_time_total=us) for n, t, us in [
        ("_attn_fwd_kernel", cuda, 300.0),
        ("_bwd_dkdv_kernel", cuda, 500.0),
        ("triton_tem_fused_flex_attention_0", cuda, 200.0),
        ("nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNT", cuda, 1000.0),
        ("aten::mm", cpu, 5000.0),
    ]]  # fmt: skip
    prof = SimpleNamespace(events=lambda: events)
    got = attention_share(prof)
    assert got["device_ms"] == pytest.approx(2.0)
    assert got["attention_ms"] == pytest.approx(1.0)
    assert got["attention_share"] == pytest.approx(0.5)

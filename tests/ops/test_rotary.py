"""Fused rotary kernel: flash-attn API against the oracle, transformers drop-in against
transformers' own ``apply_rotary_pos_emb`` and rotary modules, forward and backward.

Tolerances follow hf_flash.reference's error rule: the kernel's error against the float32 truth
must stay within 2x (3x for gradients) the error of the same formula evaluated in the inputs'
dtype, plus a floor of one float32 rounding of the largest magnitude involved.
"""

import math

import pytest
import torch

from hf_flash.reference import max_abs_err, rotary_ref
from hf_flash.rotary import apply_rotary_emb, apply_rotary_pos_emb, rotary_table

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

hf_apply = modeling_llama.apply_rotary_pos_emb

DTYPES = [torch.float32, torch.float16]
IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _rotary_lowp(x, cos, sin, interleaved=False):
    """The flash-attn formula evaluated entirely in x's dtype (the error budget)."""
    rd = 2 * cos.shape[-1]
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    cos = cos.to(x.dtype).unsqueeze(2)
    sin = sin.to(x.dtype).unsqueeze(2)
    xr, rest = x[..., :rd], x[..., rd:]
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., : rd // 2], xr[..., rd // 2 :]
        rot = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return torch.cat((rot, rest), dim=-1)


def _floor(*ts):
    return 4 * torch.finfo(torch.float32).eps * max(t.abs().max().item() for t in ts)


def _check(name, out, truth, lowp, factor=2.0):
    err = max_abs_err(out, truth)
    budget = max_abs_err(lowp, truth)
    bound = factor * budget + _floor(truth)
    assert err <= bound, (
        f"{name}: kernel max err {err:.3g} (mean {(out.float() - truth.float()).abs().mean():.3g}) "
        f"> {factor} x low-precision err {budget:.3g} + floor"
    )


def _table(seqlen_ro, rotary_dim, device, base=10000.0):
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    return rotary_table(inv_freq, seqlen_ro, device=device)


# --------------------------------------------------------------------------------------------
# flash-attn style API
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize(
    "batch,seqlen,nheads,headdim,rotary_dim",
    [(2, 97, 3, 64, 64), (1, 1, 2, 80, 80), (2, 13, 1, 96, 32), (1, 9, 2, 59, 58)],
    ids=["s97-d64", "s1-d80", "partial-d96-r32", "odd-d59-r58"],
)
def test_apply_rotary_emb_matches_oracle(device, dtype, interleaved, batch, seqlen, nheads, headdim, rotary_dim):
    torch.manual_seed(0)
    x = torch.randn(batch, seqlen, nheads, headdim, device=device, dtype=dtype, requires_grad=True)
    cos, sin = _table(seqlen + 5, rotary_dim, device)
    cos, sin = cos[:seqlen], sin[:seqlen]
    out = apply_rotary_emb(x, cos, sin, interleaved=interleaved)
    truth = rotary_ref(x.detach().float(), cos, sin, interleaved=interleaved)
    _check("out", out, truth, _rotary_lowp(x.detach(), cos, sin, interleaved))
    assert out.dtype == dtype and out.shape == x.shape

    g = torch.randn_like(out)
    (dx,) = torch.autograd.grad(out, x, g)
    xf = x.detach().float().requires_grad_()
    (dx_truth,) = torch.autograd.grad(rotary_ref(xf, cos, sin, interleaved=interleaved), xf, g.float())
    xl = x.detach().clone().requires_grad_()
    (dx_lowp,) = torch.autograd.grad(_rotary_lowp(xl, cos, sin, interleaved), xl, g)
    _check("dx", dx, dx_truth, dx_lowp, factor=3.0)


def test_apply_rotary_emb_seqlen_offsets_and_inplace(device):
    torch.manual_seed(1)
    b, s, h, d = 3, 5, 2, 32
    cos, sin = _table(40, d, device)
    x = torch.randn(b, s, h, d, device=device)
    offsets = torch.tensor([0, 7, 30], device=device, dtype=torch.int32)
    out = apply_rotary_emb(x, cos, sin, seqlen_offsets=offsets)
    for i, o in enumerate(offsets.tolist()):
        ref = rotary_ref(x[i : i + 1], cos[o : o + s], sin[o : o + s])
        assert max_abs_err(out[i : i + 1], ref) <= _floor(ref)
    out_int = apply_rotary_emb(x, cos, sin, seqlen_offsets=4)
    ref = rotary_ref(x, cos[4 : 4 + s], sin[4 : 4 + s])
    assert max_abs_err(out_int, ref) <= _floor(ref)

    # in place, through autograd: x is modified, the gradient is the conjugate rotation
    leaf = torch.randn(b, s, h, d, device=device, requires_grad=True)
    y = leaf * 1.0
    ptr = y.data_ptr()
    z = apply_rotary_emb(y, cos, sin, inplace=True, seqlen_offsets=offsets)
    assert z.data_ptr() == ptr
    assert max_abs_err(z, apply_rotary_emb(leaf.detach(), cos, sin, seqlen_offsets=offsets)) == 0
    g = torch.randn_like(z)
    (dl,) = torch.autograd.grad(z, leaf, g)
    lf = leaf.detach().requires_grad_()
    (dref,) = torch.autograd.grad(apply_rotary_emb(lf, cos, sin, seqlen_offsets=offsets), lf, g)
    assert max_abs_err(dl, dref) <= _floor(dref)


def test_apply_rotary_emb_varlen_and_position_ids(device):
    torch.manual_seed(2)
    h, d = 2, 16
    lens = [3, 1, 6]
    cu = torch.tensor([0, 3, 4, 10], device=device, dtype=torch.int32)
    x = torch.randn(sum(lens), h, d, device=device)
    cos, sin = _table(12, d, device)
    out = apply_rotary_emb(x, cos, sin, cu_seqlens=cu, max_seqlen=max(lens))
    # packed restarts: each sequence starts again at position 0
    pos = torch.cat([torch.arange(n) for n in lens]).to(device)
    ref = rotary_ref(x[None], cos[pos][None], sin[pos][None])[0]
    assert max_abs_err(out, ref) <= _floor(ref)
    out_pos = apply_rotary_emb(x, cos, sin, cu_seqlens=cu, position_ids=pos)
    assert max_abs_err(out_pos, ref) <= _floor(ref)
    # per-sequence offsets added to in-sequence positions
    offs = torch.tensor([2, 0, 5], device=device)
    out_off = apply_rotary_emb(x, cos, sin, seqlen_offsets=offs, cu_seqlens=cu, max_seqlen=6)
    pos2 = pos + torch.repeat_interleave(offs, torch.tensor(lens, device=device))
    ref2 = rotary_ref(x[None], cos[pos2][None], sin[pos2][None])[0]
    assert max_abs_err(out_off, ref2) <= _floor(ref2)
    # dense batch with explicit, non-monotone positions
    xb = torch.randn(2, 4, h, d, device=device)
    pid = torch.tensor([[5, 1, 0, 11], [0, 1, 2, 0]], device=device)
    outb = apply_rotary_emb(xb, cos, sin, position_ids=pid)
    refb = rotary_ref(xb, cos[pid], sin[pid])
    assert max_abs_err(outb, refb) <= _floor(refb)


def test_head_blocks_split_for_wide_tokens(device, monkeypatch):
    """Tiny tiles force several head blocks and token blocks per tensor (the path taken on GPU
    when heads * rotary_dim / 2 exceeds the tile); k has fewer heads, so some of its head
    blocks are empty."""
    from hf_flash.kernels import rotary as rotary_kernel

    monkeypatch.setattr(rotary_kernel, "_TILE_ELEMS", 32)
    torch.manual_seed(9)
    q = torch.randn(2, 5, 7, 24, device=device).transpose(1, 2)
    k = torch.randn(2, 5, 2, 24, device=device).transpose(1, 2)
    cos = torch.randn(2, 5, 16, device=device)
    sin = torch.randn(2, 5, 16, device=device)
    qo, ko = apply_rotary_pos_emb(q, k, cos, sin)
    qr, kr = hf_apply(q[..., :16], k[..., :16], cos, sin)
    assert max_abs_err(qo[..., :16], qr) <= _floor(qr) and max_abs_err(ko[..., :16], kr) <= _floor(kr)
    assert torch.equal(qo[..., 16:], q[..., 16:]) and torch.equal(ko[..., 16:], k[..., 16:])
    x = torch.randn(3, 4, 5, 32, device=device)
    c, s_ = _table(4, 32, device)
    out = apply_rotary_emb(x, c, s_, interleaved=True)
    ref = rotary_ref(x, c, s_, interleaved=True)
    assert max_abs_err(out, ref) <= _floor(ref)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_kernel_writes_every_element(device, interleaved):
    """NaN-poisoned outputs: every element (rotated pairs and the copied tail) must be written."""
    from hf_flash.kernels import rotary as rotary_kernel

    torch.manual_seed(10)
    q = torch.randn(3, 11, 5, 40, device=device, dtype=torch.float16)
    k = torch.randn(3, 11, 1, 40, device=device, dtype=torch.float16)
    cos, sin = _table(11, 24, device)
    outs = [torch.full_like(q, float("nan")), torch.full_like(k, float("nan"))]
    rotary_kernel.rotary_forward([q, k], outs, cos[None], sin[None], rotary_dim=24, cos_half_offset=0,
                                 interleaved=interleaved)  # fmt: skip
    for x, out in zip((q, k), outs):
        truth = rotary_ref(x.float(), cos, sin, interleaved=interleaved)
        assert not torch.isnan(out).any()
        _check("poisoned", out, truth, _rotary_lowp(x, cos, sin, interleaved))


def test_long_positions_beyond_128k(device):
    """Angles at positions >= 128K: the float32 table is the truth, the kernel only rotates."""
    torch.manual_seed(3)
    d = 64
    start = 131_072 + 1000
    cos, sin = _table(start + 16, d, device, base=500000.0)
    x = torch.randn(1, 16, 2, d, device=device, dtype=torch.float16)
    out = apply_rotary_emb(x, cos, sin, seqlen_offsets=start)
    truth = rotary_ref(x.float(), cos[start:], sin[start:])
    _check("long", out, truth, _rotary_lowp(x, cos[start:], sin[start:]))
    # the same through transformers' rotary module and the drop-in
    cfg = LlamaConfig(hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=262144, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})  # fmt: skip
    rot = modeling_llama.LlamaRotaryEmbedding(cfg).to(device)
    ids = torch.arange(start, start + 16, device=device)[None]
    q = torch.randn(1, 2, 16, d, device=device)
    k = torch.randn(1, 1, 16, d, device=device)
    c, s = rot(q, ids)
    qo, ko = apply_rotary_pos_emb(q, k, c, s)
    qr, kr = hf_apply(q, k, c, s)
    assert max_abs_err(qo, qr) <= _floor(qr) and max_abs_err(ko, kr) <= _floor(kr)


def test_position_out_of_table_is_an_error(device):
    cos, sin = _table(8, 16, device)
    x = torch.randn(1, 6, 1, 16, device=device)
    with pytest.raises(ValueError, match="cos/sin rows"):
        apply_rotary_emb(x, cos, sin, seqlen_offsets=3)
    with pytest.raises(ValueError, match="position_ids span"):
        apply_rotary_emb(x, cos, sin, position_ids=torch.full((1, 6), 8, device=device))
    with pytest.raises(ValueError, match="rotary_dim"):
        apply_rotary_emb(x[..., :8], cos, sin)
    with pytest.raises(TypeError, match="float16, bfloat16, float32"):
        apply_rotary_emb(x.double(), cos, sin)
    with pytest.raises(ValueError, match="max_seqlen"):
        apply_rotary_emb(x[0], cos, sin, cu_seqlens=torch.tensor([0, 6], dtype=torch.int32))
    with pytest.raises(ValueError, match="require grad"):
        apply_rotary_emb(x, cos.requires_grad_(), sin)


# --------------------------------------------------------------------------------------------
# transformers drop-in
# --------------------------------------------------------------------------------------------


def _hf_rotary(rope_parameters, head_dim, max_pos=64, device="cpu"):
    cfg = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=head_dim, max_position_embeddings=max_pos, rope_parameters=rope_parameters)  # fmt: skip
    return modeling_llama.LlamaRotaryEmbedding(cfg).to(device)


ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
}  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("rope", list(ROPES))
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("shape", [(2, 4, 2, 33, 64), (1, 8, 1, 1, 96)], ids=["gqa-s33-d64", "mqa-s1-d96"])
def test_drop_in_matches_transformers(device, dtype, rope, layout, shape):
    torch.manual_seed(4)
    b, hq, hk, s, d = shape
    rot = _hf_rotary(ROPES[rope], d, device=device)
    # packed rows restart at 0: positions are arbitrary per token
    pos = torch.cat([torch.arange(s - s // 2), torch.arange(s // 2)]).to(device)[None].expand(b, -1)
    # projection output (b, s, h, d), transposed view as Llama's attention passes it
    qf = torch.randn(b, s, hq, d, device=device, dtype=dtype)
    kf = torch.randn(b, s, hk, d, device=device, dtype=dtype)
    q = (qf.transpose(1, 2) if layout == "bhsd" else qf).requires_grad_()
    k = (kf.transpose(1, 2) if layout == "bhsd" else kf).requires_grad_()
    ud = 1 if layout == "bhsd" else 2
    cos, sin = rot(q, pos)
    if rope == "yarn":
        assert rot.attention_scaling > 1.0  # kept: it is inside cos and sin
    qo, ko = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=ud)
    assert qo.shape == q.shape and ko.shape == k.shape and qo.stride() == q.stride()

    c32, s32 = cos.float(), sin.float()
    q32 = q.detach().float().requires_grad_()
    k32 = k.detach().float().requires_grad_()
    qt, kt = hf_apply(q32, k32, c32, s32, unsqueeze_dim=ud)
    ql = q.detach().clone().requires_grad_()
    kl = k.detach().clone().requires_grad_()
    qlow, klow = hf_apply(ql, kl, cos, sin, unsqueeze_dim=ud)
    _check("q", qo, qt, qlow)
    _check("k", ko, kt, klow)

    gq, gk = torch.randn_like(qo), torch.randn_like(ko)
    dq, dk = torch.autograd.grad((qo, ko), (q, k), (gq, gk))
    dqt, dkt = torch.autograd.grad((qt, kt), (q32, k32), (gq.float(), gk.float()))
    dql, dkl = torch.autograd.grad((qlow, klow), (ql, kl), (gq, gk))
    _check("dq", dq, dqt, dql, factor=3.0)
    _check("dk", dk, dkt, dkl, factor=3.0)


def test_drop_in_unequal_cos_halves_and_partial(device):
    """Arbitrary cos/sin (halves differ): still exactly transformers' formula, and its gradient."""
    torch.manual_seed(5)
    q = torch.randn(2, 3, 5, 16, device=device, requires_grad=True)
    k = torch.randn(2, 1, 5, 16, device=device, requires_grad=True)
    cos = torch.randn(2, 5, 16, device=device)
    sin = torch.randn(2, 5, 16, device=device)
    qo, ko = apply_rotary_pos_emb(q, k, cos, sin)
    qr, kr = hf_apply(q, k, cos, sin)
    assert max_abs_err(qo, qr) <= _floor(qr) and max_abs_err(ko, kr) <= _floor(kr)
    g = torch.randn_like(qo)
    (a,) = torch.autograd.grad((qo * g).sum() + ko.sum(), q)
    (r,) = torch.autograd.grad((qr * g).sum() + kr.sum(), q)
    assert max_abs_err(a, r) <= _floor(r)
    # partial rotary: the first 8 features rotate (rotate-half within them), the rest pass
    c8, s8 = cos[..., :4].repeat(1, 1, 2), sin[..., :4].repeat(1, 1, 2)
    qo, ko = apply_rotary_pos_emb(q, k, c8, s8)
    qr, _ = hf_apply(q[..., :8], k[..., :8], c8, s8)
    assert max_abs_err(qo[..., :8], qr) <= _floor(qr)
    assert torch.equal(qo[..., 8:], q[..., 8:])


def test_drop_in_errors(device):
    q = torch.randn(1, 2, 4, 8, device=device)
    k = torch.randn(1, 2, 4, 8, device=device)
    cos = torch.randn(1, 4, 8, device=device)
    with pytest.raises(ValueError, match="unsqueeze_dim"):
        apply_rotary_pos_emb(q, k, cos, cos, unsqueeze_dim=0)
    with pytest.raises(ValueError, match="do not broadcast"):
        apply_rotary_pos_emb(q, k, cos[:, :3], cos[:, :3])
    with pytest.raises(ValueError, match="rotary_dim"):
        apply_rotary_pos_emb(q, k, torch.randn(1, 4, 7), torch.randn(1, 4, 7))
    with pytest.raises(ValueError, match="4-D"):
        apply_rotary_pos_emb(q[0], k, cos, cos)


def test_compile_fullgraph_and_opcheck(device):
    """Fake implementations let torch.compile trace forward and backward without a graph break."""
    torch.manual_seed(6)
    q = torch.randn(1, 2, 5, 16, device=device, requires_grad=True)
    k = torch.randn(1, 1, 5, 16, device=device, requires_grad=True)
    cos, sin = torch.randn(1, 5, 16, device=device), torch.randn(1, 5, 16, device=device)

    def f(q, k, cos, sin):
        qo, ko = apply_rotary_pos_emb(q, k, cos, sin)
        return (qo * 2).sum() + ko.sum()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    loss = compiled(q, k, cos, sin)
    dq, dk = torch.autograd.grad(loss, (q, k))
    loss_e = f(q, k, cos, sin)
    dqe, dke = torch.autograd.grad(loss_e, (q, k))
    assert torch.allclose(loss, loss_e) and torch.equal(dq, dqe) and torch.equal(dk, dke)

    from hf_flash import rotary as mod

    xs = [q.detach().transpose(1, 2).requires_grad_(), k.detach().transpose(1, 2).requires_grad_()]
    options = dict(rotary_dim=16, cos_half_offset=8, offset=0, interleaved=False, conjugate=False)
    torch.library.opcheck(mod._rotary_op, (xs, cos, sin, None, None), options,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("rope", ["default", "yarn"])
def test_drop_in_bf16_gpu(rope):
    torch.manual_seed(7)
    b, s, hq, hk, d = 2, 4097, 32, 8, 128
    rot = _hf_rotary(ROPES[rope], d, max_pos=8192, device="cuda")
    pos = torch.arange(s, device="cuda")[None].expand(b, -1)
    q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    k = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    cos, sin = rot(q, pos)
    qo, ko = apply_rotary_pos_emb(q, k, cos, sin)
    qt, kt = hf_apply(q.detach().float(), k.detach().float(), cos.float(), sin.float())
    ql, kl = hf_apply(q.detach(), k.detach(), cos, sin)
    _check("q", qo, qt, ql)
    _check("k", ko, kt, kl)
    g = torch.randn_like(qo)
    (dq,) = torch.autograd.grad(qo, q, g)
    q32 = q.detach().float().requires_grad_()
    (dqt,) = torch.autograd.grad(hf_apply(q32, k.detach().float(), cos.float(), sin.float())[0], q32, g.float())
    qlp = q.detach().clone().requires_grad_()
    (dql,) = torch.autograd.grad(hf_apply(qlp, k.detach(), cos, sin)[0], qlp, g)
    _check("dq", dq, dqt, dql, factor=3.0)


@pytest.mark.gpu
def test_apply_rotary_emb_bf16_interleaved_gpu():
    torch.manual_seed(8)
    x = torch.randn(2, 1025, 16, 128, device="cuda", dtype=torch.bfloat16)
    cos, sin = _table(2048, 128, "cuda")
    for il in (False, True):
        out = apply_rotary_emb(x, cos[:1025], sin[:1025], interleaved=il)
        truth = rotary_ref(x.float(), cos[:1025], sin[:1025], interleaved=il)
        _check(f"interleaved={il}", out, truth, _rotary_lowp(x, cos[:1025], sin[:1025], il))
    assert math.isfinite(out.float().abs().max().item())


@pytest.mark.gpu
def test_past_2_31_elements_gpu():
    """576K tokens x 32 heads x 128 (2.4 x 10^9 elements): the last tokens' rows start past element
    2^31, where 32-bit offsets would wrap; their rotation and its gradient (the inverse rotation)
    match the oracle on those rows with the error rule."""
    torch.manual_seed(3)
    s, h, d, m = 576 * 1024, 32, 128, 64
    x = torch.randn(1, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    assert x[:, -m:].storage_offset() > 2**31
    cos, sin = _table(s, d, "cuda")
    out = apply_rotary_emb(x, cos, sin)
    tail = x[:, -m:].detach()
    _check("out[-m:]", out[:, -m:], rotary_ref(tail.float(), cos[-m:], sin[-m:]), rotary_ref(tail, cos[-m:], sin[-m:]))
    g = torch.zeros_like(out)
    g[:, -m:] = torch.randn_like(g[:, -m:])
    (dx,) = torch.autograd.grad(out, x, g)
    gt = g[:, -m:]
    _check("dx[-m:]", dx[:, -m:], rotary_ref(gt.float(), cos[-m:], -sin[-m:]), rotary_ref(gt, cos[-m:], -sin[-m:]))
    assert (dx[:, :-m] == 0).all()

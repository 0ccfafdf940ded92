"""hf_flash.kernels.cross_entropy against a float64 oracle (CPU: Triton's interpreter).

Error rule (hf_flash.reference's, with a floor of its own): the kernel's max error against the
float64 truth is at most 2x (loss) or 3x (gradient) the error of PyTorch computing the same
thing in the input dtype, plus a floor: the error of merely storing the truth in the output's
dtype. Two floors are platform facts,
not tolerances: Triton 3.6's interpreter converts float32 to bfloat16 by truncation (its
``cast_impl`` passes no rounding mode; GPUs round to nearest), so there the bf16 floor is the
truncation error; and for float64 inputs the oracle is itself float64 (a few ulps).
"""

import math

import pytest
import torch
import torch.nn.functional as F

from hf_flash._runtime import interpreter_active
from hf_flash.kernels.cross_entropy import cross_entropy_rows, runs_on

IGNORE = -100


def _truth(x: torch.Tensor, y: torch.Tensor, scale: float = 1.0):
    """float64 (loss rows, gradient rows) of the logits as stored."""
    x = x.double()
    valid = y != IGNORE
    y0 = torch.where(valid, y, 0)
    lse = torch.logsumexp(x, dim=-1)
    loss = torch.where(valid, lse - x.gather(1, y0[:, None])[:, 0], 0.0)
    g = torch.softmax(x, dim=-1)
    g[torch.arange(len(y), device=x.device), y0] -= 1.0
    return loss, torch.where(valid[:, None], g * scale, 0.0)


def _torch_in_dtype(x: torch.Tensor, y: torch.Tensor, scale: float = 1.0):
    """The same computed by PyTorch in the logits' dtype: the error the rule is relative to."""
    valid = y != IGNORE
    loss = F.cross_entropy(x, y, ignore_index=IGNORE, reduction="none")
    g = torch.softmax(x, dim=-1)
    g[torch.arange(len(y), device=x.device), torch.where(valid, y, 0)] -= 1.0
    g = g * scale
    return loss, torch.where(valid[:, None], g, torch.zeros((), dtype=x.dtype))


def _stored(truth: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``truth`` as the kernel's final conversion stores it in ``dtype``."""
    if dtype == torch.bfloat16 and interpreter_active():
        bits = truth.float().view(torch.int32) & ~0xFFFF  # truncation, as the interpreter does
        return bits.view(torch.float32).double()
    return truth.to(dtype).double()


def _check(what, got, truth, torch_lowp, factor):
    err = (got.double() - truth).abs().max().item()
    ref_err = (torch_lowp.double() - truth).abs().max().item()
    floor = (_stored(truth, got.dtype) - truth).abs().max().item()
    if got.dtype == torch.float64:
        floor += 8 * torch.finfo(torch.float64).eps * max(1.0, truth.abs().max().item())
    assert not torch.isnan(got).any(), f"{what}: NaN"
    assert err <= factor * ref_err + floor, (
        f"{what}: kernel max error {err:.3g} > {factor} x torch's {ref_err:.3g} + floor {floor:.3g}; "
        f"kernel mean error {(got.double() - truth).abs().mean().item():.3g}, "
        f"torch mean error {(torch_lowp.double() - truth).abs().mean().item():.3g}"
    )


def _run_and_check(x, y, block_v=None, scale=1.0):
    truth_loss, truth_grad = _truth(x, y, scale)
    lowp_loss, lowp_grad = _torch_in_dtype(x, y, scale)
    g = x.clone()
    loss = cross_entropy_rows(g, y, grad_scale=scale, block_v=block_v)
    assert loss.dtype == (torch.float64 if x.dtype == torch.float64 else torch.float32)
    assert g.dtype == x.dtype
    _check("loss", loss, truth_loss, lowp_loss, 2)
    _check("gradient", g, truth_grad, lowp_grad, 3)
    ignored = y == IGNORE
    assert torch.all(loss[ignored] == 0) and torch.all(g[ignored] == 0)
    return loss, g


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def _labels(rows, vocab, gen):
    y = torch.randint(0, vocab, (rows,), generator=gen)
    y[::4] = IGNORE
    y[1] = vocab - 1  # the last column, in the last (partial) block
    y[2] = 0
    return y


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[1])
@pytest.mark.parametrize("vocab, block_v", [(1, None), (37, None), (37, 16), (1000, None), (1000, 128),
                                            (5003, None), (5003, 512)], ids=lambda v: str(v))  # fmt: skip
def test_rows_match_float64(vocab, block_v, dtype, device):
    gen = torch.Generator().manual_seed(vocab)
    x = (torch.randn(9, vocab, generator=gen) * 4).to(device, dtype)
    y = _labels(9, vocab, gen).to(device)
    _run_and_check(x, y, block_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=lambda d: str(d).split(".")[1])
def test_extreme_logits_are_stable(dtype, device):
    """Rows a naive exp would overflow (+1e4) or underflow (-1e4), both at once, -inf entries."""
    vocab = 300
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(6, vocab, generator=gen, dtype=torch.float64)
    x = torch.stack([
        1e4 + base[0],                                  # every logit huge
        -1e4 + base[1],                                 # every logit tiny
        torch.where(base[2] > 0, 1e4, -1e4) + base[3],  # both: softmax ~ onehot of the maxima
        base[4].masked_fill(base[5] > 1.0, -math.inf),  # masked vocabulary entries
        1e4 + base[5],
        -1e4 + base[0],
    ]).to(device, dtype)  # fmt: skip
    targets = [3, 7, int(torch.argmin(x[2].float())), int(torch.argmax(x[3].float())), IGNORE, 299]
    y = torch.tensor(targets, device=device)
    loss, g = _run_and_check(x, y, block_v=64)
    assert torch.isfinite(loss).all() and torch.isfinite(g.float()).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).split(".")[1])
def test_all_ignored_rows_give_zeros(dtype, device):
    x = torch.randn(5, 77, device=device).to(dtype)
    loss = cross_entropy_rows(x, torch.full((5,), IGNORE, device=device), block_v=32)
    assert torch.equal(loss, torch.zeros(5, device=device)) and torch.equal(x, torch.zeros_like(x))


def test_loss_is_written_to_every_row(monkeypatch, device):
    """The loss buffer comes from torch.empty; poisoned with NaN, every row must be overwritten."""
    torch.manual_seed(0)
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(math.nan))
    x = torch.randn(7, 50, device=device)
    y = torch.tensor([1, IGNORE, 3, 49, IGNORE, 0, 5], device=device)
    loss = cross_entropy_rows(x.clone(), y, block_v=16)
    assert not torch.isnan(loss).any()
    torch.testing.assert_close(loss, _truth(x, y)[0].float())


def test_strided_rows_leave_the_rest_untouched(device):
    """A row stride larger than V (a column slice of a wider buffer): only [:, :V] is written."""
    torch.manual_seed(1)
    buf = torch.randn(6, 64, device=device)
    before = buf.clone()
    x = buf[:, 3:40]  # V = 37, row stride 64
    y = torch.tensor([0, 36, IGNORE, 5, 17, 2], device=device)
    truth_loss, truth_grad = _truth(x, y)
    loss = cross_entropy_rows(x, y, block_v=16)
    torch.testing.assert_close(loss, truth_loss.float())
    torch.testing.assert_close(x, truth_grad.float())
    assert torch.equal(buf[:, :3], before[:, :3]) and torch.equal(buf[:, 40:], before[:, 40:])


def test_loss_only_leaves_logits_untouched_and_grad_scale_scales(device):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(8, 129, generator=gen).to(device)
    y = _labels(8, 129, gen).to(device)
    kept = x.clone()
    loss = cross_entropy_rows(x, y, write_grad=False, block_v=32)
    assert torch.equal(x, kept)
    torch.testing.assert_close(loss, _truth(x, y)[0].float())
    _run_and_check(x, y, block_v=32, scale=0.25)


def test_label_out_of_range_gives_nan_row(device):
    x = torch.randn(3, 20, device=device)
    loss = cross_entropy_rows(x, torch.tensor([20, 4, -3], device=device), block_v=16)
    assert torch.isnan(loss[0]) and torch.isnan(loss[2]) and torch.isfinite(loss[1])
    assert torch.isnan(x[0]).all() and torch.isnan(x[2]).all() and torch.isfinite(x[1]).all()


def test_no_rows_is_no_launch(device):
    loss = cross_entropy_rows(torch.empty(0, 10, device=device), torch.empty(0, dtype=torch.int64, device=device))
    assert loss.shape == (0,)


def _bad(name):
    x = torch.randn(4, 10)
    y = torch.tensor([1, 2, 3, IGNORE])
    cases = {
        "not_tensor": (x.tolist(), y, TypeError, "must be torch.Tensors"),
        "1d_logits": (x[0], y[:1], ValueError, "must be \\(rows, V\\)"),
        "int_logits": (x.long(), y, TypeError, "logits.dtype is torch.int64"),
        "labels_shape": (x, y[:3], ValueError, "want labels \\(4,\\)"),
        "labels_int32": (x, y.int(), TypeError, "pass int64 labels"),
        "column_stride": (torch.randn(10, 4).t(), y, ValueError, "unit stride on V"),
        "overlapping_rows": (torch.randn(1, 10).expand(4, 10), y, ValueError, "rows overlap"),
        "empty_vocab": (torch.randn(4, 0), y, ValueError, "V = 0"),
        "meta_device": (x.to("meta"), y.to("meta"), ValueError, "cannot run on meta"),
        "device_mismatch": (x.to("meta"), y, ValueError, "labels are on cpu, logits on meta"),
    }
    return cases[name]


@pytest.mark.parametrize("name", ["not_tensor", "1d_logits", "int_logits", "labels_shape", "labels_int32",
                                  "column_stride", "overlapping_rows", "empty_vocab", "meta_device",
                                  "device_mismatch"])  # fmt: skip
def test_bad_input_raises_before_launch(name):
    x, y, exc, message = _bad(name)
    kept = x.clone() if isinstance(x, torch.Tensor) and x.device.type == "cpu" else None
    with pytest.raises(exc, match=message):
        cross_entropy_rows(x, y)
    if kept is not None:
        assert torch.equal(x, kept)


def test_bad_block_raises():
    with pytest.raises(ValueError, match="block_v=24 must be a power of two"):
        cross_entropy_rows(torch.randn(2, 30), torch.tensor([1, 2]), block_v=24)


def test_runs_on(device):
    assert runs_on(torch.device(device))  # CUDA, or CPU under the interpreter
    assert not runs_on(torch.device("meta"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[1])
@pytest.mark.parametrize("vocab", [32000, 128256])
def test_lm_head_shapes_on_gpu(vocab, dtype, device):
    """Llama-2/Mistral and Llama-3 vocabularies with the GPU launch shape (blocks of 4096),
    where bf16 is stored rounded to nearest: the error rule without the interpreter's floor."""
    gen = torch.Generator().manual_seed(vocab)
    x = (torch.randn(64, vocab, generator=gen) * 3).to(device, dtype)
    y = _labels(64, vocab, gen).to(device)
    _run_and_check(x, y)


@pytest.mark.gpu
def test_extremes_and_ignored_rows_on_gpu(device):
    """The CPU tests' stability and all-ignored cases, in the suite that runs on the GPU."""
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        test_extreme_logits_are_stable(dtype, device)
        test_all_ignored_rows_give_zeros(dtype, device)
    test_strided_rows_leave_the_rest_untouched(device)
    test_label_out_of_range_gives_nan_row(device)

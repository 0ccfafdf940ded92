"""Cross-entropy rows and their logit gradients in one launch, written over the logits in place.

Given a chunk of logits ``x: [rows, V]`` (the LM head's matmul output, float16 / bfloat16 /
float32 / float64) and labels ``y: [rows]`` (int64, ``ignore_index`` skips a row), one program
per row computes::

    lse     = log(sum_j exp(x_j))                        (pass 1: online max / sum-exp)
    loss    = lse - x_y                                  (0 on ignored rows)
    x_j    <- grad_scale * (exp(x_j - m) / s - [j == y]) (pass 2: softmax - onehot, in place;
                                                          zeros on ignored rows)

Pass 1 walks the row in blocks of ``BLOCK_V`` with a running maximum ``m`` and a running sum
``s`` of ``exp(x - m)``: a block with maximum ``b`` updates ``m' = max(m, b)``, ``s' = s *
exp(m - m') + sum(exp(x - m'))``, so nothing overflows whatever the logits' range and each
logit costs one exponential; ``lse = m + log(s)``. ``x_y`` is one extra scalar load. Pass 2
reads the row again and stores the gradient in the logits' own dtype. It forms the softmax as
``exp(x - m) * (1 / s)``, as ``torch.softmax`` does, not as ``exp(x - lse)``, whose error grows
with ``|lse|`` (``lse`` carries a rounding error of ``|lse| x eps`` into every probability).
All arithmetic is float32 in registers (float64 for float64 logits), the precision
``torch.nn.functional.cross_entropy`` uses on logits upcast to float32; the gradient is rounded
to the logits' dtype once, at the store.

Memory traffic per logit, for 16-bit logits: 2 bytes read in pass 1, 2 read and 2 written in
pass 2, **6 bytes** in all (12 for float32), and no float32 ``[rows, V]`` buffer. The torch
sequence this replaces (upcast copy, logsumexp, gather, ``sub_``, ``exp_``, one-hot subtract,
mask ``mul_``, downcast copy) moves about 23 bytes per logit and holds a float32 copy. The kernel
is memory bound: at an H100's ~3 TB/s, 16K tokens x 128K vocabulary (2.1e9 logits, 12.6 GB)
takes ~4.2 ms of pure traffic. In the recipe's chunked loss on an H100 (16K tokens x 128K
vocabulary, hidden 2048, forward and backward with the LM-head matmuls) the whole loss measured
28.8 ms against 31.1 ms for Liger-Kernel's fused linear cross-entropy and 73.0 ms for the torch op
sequence. Ignored rows are not read: their gradient row is written as zeros.

A label outside ``[0, V)`` that is not ``ignore_index`` makes its row's loss and gradient NaN
(an error that shows, without a host sync to check the labels).

Rows are independent programs (``rows`` programs, each streaming its row twice); row ``i``
starts at ``logits + i * stride_row`` (any row stride; unit column stride). Offsets are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import configs


@triton.jit
def _cross_entropy_rows_kernel(
    logits_ptr, stride_lr, labels_ptr, stride_y, loss_ptr,
    V, ignore_index, grad_scale,
    BLOCK_V: tl.constexpr, WRITE_GRAD: tl.constexpr,
):  # fmt: skip
    # the loss buffer's dtype is the arithmetic dtype: float32, or float64 for float64 logits
    ACC = loss_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_lr
    y = tl.load(labels_ptr + row * stride_y).to(tl.int64)
    cols = tl.arange(0, BLOCK_V).to(tl.int64)  # [BLOCK_V]

    if y == ignore_index:
        tl.store(loss_ptr + row, tl.zeros([], ACC))
        if WRITE_GRAD:
            zero = tl.zeros([BLOCK_V], tl.float32).to(logits_ptr.dtype.element_ty)
            for start in range(0, V, BLOCK_V):
                tl.store(row_ptr + start + cols, zero, mask=start + cols < V)
    else:
        # pass 1: running max m and sum s of exp(x - m) over the row
        m = tl.full([], float("-inf"), ACC)
        s = tl.zeros([], ACC)
        for start in range(0, V, BLOCK_V):
            ok = start + cols < V
            x = tl.load(row_ptr + start + cols, mask=ok, other=float("-inf")).to(ACC)
            m_new = tl.maximum(m, tl.max(x, 0))
            # a row of -inf so far: shift by 0, not by -inf (exp(-inf - -inf) would be NaN)
            shift = tl.where(m_new == float("-inf"), 0.0, m_new).to(ACC)
            s = s * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), 0)
            m = m_new
        lse = m + tl.log(s)
        shift = tl.where(m == float("-inf"), 0.0, m).to(ACC)
        inv_s = 1.0 / s

        y_ok = (y >= 0) & (y < V)
        x_y = tl.load(row_ptr + tl.where(y_ok, y, 0)).to(ACC)
        loss = tl.where(y_ok, lse - x_y, float("nan"))
        tl.store(loss_ptr + row, loss)

        if WRITE_GRAD:
            # pass 2: softmax - onehot, over the logits just read
            for start in range(0, V, BLOCK_V):
                ok = start + cols < V
                x = tl.load(row_ptr + start + cols, mask=ok, other=float("-inf")).to(ACC)
                # exp(x - m) / s, not exp(x - lse): x - m is exact near the maximum, where
                # x - lse would carry lse's rounding error (|lse| x eps) into every probability
                p = tl.exp(x - shift) * inv_s
                g = tl.where(start + cols == y, p - 1.0, p) * grad_scale
                g = tl.where(y_ok, g, float("nan"))
                tl.store(row_ptr + start + cols, g.to(logits_ptr.dtype.element_ty), mask=ok)


# the loss kernel also takes float64 logits (the attention kernels' table is _checks.DTYPES)
_LOGIT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# Launch shape. The kernel streams each row with no reuse, so a block only has to be wide
# enough for full 16-byte loads in every thread with several in flight: 4096 logits over 8
# warps are 16 per thread (two 16-byte loads of bf16). Chosen from that arithmetic, not from a
# sweep; at 2048 rows per chunk 8-warp programs fill
# an H100 (132 SMs x 8 programs) in two waves.
_BLOCK_V = 4096
_NUM_WARPS = 8
# The interpreter (CPU) runs programs one after another with numpy: cost follows the number of
# blocks, so it takes wider blocks where the row allows; tests pass ``block_v`` to get many.
_INTERPRETER_BLOCK_V = 1024


def runs_on(device: torch.device) -> bool:
    """Whether the kernel can run on tensors of ``device``: CUDA (and ROCm) devices, and CPU
    tensors while the interpreter is on."""
    device = torch.device(device)
    return device.type == "cuda" or (device.type == "cpu" and configs.interpreting())


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 0 else 0


def cross_entropy_rows(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    grad_scale: float = 1.0,
    write_grad: bool = True,
    block_v: int | None = None,
) -> torch.Tensor:
    """Per-row cross-entropy; overwrites ``logits`` with its gradient (one launch).

    logits: (rows, V) float16 / bfloat16 / float32 / float64, unit stride on V, any row stride
        (rows must not overlap). Overwritten in place with ``grad_scale * (softmax - onehot)``
        in its own dtype (zeros on ignored rows) when ``write_grad``; left untouched otherwise.
    labels: (rows,) int64 on the same device; ``ignore_index`` skips a row. A label outside
        [0, V) that is not ``ignore_index`` gives that row NaN loss and gradient.
    ignore_index: label of rows without a target. Default -100 (PyTorch's).
    grad_scale: factor applied to the gradient before it is rounded to the logits' dtype
        (a float32 scalar in the kernel). Default 1.0.
    write_grad: False computes the loss only (one pass over the logits). Default True.
    block_v: logits per block (a power of two >= 16); default 4096 on a GPU, up to 1024 in the
        interpreter.

    Returns the loss rows ``lse - logits[y]``: (rows,) float32 (float64 for float64 logits),
    0 on ignored rows.
    """
    if not isinstance(logits, torch.Tensor) or not isinstance(labels, torch.Tensor):
        raise TypeError(
            f"logits and labels must be torch.Tensors, got {type(logits).__name__} and {type(labels).__name__}"
        )
    if logits.dim() != 2:
        raise ValueError(f"logits must be (rows, V), got shape {tuple(logits.shape)}")
    if logits.dtype not in _LOGIT_DTYPES:
        raise TypeError(f"logits.dtype is {logits.dtype}; the kernel takes float16, bfloat16, float32 or float64")
    rows, vocab = logits.shape
    if labels.shape != (rows,):
        raise ValueError(f"labels has shape {tuple(labels.shape)}, logits {tuple(logits.shape)}: want labels ({rows},)")
    if labels.dtype != torch.int64:
        raise TypeError(f"labels.dtype is {labels.dtype}; pass int64 labels (labels.long())")
    if labels.device != logits.device:
        raise ValueError(f"labels are on {labels.device}, logits on {logits.device}; move them to one device")
    if not runs_on(logits.device):
        raise ValueError(
            f"the cross-entropy kernel cannot run on {logits.device} tensors: it needs a CUDA device, "
            "or TRITON_INTERPRET=1 set before hf_flash.kernels.cross_entropy is imported for CPU tensors"
        )
    if vocab == 0:
        raise ValueError("logits has no columns (V = 0): the cross-entropy of an empty vocabulary is undefined")
    if vocab > 1 and logits.stride(1) != 1:
        raise ValueError(
            f"logits needs unit stride on V, got strides {logits.stride()}; pass logits.contiguous()"
        )
    if rows > 1 and logits.stride(0) < vocab:
        raise ValueError(
            f"logits rows overlap (row stride {logits.stride(0)} < V = {vocab}); the gradient is written in place"
        )
    if block_v is not None and (block_v < 16 or block_v & (block_v - 1)):
        raise ValueError(f"block_v={block_v} must be a power of two >= 16")
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    loss = torch.empty(rows, dtype=acc, device=logits.device)
    if rows == 0:
        return loss

    if block_v is None:
        block_v = _INTERPRETER_BLOCK_V if configs.interpreting() else _BLOCK_V
        block_v = min(block_v, max(16, _next_power_of_2(vocab)))
    num_warps = max(1, min(_NUM_WARPS, block_v // 512))
    launch = _cross_entropy_rows_kernel[(rows,)]
    args = (logits, logits.stride(0), labels, labels.stride(0), loss, vocab, int(ignore_index), float(grad_scale))
    # Triton launches on the current CUDA device; a model split over GPUs may be elsewhere
    if logits.is_cuda and logits.device.index != torch.cuda.current_device():
        with torch.cuda.device(logits.device):
            launch(*args, BLOCK_V=block_v, WRITE_GRAD=bool(write_grad), num_warps=num_warps)
    else:
        launch(*args, BLOCK_V=block_v, WRITE_GRAD=bool(write_grad), num_warps=num_warps)
    return loss

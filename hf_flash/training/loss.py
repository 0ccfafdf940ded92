"""Linear + cross-entropy without the full logits.

At 128K tokens and a 128K vocabulary the logits alone would take 64 GiB in fp32. The chunked
loss walks the tokens in chunks: for each chunk it computes the logits ``h @ W^T`` (in the
weight's dtype), the loss, and at once the gradient of the loss with respect to the chunk's
logits, ``softmax - onehot``, which it immediately contracts into ``dL/dh = g @ W`` (and
``dL/dW += g^T h`` when the head is trainable). Only one chunk of logits exists at any time and
nothing of them is kept for backward: backward only rescales the stored gradients by the
incoming scalar. That costs one matmul fewer than checkpointing each chunk (which would
recompute the logits in backward).

The elementwise part (loss and ``softmax - onehot`` from the logits) has two implementations,
chosen by ``impl``; both do the softmax in fp32 (fp64 for fp64 weights) from the same logits in
the weight's dtype and store the gradient in the weight's dtype:

- ``"triton"``: hf_flash's kernel (:mod:`hf_flash.kernels.cross_entropy`), one launch per chunk
  that reads each logit twice and overwrites it with its gradient: ~6 bytes per bf16 logit, no
  fp32 copy of the chunk.
- ``"torch"``: the same maths as a sequence of PyTorch ops over an fp32 copy of the chunk
  (~23 bytes per logit). Kept for devices Triton cannot run on.
- ``"auto"`` (default): ``"triton"`` wherever the kernel runs — every CUDA tensor, and CPU tensors
  while Triton's interpreter is on (``TRITON_INTERPRET=1``, as the CPU tests set it) — and
  ``"torch"`` only elsewhere (CPU without the interpreter, MPS, ...). CUDA tensors therefore
  never take the torch path unless asked to; :func:`resolve_impl` says which one a device gets,
  and the recipe logs it. An explicit ``"triton"`` on a device the kernel cannot run on raises.

The loss returned is the *sum* over labelled tokens; the caller divides by the number of
labelled tokens of the whole optimiser step, so gradient accumulation weighs tokens equally.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

IGNORE_INDEX = -100
"""Label value the loss skips (transformers' convention)."""

IMPLS = ("auto", "triton", "torch")

# Budget for the chunk-sized [c, V] buffers alive at once, 512 MiB: small next to a
# long-context step. The triton path holds one: the logits in the weight's dtype, overwritten
# by their gradient (2 bytes per logit in bf16: 2048 tokens at V = 128256, 8384 at V = 32000).
# The torch path is budgeted, as before, on its fp32 copy (4 bytes per logit: 1024 tokens at
# V = 128256); it briefly also holds the bf16 logits and the bf16 gradient beside it.
_CHUNK_BUDGET_BYTES = 512 * 2**20
# chunks are a multiple of 64 tokens: full tiles in the chunk's matmuls
_CHUNK_MULTIPLE = 64


def default_chunk_tokens(vocab_size: int, bytes_per_logit: int = 2) -> int:
    """Tokens per chunk whose ``bytes_per_logit``-byte logits fit the 512 MiB budget, rounded
    down to a multiple of 64 (at least 64). ``bytes_per_logit``: 2 for the triton path with
    bf16/fp16 weights (4 with fp32 weights), 4 for the torch path (its fp32 copy)."""
    tokens = _CHUNK_BUDGET_BYTES // (bytes_per_logit * vocab_size)
    return max(_CHUNK_MULTIPLE, tokens // _CHUNK_MULTIPLE * _CHUNK_MULTIPLE)


def _kernel_module():
    # imported on first use: TRITON_INTERPRET may be switched on after recipes is imported
    from hf_flash.kernels import cross_entropy

    return cross_entropy


def resolve_impl(impl: str, device) -> str:
    """``"triton"`` or ``"torch"``: the elementwise implementation ``impl`` means on ``device``
    (see the module docstring). Raises ValueError for an unknown name or for ``"triton"`` on a
    device the kernel cannot run on."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}; choose one of {IMPLS}")
    if impl == "torch":
        return impl
    device = torch.device(device)
    if _kernel_module().runs_on(device):
        return "triton"
    if impl == "triton":
        raise ValueError(
            f"impl='triton': the cross-entropy kernel cannot run on {device} tensors (it needs CUDA, "
            "or TRITON_INTERPRET=1 for CPU tensors); use impl='torch' or impl='auto'"
        )
    return "torch"


def loss_name(loss_impl: str, device) -> str:
    """The recipe's loss as logged: ``"chunked (triton)"`` / ``"chunked (torch)"`` for the
    chunked loss on ``device`` with ``impl="auto"``, else ``loss_impl`` itself."""
    if loss_impl != "chunked":
        return loss_impl
    return f"chunked ({resolve_impl('auto', device)})"


def _logits_ce_torch(h: Tensor, w: Tensor, y: Tensor, need_grad: bool):
    """The chunk's logits and their elementwise part in torch ops: (loss rows in fp32/fp64,
    gradient ``softmax - onehot`` in the weight's dtype or None). Holds an fp32 copy."""
    acc = torch.promote_types(w.dtype, torch.float32)
    valid = y != IGNORE_INDEX
    y_safe = torch.where(valid, y, 0)
    x = (h @ w.t()).to(acc)  # [c, V]; the low-precision logits are freed at once
    lse = torch.logsumexp(x, dim=-1)  # [c]
    target = x.gather(1, y_safe[:, None]).squeeze(1)
    rows = torch.where(valid, lse - target, 0.0)
    if not need_grad:
        return rows, None
    # x becomes dloss/dlogits in place: softmax - onehot, zero on ignored rows
    g = x.sub_(lse[:, None]).exp_()
    g[torch.arange(g.shape[0], device=g.device), y_safe] -= 1.0
    g.mul_(valid[:, None])
    return rows, g.to(w.dtype)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, chunk_tokens: int, impl: str) -> Tensor:
        # hidden: [N, H]   weight: [V, H]   labels: [N]
        n = hidden.shape[0]
        need_dh = ctx.needs_input_grad[0]
        need_dw = ctx.needs_input_grad[1]
        need_grad = need_dh or need_dw
        dh = torch.empty_like(hidden) if need_dh else None
        acc = torch.promote_types(weight.dtype, torch.float32)  # softmax precision, at least fp32
        dw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_dw else None
        total = torch.zeros((), dtype=acc, device=hidden.device)
        w = weight
        kernel = _kernel_module() if impl == "triton" else None
        for s in range(0, n, chunk_tokens):
            h = hidden[s : s + chunk_tokens].to(w.dtype)  # [c, H]
            y = labels[s : s + chunk_tokens]  # [c]
            if kernel is not None:
                logits = h @ w.t()  # [c, V], the weight's dtype
                # one launch: loss rows, and the logits become dloss/dlogits in place
                rows = kernel.cross_entropy_rows(logits, y, ignore_index=IGNORE_INDEX, write_grad=need_grad)
                g = logits if need_grad else None
                del logits
            else:
                rows, g = _logits_ce_torch(h, w, y, need_grad)
            total += rows.sum()
            if need_dh:
                dh[s : s + chunk_tokens] = (g @ w).to(hidden.dtype)
            if need_dw:
                dw.add_(g.t().to(acc) @ h.to(acc))
            del g  # before the next chunk's matmul allocates its buffer
        ctx.save_for_backward(dh, dw)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        dh, dw = ctx.saved_tensors
        grad_h = dh * grad_out.to(dh.dtype) if dh is not None else None
        grad_w = (dw * grad_out).to(ctx.weight_dtype) if dw is not None else None
        return grad_h, grad_w, None, None, None


def chunked_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    chunk_tokens: Optional[int] = None,
    impl: str = "auto",
) -> Tensor:
    """Sum of token cross-entropies of ``hidden @ weight.T`` against ``labels`` (``-100`` ignored).

    hidden: ``(N, H)``; weight: ``(V, H)`` (the LM head, no bias); labels: ``(N,)`` int64, on
        the weight's device.
    chunk_tokens: tokens per logits chunk. Default :func:`default_chunk_tokens`: 512 MiB of
        chunk buffers, 2048 tokens for bf16 weights at V = 128256 with the triton path (1024 with
        the torch path, whose fp32 copy takes twice the room).
    impl: ``"auto"`` (default), ``"triton"`` or ``"torch"``: who computes the loss and
        ``softmax - onehot`` from each chunk's logits (module docstring; :func:`resolve_impl`).
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} must be (N, H) and (V, H)")
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"labels {tuple(labels.shape)} must be ({hidden.shape[0]},)")
    if labels.dtype != torch.int64:
        raise TypeError(f"labels.dtype is {labels.dtype}; pass int64 labels (labels.long())")
    if labels.device != weight.device:
        raise ValueError(f"labels are on {labels.device}, weight on {weight.device}; move them to one device")
    impl = resolve_impl(impl, weight.device)
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1")
    if chunk_tokens is None:
        logit_bytes = weight.element_size() if impl == "triton" else 4
        chunk_tokens = default_chunk_tokens(weight.shape[0], logit_bytes)
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, labels, chunk_tokens, impl)


def full_linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor) -> Tensor:
    """Reference: materialises all logits (fp32). Same contract as the chunked version."""
    logits = (hidden.to(weight.dtype) @ weight.t()).to(torch.promote_types(weight.dtype, torch.float32))
    return torch.nn.functional.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


def liger_linear_cross_entropy():
    """Liger-Kernel's fused linear cross-entropy as ``fn(hidden, weight, labels) -> sum``."""
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    except ImportError as e:
        raise ImportError(
            "loss_impl='liger' needs the liger-kernel package (pip install liger-kernel); "
            "use loss_impl='chunked' otherwise"
        ) from e
    loss = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="sum")

    def fn(hidden: Tensor, weight: Tensor, labels: Tensor) -> Tensor:
        return loss(weight, hidden.to(weight.dtype), labels)

    return fn

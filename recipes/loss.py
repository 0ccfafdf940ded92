"""Linear + cross-entropy without the full logits.

At 128K tokens and a 128K vocabulary the logits alone would take 64 GiB in fp32. The chunked
loss walks the tokens in chunks: for each chunk it computes the logits ``h @ W^T`` (in the
weight's dtype, then fp32 for the softmax), the loss, and at once the gradient of the loss with
respect to the chunk's logits, ``softmax - onehot``, which it immediately contracts into
``dL/dh = g @ W`` (and ``dL/dW += g^T h`` when the head is trainable). Only one chunk of logits
exists at any time and nothing of them is kept for backward: backward only rescales the stored
gradients by the incoming scalar. That costs one matmul fewer than checkpointing each chunk
(which would recompute the logits in backward).

The loss returned is the *sum* over labelled tokens; the caller divides by the number of
labelled tokens of the whole optimiser step, so gradient accumulation weighs tokens equally.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .data import IGNORE_INDEX

# fp32 logits per chunk; 512 MiB keeps the transient small next to a long-context step
_DEFAULT_CHUNK_BYTES = 512 * 2**20


def default_chunk_tokens(vocab_size: int) -> int:
    return max(64, _DEFAULT_CHUNK_BYTES // (4 * vocab_size))


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, chunk_tokens: int) -> Tensor:
        # hidden: [N, H]   weight: [V, H]   labels: [N]
        n = hidden.shape[0]
        need_dh = ctx.needs_input_grad[0]
        need_dw = ctx.needs_input_grad[1]
        dh = torch.empty_like(hidden) if need_dh else None
        acc = torch.promote_types(weight.dtype, torch.float32)  # softmax precision, at least fp32
        dw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_dw else None
        total = torch.zeros((), dtype=acc, device=hidden.device)
        w = weight
        for s in range(0, n, chunk_tokens):
            h = hidden[s : s + chunk_tokens].to(w.dtype)  # [c, H]
            y = labels[s : s + chunk_tokens]  # [c]
            valid = y != IGNORE_INDEX
            y_safe = torch.where(valid, y, 0)
            logits = (h @ w.t()).to(acc)  # [c, V]
            lse = torch.logsumexp(logits, dim=-1)  # [c]
            target = logits.gather(1, y_safe[:, None]).squeeze(1)
            total += torch.where(valid, lse - target, 0.0).sum()
            if need_dh or need_dw:
                # logits become dloss/dlogits in place: softmax - onehot, zero on ignored rows
                g = logits.sub_(lse[:, None]).exp_()
                g[torch.arange(g.shape[0], device=g.device), y_safe] -= 1.0
                g.mul_(valid[:, None])
                g = g.to(w.dtype)
                if need_dh:
                    dh[s : s + chunk_tokens] = (g @ w).to(hidden.dtype)
                if need_dw:
                    dw.add_(g.t().to(acc) @ h.to(acc))
            del logits
        ctx.save_for_backward(dh, dw)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        dh, dw = ctx.saved_tensors
        grad_h = dh * grad_out.to(dh.dtype) if dh is not None else None
        grad_w = (dw * grad_out).to(ctx.weight_dtype) if dw is not None else None
        return grad_h, grad_w, None, None


def chunked_linear_cross_entropy(
    hidden: Tensor, weight: Tensor, labels: Tensor, chunk_tokens: Optional[int] = None
) -> Tensor:
    """Sum of token cross-entropies of ``hidden @ weight.T`` against ``labels`` (``-100`` ignored).

    hidden: ``(N, H)``; weight: ``(V, H)`` (the LM head, no bias); labels: ``(N,)`` int64.
    chunk_tokens: tokens per logits chunk; default about 512 MiB of fp32 logits.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} must be (N, H) and (V, H)")
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"labels {tuple(labels.shape)} must be ({hidden.shape[0]},)")
    chunk = chunk_tokens or default_chunk_tokens(weight.shape[0])
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, labels, chunk)


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

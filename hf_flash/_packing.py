"""Packed rows: several sequences concatenated in one row, told apart by ``position_ids``.

A new sequence starts wherever a position does not follow its predecessor (the rule
transformers' own masks use), so ``[0 1 2 0 1 0 1 2 3]`` is three sequences of 3, 2 and 4
tokens. Finding the boundaries needs their number on the host (it sizes the varlen launch), so
:func:`packed_boundaries` reads them once per ``position_ids`` tensor; every layer of a forward
pass, and its checkpointed recomputation, share that read through :data:`BOUNDARIES`.

The read happens inside the attention op (:mod:`hf_flash.interface`), at run time: under
``torch.compile`` the op is opaque, so the compiled graph holds no data-dependent branch and its
body reads the positions when it runs, as eager code would. A CUDA graph capture cannot read
them: :func:`packed_boundaries` then raises (see its docstring for what to pass instead).

Plain PyTorch.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ._runtime import TensorKeyedCache, host_reads_allowed

__all__ = ["packed_boundaries", "rows_of_documents", "BOUNDARIES"]

# (cu_seqlens, max_seqlen) or None of the last position_ids tensor, keyed by (batch, seqlen)
BOUNDARIES = TensorKeyedCache(slots=1)


def packed_boundaries(
    position_ids: Optional[Tensor], batch: int, seqlen: int
) -> Optional[Tuple[Tensor, int]]:
    """``(cu_seqlens, max_seqlen)`` of the sequences in the flattened ``(batch * seqlen)``
    tokens if ``position_ids`` restart inside a row (packed sequences), else None (one sequence
    per row, or position_ids that do not describe these rows: wrong rank or shape).
    ``position_ids``: ``(1, seqlen)`` (shared by every row) or ``(batch, seqlen)``.
    ``cu_seqlens`` is int32 on ``position_ids``' device.

    Raises ValueError while a CUDA graph is being captured (no host read is possible there):
    packed batches then need their boundaries given, as transformers'
    ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` does (``cu_seq_lens_q/k``,
    ``max_length_q/k``)."""
    if position_ids is None or position_ids.dim() != 2 or position_ids.shape[-1] != seqlen:
        return None
    if position_ids.shape[0] not in (1, batch):
        return None
    if not host_reads_allowed():
        raise ValueError(
            "hf_flash finds packed sequences by reading position_ids on the host, which a CUDA "
            "graph capture (or a traced host read) does not allow; pass the boundaries instead "
            "(cu_seq_lens_q/k and max_length_q/k, as DataCollatorWithFlattening("
            "return_flash_attn_kwargs=True) does) or run this forward outside the graph"
        )
    if not BOUNDARIES.usable(position_ids):
        return _find_boundaries(position_ids, batch, seqlen)
    key = (batch, seqlen)
    found = BOUNDARIES.get(position_ids, key)
    if found is None:
        found = (_find_boundaries(position_ids, batch, seqlen),)  # a tuple: None is a result
        BOUNDARIES.put(position_ids, found, key)
    return found[0]


def _find_boundaries(position_ids: Tensor, batch: int, seqlen: int):
    pos = position_ids.expand(batch, seqlen)
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    idx = starts.reshape(-1).nonzero().flatten().cpu()  # the one host read
    if idx.numel() == batch:
        return None  # one sequence per row: the dense kernel is the fast path
    cu = torch.cat([idx, idx.new_tensor([batch * seqlen])]).to(torch.int32)
    max_len = int((cu[1:] - cu[:-1]).max())
    return cu.to(position_ids.device), max_len


def rows_of_documents(cu_seqlens: Tensor, seqlen: int) -> Tensor:
    """The batch row each packed sequence sits in (for per-row options such as ALiBi slopes
    of shape (batch, nheads)): sequences never cross a row, so a start's row is its row."""
    return (cu_seqlens[:-1] // seqlen).long()

"""``flash_attn.bert_padding`` for flash-attn's tests: pack the rows a mask keeps, and back.

Same signatures and return values as flash-attn 2.8: ``unpad_input`` returns
``(unpadded, indices, cu_seqlens, max_seqlen, used_seqlens)``.
"""

from typing import Optional

import torch
import torch.nn.functional as F


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor,
                unused_mask: Optional[torch.Tensor] = None):
    """hidden_states: (batch, seqlen, ...); attention_mask: (batch, seqlen), 1 keeps a token.
    unused_mask: (batch, seqlen), tokens that are packed but not attended to (counted in
    ``cu_seqlens``, not in ``used_seqlens``)."""
    all_masks = attention_mask + unused_mask if unused_mask is not None else attention_mask
    seqlens = all_masks.sum(dim=-1, dtype=torch.int32)
    used_seqlens = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max().item())
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return flat[indices], indices, cu_seqlens, max_seqlen, used_seqlens


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int):
    """hidden_states: (total, ...) -> (batch, seqlen, ...), zeros where nothing was kept."""
    out = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    out[indices] = hidden_states
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])

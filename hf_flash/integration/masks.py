"""Padding masks: the mask function and each row's valid key range.

Every attention layer of a forward pass gets the same mask tensor (what :func:`hf_flash_mask`
returned), so what hf_flash derives from it (each row's valid key block ``[start, end)``) is
computed once per forward pass and kept in a :class:`~hf_flash._runtime.TensorKeyedCache`
(:data:`KEY_BLOCKS`), not once per layer. Packed sequences (position_ids restarts) are found
inside the attention op, :mod:`hf_flash._packing`.

The valid key block of a row has one definition, :func:`valid_block` (first valid index, one
past the last; ``start = end = M`` for a row with none), computed three ways that agree:
:func:`mask_rows` (one Triton launch, :mod:`hf_flash.kernels.key_mask`, or torch ops where
Triton cannot run), :func:`valid_block` on the device (while tracing), and the host lists that
:func:`mask_rows` reads back. The mask function, the attention function (decode and padded
paths), the fused decode patch and the unpadding patch all take it from here.

Plain PyTorch; never imports transformers.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from .._runtime import TensorKeyedCache, host_reads_allowed, interpreter_active
from ..kernels.key_mask import key_mask_rows

__all__ = [
    "hf_flash_mask", "has_holes", "packed_positions", "mask_rows", "MaskRows", "valid_block", "first_valid", "key_blocks",
    "KEY_BLOCKS", "row_key_bounds", "has_block_overlay", "is_row_bounds",
]  # fmt: skip


# int32 (key_start, key_end) of the last few key masks
KEY_BLOCKS = TensorKeyedCache(slots=4)

# attribute set on a mask that hf_flash_mask returned with padding inside a row
_HOLES = "_hf_flash_holes"


def has_holes(mask) -> bool:
    """Whether :func:`hf_flash_mask` found padding inside a row of ``mask`` (a 0 between two 1s):
    the attention must then gather each row's valid tokens instead of taking one block per row.
    Always False while tracing, where the mask function reads nothing (left/right padding only).
    An attribute on the tensor, not a weak-keyed cache: inference-mode tensors have no version
    counter, and a dropped cache entry would silently attend the padding."""
    return not torch.compiler.is_compiling() and bool(getattr(mask, _HOLES, False))


# --------------------------------------------------------------------------------------------
# Mask function (once per forward pass and mask type)
# --------------------------------------------------------------------------------------------


def hf_flash_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset=0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: Optional[Tensor] = None,
    **kwargs,
) -> Optional[Tensor]:
    """FlashAttention-style mask for transformers' ``AttentionMaskInterface``.

    Returns ``None`` when every key of the layer is valid, else a 2-D bool ``(batch, M)`` key mask
    (``M <= kv_length``; see the module docstring). For one query on a static cache layer
    (``q_offset`` a tensor) ``M`` is always ``kv_length``, the entries past the tokens written so
    far False, and the mask is returned even when every slot is valid: a compiled decode step
    then sees one kind of input on every step, the one that fills the cache included.
    Causality, sliding windows and packed sequences are not encoded here: the kernel applies
    them. One exception: with no user mask, when the mask function transformers combined
    separates packed sequences (found from ``position_ids``), the return value is each token's
    position within its sequence, an int64 ``(batch, q_length)`` tensor
    (:func:`packed_positions`), so models that do not pass ``position_ids`` to their attention
    layers still keep the sequences apart. How the attention function reads the mask: :mod:`hf_flash.integration.attention`.

    Arguments (transformers' mask-interface keywords):
        batch_size, q_length, kv_length: int. Sizes of this layer's attention.
        q_offset: int or 0-d tensor. Tokens the cache held before this forward pass (a tensor for
            StaticCache layers).
        kv_offset: int. Absolute position of key index 0 (sliding-window caches).
        attention_mask: (batch, >= kv_length) bool, or None. The user's padding mask.
        kwargs: ``use_vmap=True`` means the model combined a custom ``or``/``and`` mask function.
            Those built from transformers' causal, sliding-window and image-block
            (``blockwise_overlay``: gemma3's bidirectional image tokens) pieces become per-row key
            ranges (:func:`row_key_bounds`); any other is rejected with its name.

    A mask function with image blocks (or any ``use_vmap`` one) returns each query row's key
    range instead, an int32 ``(batch, q_length, 2)`` tensor (:func:`row_key_bounds`; padding
    folded in), which the attention function runs through the kernels' ``key_bounds``.

    Outside torch.compile the mask is read once on the host (one Triton launch,
    :mod:`hf_flash.kernels.key_mask`, and one sync per forward pass and mask type, as
    transformers' own flash mask reads it): an all-valid mask becomes None, and padding in
    the middle of a row is marked (below). That read stays on decode steps too: the decode path
    would otherwise attend the padding inside a row (a right-padded prompt continued by generate is
    the usual way to get one), and eager generate() already waits for the device once per step
    (its stopping check), so the read only waits for the few mask ops queued since. The row
    bounds it computes are kept for the attention layers of the same forward pass
    (:func:`key_blocks`). Padding inside a row (a 0 between two 1s: random test masks, a
    right-padded prompt continued by generate) is marked on the returned mask (:func:`has_holes`)
    and the attention then gathers each row's valid tokens into one sequence, what transformers'
    flash_attention_2 does with every padding mask; on a static-cache decode step it raises.
    While compiling nothing is read back: the mask is passed on as is,
    and it must then be left/right padding (what tokenizers and generate produce); with no user
    mask, a static cache layer's valid slots (its fill level, a device tensor) become a
    ``kv_length`` mask built on the device.
    """
    compiling = torch.compiler.is_compiling()
    if kwargs.get("use_vmap", False) or (not compiling and has_block_overlay(mask_function)):
        if compiling:
            raise ValueError(
                "attn_implementation='hf_flash' reads a custom mask function (an "
                "or_mask_function/and_mask_function, e.g. bidirectional attention over image "
                "tokens) only outside torch.compile; build the masks before the compiled region"
            )
        return row_key_bounds(
            mask_function, batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask,
            kwargs.get("device"),
        )  # fmt: skip
    # a one-token step on a static cache layer (q_offset: its fill-level tensor): the key mask
    # keeps the cache's full width every step, and is never replaced by None (see below)
    static_step = q_length == 1 and isinstance(q_offset, Tensor)
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError(
                f"hf_flash needs a 2-D (batch, kv_len) padding mask, got shape "
                f"{tuple(attention_mask.shape)}; custom 4-D masks need attn_implementation='sdpa'"
            )
        mask = attention_mask[:, -kv_length:]
        if compiling:  # no host reads while tracing; the attention handles any contiguous mask
            return mask if mask.dtype == torch.bool else mask != 0
        width = kv_length if static_step else mask.shape[1]
        rows = mask_rows(mask, width)
        if not rows.contiguous:
            if static_step:
                # generate may compile this step, and a compiled step cannot gather tokens
                raise ValueError(
                    "attention_mask has padding inside a sequence (a 0 between two 1s in a row) "
                    "on a static-cache decode step; hf_flash gathers such tokens only with a "
                    "DynamicCache or without a cache. Use left padding for generate with "
                    "cache_implementation='static'"
                )
            # padding inside a row: the attention gathers each row's valid tokens
            # (integration.attention._gathered_attention), as flash_attention_2 unpads
            marked = rows.mask if rows.mask is not attention_mask else rows.mask.clone()
            setattr(marked, _HOLES, True)
            return marked
        # None (no padding) would make a compiled static-cache step see a second kind of input
        # on its last step, when the cache is full: a recompile and a second CUDA graph
        if rows.all_valid and mask.shape[1] == kv_length and not static_step:
            return None
        if KEY_BLOCKS.usable(rows.mask):  # for the attention layers of this forward pass
            KEY_BLOCKS.put(rows.mask, (rows.start, rows.end))
        return rows.mask
    # host_reads_allowed first: it is False while tracing, where a closure walk cannot be traced
    if q_length == kv_length > 1 and host_reads_allowed() and _may_separate(mask_function):
        positions = packed_positions(mask_function, batch_size, q_length, kwargs.get("device"))
        if positions is not None:
            return positions
    # No user mask: every key written so far is valid. Only a static cache has more key slots
    # (zero-filled) than that, and its layers report how many tokens they hold.
    valid = q_offset + q_length - kv_offset
    if isinstance(valid, Tensor):
        if compiling:
            # no host read while tracing: the first ``valid`` of the kv_length slots, built on
            # the device at the cache's fixed size (one input shape for every decode step)
            slots = torch.arange(kv_length, device=valid.device)
            return (slots < valid).unsqueeze(0).expand(batch_size, kv_length)
        valid = int(valid)
    if valid >= kv_length and not static_step:
        return None
    device = kwargs.get("device")
    if device is None:
        device = q_offset.device if isinstance(q_offset, Tensor) else "cpu"
    mask = torch.ones(batch_size, min(valid, kv_length), dtype=torch.bool, device=device)
    return _fixed_size_for_decode(mask, q_length, kv_length, q_offset)


# transformers.masking_utils pieces that never hide a token's predecessor, and the wrappers
# looked through (their closures hold the combined pieces)
_SEES_PREVIOUS = ("causal_mask_function", "bidirectional_mask_function")
_WRAPPERS = ("and_masks.", "or_masks.", "add_offsets_to_mask_function.")


def _may_separate(mask_function) -> bool:
    """Whether a mask function may hide a token's predecessor (and so separate packed
    sequences), decided without evaluating it where transformers' own pieces tell: its causal
    and bidirectional functions and windows of two or more never do, its and/or/offset wrappers
    are looked through; any other piece (packed sequences, chunks, a model's own function) may,
    and :func:`packed_positions` then evaluates it (one host read). So a plain causal or windowed
    model pays no host read here."""
    if mask_function is None:
        return False
    name = getattr(mask_function, "__qualname__", "")
    if getattr(mask_function, "__module__", "") != "transformers.masking_utils":
        return True
    if name in _SEES_PREVIOUS:
        return False
    cells = [c.cell_contents for c in (getattr(mask_function, "__closure__", None) or ())]
    if name.startswith("sliding_window_overlay."):
        return any(isinstance(c, int) and c < 2 for c in cells)
    if name.startswith(_WRAPPERS):
        parts = [f for c in cells for f in (c if isinstance(c, tuple) else (c,)) if callable(f)]
        return not parts or any(_may_separate(f) for f in parts)
    return True


def packed_positions(mask_function, batch_size: int, length: int, device=None) -> Optional[Tensor]:
    """Each token's position within its sequence, ``(batch, length)`` int64, when
    ``mask_function`` separates packed sequences (a token that cannot see the token before it
    starts a new one), else None.

    transformers finds packed sequences from ``position_ids`` when it builds the mask (no padding
    mask, no cache) and folds them into the mask function; a model that does not pass
    ``position_ids`` on to its attention layers (CTRL, ...) would otherwise have its sequences
    attend each other on "hf_flash". The attention function reads an integer mask as these
    positions. One evaluation of the mask function over the ``length - 1`` adjacent pairs and one
    host read; a sliding window (of two or more) hides no predecessor.
    """
    rows = torch.arange(batch_size, device=device)[:, None]
    idx = torch.arange(length, device=device)
    q = idx[1:][None, :]
    try:
        sees_previous = mask_function(rows, torch.zeros_like(rows), q, q - 1)
    except Exception:  # a mask function that only runs under vmap: nothing to learn from it
        return None
    sees_previous = torch.as_tensor(sees_previous, device=idx.device).bool()
    sees_previous = sees_previous.expand(batch_size, length - 1)  # [B, S - 1]
    if bool(sees_previous.all()):
        return None
    starts = torch.cat([torch.ones_like(sees_previous[:, :1]), ~sees_previous], dim=1)
    first = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values  # [B, S]
    return idx - first


def _fixed_size_for_decode(mask: Tensor, q_length: int, kv_length: int, q_offset) -> Tensor:
    """A one-token step on a static cache layer (``q_offset`` is its fill-level tensor) gets its
    key mask padded with False up to the cache's ``kv_length`` slots.

    generate() builds this mask outside the compiled decode step and feeds it in; at its natural
    length (past + 1) it grows every step, so Inductor would see a new input shape and record a
    new CUDA graph per token. Padded, the shape is fixed. The meaning is unchanged: a single
    query sits at the end of its row's valid block (module docstring), and the appended False
    entries lie beyond it. Several queries keep the natural length, which places them.
    """
    if q_length != 1 or not isinstance(q_offset, Tensor) or mask.shape[1] >= kv_length:
        return mask
    return torch.nn.functional.pad(mask, (0, kv_length - mask.shape[1]), value=False)


class MaskRows(NamedTuple):
    """What :func:`mask_rows` reads off a (B, M) padding mask."""

    mask: Tensor  # (B, width) bool, padded with False past M
    start: Tensor  # (B,) int32 on the mask's device: first valid index (width if none)
    end: Tensor  # (B,) int32: one past the last valid index (start if none)
    host_start: list  # the same on the host
    host_end: list
    host_count: list  # valid entries per row
    width: int  # M, the entries of the mask given

    @property
    def all_valid(self) -> bool:
        return all(c == self.width for c in self.host_count)

    @property
    def contiguous(self) -> bool:
        """Every row's valid entries form one block (left or right padding)."""
        return all(e - s == c for s, e, c in zip(self.host_start, self.host_end, self.host_count))


def mask_rows(mask: Tensor, width: int) -> MaskRows:
    """Each row's valid block of a (B, M) padding mask (bool, int or float; any strides), with
    one device sync: the (B, width) bool mask (``width >= M``), each row's ``[start, end)``
    (:func:`valid_block`'s convention) on the device and on the host, and its count. One
    Triton launch (:mod:`hf_flash.kernels.key_mask`) where the kernels run; torch ops on a CPU
    without Triton's interpreter."""
    rows = key_mask_rows if mask.is_cuda or interpreter_active() else mask_rows_torch
    out, stats = rows(mask, width)
    starts, ends, counts = stats.tolist()
    return MaskRows(out, stats[0], stats[1], starts, ends, counts, mask.shape[1])


def mask_rows_torch(mask: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """:func:`hf_flash.kernels.key_mask.key_mask_rows` in torch ops, where Triton cannot run (a
    CPU without its interpreter): ``(out, stats)`` with the same meaning."""
    out = mask if mask.dtype == torch.bool else mask != 0
    out = torch.nn.functional.pad(out, (0, width - mask.shape[1]), value=False)
    start, end = valid_block(out)
    return out, torch.stack([start, end, out.sum(dim=1)]).to(torch.int32)


def first_valid(mask: Tensor) -> Tensor:
    """Per row of a (B, M) bool key mask, the index of the first True entry (M if none), int64."""
    # int64 throughout: Inductor (torch 2.11) mis-types an int32 where/amin reduction whose
    # scalar branch it promotes to int64, and fails to compile the static-cache decode step
    pos = torch.arange(mask.shape[1], device=mask.device, dtype=torch.int64)
    return torch.where(mask, pos, mask.shape[1]).amin(dim=1)


def valid_block(mask: Tensor) -> tuple[Tensor, Tensor]:
    """Per row of a (B, M) bool key mask, the first valid index and one past the last, int64:
    ``[s, e)``; ``s = e = M`` if the row has none. Device ops only (no sync)."""
    start = first_valid(mask)
    pos = torch.arange(mask.shape[1], device=mask.device, dtype=torch.int64)
    end = torch.where(mask, pos + 1, 0).amax(dim=1)
    return start, torch.maximum(end, start)


def key_blocks(mask: Tensor) -> tuple[Tensor, Tensor]:
    """int32 ``(key_start, key_end)`` of each row's valid block of a (B, M) bool key mask,
    computed once per mask tensor (:data:`KEY_BLOCKS`; the mask function stores what it already
    read), and inline while tracing or capturing."""
    cacheable = KEY_BLOCKS.usable(mask)
    if cacheable:
        blocks = KEY_BLOCKS.get(mask)
        if blocks is not None:
            return blocks
    start, end = valid_block(mask)
    blocks = (start.to(torch.int32), end.to(torch.int32))
    if cacheable:
        KEY_BLOCKS.put(mask, blocks)
    return blocks


# --------------------------------------------------------------------------------------------
# Custom mask functions as per-row key ranges (gemma3's bidirectional image blocks)
# --------------------------------------------------------------------------------------------

_MASKING = "transformers.masking_utils"
_AND, _OR = "and_masks.<locals>.and_mask", "or_masks.<locals>.or_mask"
_BLOCKS = "blockwise_overlay.<locals>.inner_mask"
_WINDOW = "sliding_window_overlay.<locals>.inner_mask"
_UNBOUNDED = 1 << 40  # beyond any key position


class _Unsupported(Exception):
    pass


def _piece(fn) -> tuple[Optional[str], dict]:
    """(qualified name, closure variables) of one of transformers.masking_utils' mask pieces;
    (None, {}) for any other callable."""
    if getattr(fn, "__module__", None) != _MASKING or not hasattr(fn, "__code__"):
        return None, {}
    cells = getattr(fn, "__closure__", None) or ()
    return fn.__qualname__, {n: c.cell_contents for n, c in zip(fn.__code__.co_freevars, cells)}


def has_block_overlay(mask_function) -> bool:
    """Whether transformers combined an image-block piece (``blockwise_overlay``: tokens of one
    block see each other, e.g. gemma3's image tokens) into ``mask_function``, looking through
    its and/or wrappers. Python only: nothing is evaluated."""
    name, cells = _piece(mask_function)
    if name == _BLOCKS:
        return True
    if name in (_AND, _OR):
        return any(has_block_overlay(f) for f in cells.get("mask_functions", ()))
    return False


def is_row_bounds(mask) -> bool:
    """Whether the attention function got :func:`row_key_bounds`' per-row key ranges."""
    return isinstance(mask, Tensor) and mask.dtype == torch.int32 and mask.dim() == 3 and mask.shape[-1] == 2


def row_key_bounds(
    mask_function, batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
    attention_mask: Optional[Tensor] = None, device=None,
) -> Tensor:  # fmt: skip
    """Each query row's visible keys under ``mask_function`` (and the padding mask), as one
    ``[lo, hi)`` range of key indices: int32 ``(batch, q_length, 2)`` for the kernels'
    ``key_bounds``.

    The mask function is read piece by piece (transformers' and/or wrappers, causal,
    bidirectional, sliding-window and image-block pieces) and evaluated as ranges of absolute
    key positions per query position ``p = q_offset + i``: causal ``[0, p]``, a window of ``w``
    ``[p - w + 1, ...)``, the image block holding ``p`` that block's tokens (none for text), and
    AND/OR as intersection/union. Every piece's range holds ``p`` itself or is empty, so unions
    stay one range: gemma3's ``causal OR block`` (global layers) and ``window AND (causal OR
    block)`` (local layers) are exact. Then key index ``j = position - kv_offset``, clamped to
    ``[0, kv_length)``, intersected with the row's valid padding block (left or right padding).

    Torch ops on the device; host reads: the padding mask's (as :func:`hf_flash_mask` reads it
    anyway) and one check that every image block id covers one run of tokens (skipped while a
    CUDA graph is captured). Raises ValueError, before any kernel runs, for a piece it does not
    know (naming it), padding inside a row, or a block id used by two separate runs.
    """
    if device is None:
        device = attention_mask.device if attention_mask is not None else "cpu"
    positions = torch.arange(q_length, device=device, dtype=torch.int64) + q_offset
    positions = positions.expand(batch_size, q_length)
    try:
        lo, hi = _key_range(mask_function, positions)
    except _Unsupported as piece:
        raise ValueError(
            "attn_implementation='hf_flash' cannot express this model's custom mask function as "
            f"one key range per query row: it contains {piece}. hf_flash runs causal and sliding-window "
            "masks combined (and/or) with image blocks (transformers' blockwise_overlay, e.g. "
            "gemma3's bidirectional image tokens); load the model with attn_implementation='sdpa' "
            "or 'eager' for this input"
        ) from None
    lo = (lo - kv_offset).clamp(0, kv_length)
    hi = (hi - kv_offset).clamp(0, kv_length)
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError(
                f"hf_flash needs a 2-D (batch, kv_len) padding mask, got shape "
                f"{tuple(attention_mask.shape)}; custom 4-D masks need attn_implementation='sdpa'"
            )
        rows = mask_rows(attention_mask[:, -kv_length:].to(device), kv_length)
        if not rows.contiguous:
            raise ValueError(
                "attention_mask has padding inside a sequence (a 0 between two 1s in a row) and the "
                "model's mask function has image blocks; hf_flash takes such masks with left or "
                "right padding only"
            )
        lo = torch.maximum(lo, rows.start.to(torch.int64)[:, None])
        hi = torch.minimum(hi, rows.end.to(torch.int64)[:, None])
    return torch.stack([lo, hi], dim=-1).to(torch.int32)


def _key_range(fn, pos: Tensor) -> tuple[Tensor, Tensor]:
    """``[lo, hi)`` absolute key positions that query positions ``pos`` (B, S) see under ``fn``."""
    name, cells = _piece(fn)
    if name == "causal_mask_function":
        return torch.full_like(pos, -_UNBOUNDED), pos + 1
    if name == "bidirectional_mask_function":
        return torch.full_like(pos, -_UNBOUNDED), torch.full_like(pos, _UNBOUNDED)
    if name == _WINDOW and isinstance(cells.get("sliding_window"), int):
        return pos - cells["sliding_window"] + 1, torch.full_like(pos, _UNBOUNDED)
    if name == _BLOCKS and isinstance(cells.get("block_sequence_ids"), Tensor):
        return _block_range(cells["block_sequence_ids"], pos)
    if name in (_AND, _OR) and cells.get("mask_functions"):
        ranges = [_key_range(f, pos) for f in cells["mask_functions"]]
        lo, hi = ranges[0]
        for lo_b, hi_b in ranges[1:]:
            if name == _AND:
                lo, hi = torch.maximum(lo, lo_b), torch.minimum(hi, hi_b)
            else:  # both hold the row's own position or are empty: the union is one range
                empty_a, empty_b = lo >= hi, lo_b >= hi_b
                lo, hi = (
                    torch.where(empty_a, lo_b, torch.where(empty_b, lo, torch.minimum(lo, lo_b))),
                    torch.where(empty_a, hi_b, torch.where(empty_b, hi, torch.maximum(hi, hi_b))),
                )
        return lo, hi
    raise _Unsupported(name or getattr(fn, "__qualname__", None) or repr(fn))


def _block_range(ids: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
    """The block of ``ids`` (B or 1, L; < 0: no block) holding each query position: its run of
    equal ids ``[start, end)``, or an empty range (text tokens)."""
    ids = ids.to(pos.device).expand(pos.shape[0], -1)
    length = ids.shape[1]
    if host_reads_allowed():
        # one id must cover one run of tokens (transformers numbers each image's run anew)
        sorted_ids, order = ids.sort(dim=1, stable=True)
        split = (sorted_ids[:, 1:] == sorted_ids[:, :-1]) & (sorted_ids[:, 1:] >= 0)
        if bool((split & (order[:, 1:] != order[:, :-1] + 1)).any()):
            raise ValueError(
                "an image block id of this mask function covers two separate runs of tokens, "
                "which is not one key range per query row; hf_flash cannot run it, use "
                "attn_implementation='sdpa' or 'eager'"
            )
    idx = torch.arange(length, device=pos.device)
    first = torch.ones_like(ids[:, :1], dtype=torch.bool)
    starts = torch.cat([first, ids[:, 1:] != ids[:, :-1]], dim=1)
    ends = torch.cat([ids[:, :-1] != ids[:, 1:], first], dim=1)
    run_start = torch.where(starts, idx, 0).cummax(dim=1).values
    run_end = torch.where(ends, idx + 1, length).flip(1).cummin(dim=1).values.flip(1)
    at = pos.clamp(0, length - 1)
    inside = (pos >= 0) & (pos < length) & (ids.gather(1, at) >= 0)
    return (
        torch.where(inside, run_start.gather(1, at), pos),
        torch.where(inside, run_end.gather(1, at), pos),
    )

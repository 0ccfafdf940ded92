"""transformers' continuous batching (``model.generate_batch``, paged KV cache) on hf_flash.

transformers' continuous-batching manager packs every scheduled request into one row: query,
key and value are ``(1, heads, total_tokens, head_dim)``, each request's new tokens one after
the other, and the attention function gets the batch layout in keywords; before transformers
5.24 it also gets the ``PagedAttentionCache`` as ``cache=`` and updates it here, from 5.24 on
the attention module has updated it already (see the cache APIs below). Two forms of step reach
it:

* varlen (prefill, chunked prefill, mixed batches, and every decode step without a block
  table): the cache writes the new K/V into its pages and hands back each request's whole key
  history, concatenated; ``cu_seq_lens_q/k`` and ``max_length_q/k`` describe the requests,
  and :func:`hf_flash.interface.varlen_attention` runs it (bottom-right causal per request)::

      q    | r0: 5 new | r1: 1 new | r2: 3 new |            cu_seq_lens_q = [0, 5, 6, 9]
      k/v  | r0: 5     | r1: 12 past + 1 | r2: 3 |         cu_seq_lens_k = [0, 5, 18, 21]

  Sliding-window layers get only the last ``sliding_window - 1`` cached keys plus the new ones
  (their own ``cu_seq_lens_k``); the kernel applies the window in those coordinates.
* block table (decode fast path: every request brings one token, all layers full attention):
  the cache is left alone and the kernel appends: :func:`hf_flash.decode.append_attend_paged`
  writes each request's new K/V into its pages (``block_table`` row) and attends, in one launch.
  Its page size (``ContinuousBatchingConfig.page_size``; ``block_size`` in transformers < 5.20)
  must be a multiple of 16.

When CUDA graphs or torch.compile are on, transformers pads the batch to fixed sizes: the query
row has more tokens than ``cu_seq_lens_q[-1]`` and trailing requests of length 0 (plateaus in
``cu_seq_lens_*``, ``-1`` page-table rows). Nothing here reads tensor values on the host (no
sync, capturable): padding tokens belong to no request, so the varlen kernel never writes their
output rows (they hold garbage, never sampled, as with flash-attn), and a zero-length request in
the block-table form writes and reads nothing.

Three forms of the cache API exist (this module never imports transformers; it looks at the
cache object, or at the keywords):

* transformers >= 5.24: the attention module itself calls ``cache.update(key_states,
  value_states, layer_idx, kwargs=kwargs)`` before the attention function, which gets no
  ``cache`` but the keywords that update resolved (below) and its key/value:
  :func:`updated_step_attention`.
* transformers 5.20 ... 5.23: ``cache.update(key_states, value_states, layer_idx,
  kwargs)`` resolves the per-layer-type keywords in place (``cu_seq_lens_k`` / ``max_length_k``
  are dicts keyed by layer type) and, with a block table, puts the layer's page views in
  ``kwargs["k_cache"]``/``["v_cache"]`` and its group's table in ``["block_table"]``.
* transformers 5.17 - 5.19: ``cache.update(key_states, value_states, layer_idx, read_index,
  write_index)``; the layer type is ``cache.sliding_windows[layer_idx] > 1``, keywords are
  ``max_seqlen_q/k``, and the page views are ``cache.key_cache[j]`` viewed as
  ``(-1, cache.block_size, heads, head_dim)`` with ``(group, j) =
  cache.layer_index_to_group_indices[layer_idx]``. The model runs under the name
  ``"paged|hf_flash"`` there (registered by :mod:`hf_flash.integration.registration`).

transformers offers the block-table path only to names matching ``flash.*2``/``flash.*3`` on
CUDA; :mod:`hf_flash.integration.registration` lifts that gate for "hf_flash" when every layer
is full attention and the page size is a multiple of 16 (otherwise decoding stays on the varlen
path, which takes any page size).
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch
from torch import Tensor

from .._checks import PAGE_MULTIPLE, as_int
from ..decode import append_attend_paged
from ..interface import varlen_attention
from .common import cast_to_kernel_dtype

__all__ = ["paged_cache_attention", "updated_step_attention", "cache_api"]

FULL, SLIDING = "full_attention", "sliding_attention"
# what PagedAttentionCache.update (transformers >= 5.20) reads and resolves per layer
_LAYER_KEYWORDS = ("cu_seq_lens_k", "max_length_k", "block_table", "read_index", "write_index")


_API_BY_TYPE: dict = {}  # cache class -> its update API (read once per class, not per layer)


def cache_api(cache) -> str:
    """``"kwargs"`` (transformers >= 5.20) or ``"indices"`` (5.17 - 5.19): which
    ``PagedAttentionCache.update`` signature this cache has; ValueError for anything else."""
    api = _API_BY_TYPE.get(type(cache))
    if api is not None:
        return api
    update = getattr(cache, "update", None)
    params = list(inspect.signature(update).parameters) if callable(update) else []
    if "kwargs" in params and "layer_idx" in params:
        api = "kwargs"
    elif "read_index" in params and "write_index" in params:
        api = "indices"
    if api is not None:
        _API_BY_TYPE[type(cache)] = api
        return api
    raise ValueError(
        f"hf_flash got cache={type(cache).__name__}, which is not a transformers "
        "PagedAttentionCache it knows (update(key_states, value_states, layer_idx, kwargs) or "
        "update(..., read_index, write_index)); continuous batching needs transformers "
        "5.17 ... 5.24"
    )


def paged_cache_attention(
    module, query: Tensor, key: Tensor, value: Tensor, cache, opts: dict, kwargs: dict
) -> Tensor:
    """Attention for one layer of a continuous-batching step (module docstring).

    query (1, Hq, total_q, D); key/value (1, Hkv, total_q, D), the new tokens only; ``opts``:
    the kernel options hf_flash's attention function resolved (scale, causal, window, softcap,
    dropout). Returns (1, total_q, Hq, D). Every check that does not need the layer's page
    views runs before the cache is updated.
    """
    api = cache_api(cache)
    layer_idx = getattr(module, "layer_idx", None)
    if not isinstance(layer_idx, int):
        raise ValueError(
            f"continuous batching needs the attention module's layer_idx (an int) to find its "
            f"cache pages; {type(module).__name__}.layer_idx is {layer_idx!r}"
        )
    _check_step(query, opts)
    cu_q = _required(kwargs, "cu_seq_lens_q")
    max_q = _first_present(kwargs, "max_length_q", "max_seqlen_q")
    _check_cu("cu_seq_lens_q", cu_q, query.device)
    sliding = _layer_is_sliding(cache, layer_idx, api)
    if sliding and opts["window_size"] == (-1, -1):
        raise ValueError(
            f"the paged cache keeps layer {layer_idx} as sliding-window attention (it holds only "
            "the last sliding_window - 1 keys), but the layer passed no sliding_window; the "
            "model and its cache disagree"
        )
    layer_type = SLIDING if sliding else FULL
    # dicts keyed by layer type when the model mixes full and sliding layers (always in 5.20+)
    cu_k = _per_layer_type(_required(kwargs, "cu_seq_lens_k"), layer_type)
    max_k = _per_layer_type(_first_present(kwargs, "max_length_k", "max_seqlen_k"), layer_type)
    _check_cu("cu_seq_lens_k", cu_k, query.device)
    _check_counts(cu_q, cu_k)
    block_table = kwargs.get("block_table")
    if block_table is None:
        _required(kwargs, "read_index")
        _required(kwargs, "write_index")

    if api == "kwargs":
        if block_table is not None:
            _check_block_table_shape(block_table, query, cache.layer_to_allocator[layer_idx].index)
        layer_kwargs = {name: kwargs[name] for name in _LAYER_KEYWORDS if name in kwargs}
        # resolves the layer's keywords in place; writes the new K/V into the pages and returns
        # the whole histories unless there is a block table (then the kernel appends)
        key, value = cache.update(
            key_states=key, value_states=value, layer_idx=layer_idx, kwargs=layer_kwargs
        )
        block_table = layer_kwargs.get("block_table")
        pages = (layer_kwargs.get("k_cache"), layer_kwargs.get("v_cache"))
    else:
        group_idx, index_in_group = cache.layer_index_to_group_indices[layer_idx]
        if block_table is not None:
            _check_block_table_shape(block_table, query, group_idx)
            block_table = block_table[group_idx]
            pages = tuple(
                c[index_in_group].view(-1, cache.block_size, *c[index_in_group].shape[1:])
                for c in (cache.key_cache, cache.value_cache)
            )
        else:
            pages = (None, None)
            key, value = cache.update(
                key, value, layer_idx, kwargs["read_index"], kwargs["write_index"]
            )
            # (total_k, Hkv, D) -> the (1, Hkv, total_k, D) layout of the other API
            key, value = key.transpose(0, 1).unsqueeze(0), value.transpose(0, 1).unsqueeze(0)
    return _step(module, query, key, value, cu_q, cu_k, max_q, max_k, block_table, pages, opts)


def updated_step_attention(
    module, query: Tensor, key: Tensor, value: Tensor, opts: dict, kwargs: dict
) -> Tensor:
    """Attention for one layer of a continuous-batching step in transformers >= 5.24, where the
    attention module has already run ``cache.update(..., kwargs=kwargs)`` itself: no ``cache=``
    reaches the attention function, ``cu_seq_lens_k`` / ``max_length_k`` are this layer's, and
    key/value are the whole histories (varlen) or, with a ``block_table`` (the layer group's
    ``(requests, blocks)`` table), the new tokens, the pages in ``k_cache``/``v_cache``.

    Shapes and return as :func:`paged_cache_attention`.
    """
    _check_step(query, opts)
    cu_q = _required(kwargs, "cu_seq_lens_q")
    max_q = _required(kwargs, "max_length_q")
    _check_cu("cu_seq_lens_q", cu_q, query.device)
    cu_k = _required(kwargs, "cu_seq_lens_k")
    max_k = _required(kwargs, "max_length_k")
    if isinstance(cu_k, dict) or isinstance(max_k, dict):
        raise ValueError(
            "continuous-batching keywords are still keyed by layer type: the attention module "
            "did not run the paged cache's update(..., kwargs=kwargs) before attention"
        )
    _check_cu("cu_seq_lens_k", cu_k, query.device)
    _check_counts(cu_q, cu_k)
    block_table = kwargs.get("block_table")
    pages = (kwargs.get("k_cache"), kwargs.get("v_cache"))
    if block_table is not None and (not isinstance(block_table, Tensor) or block_table.dim() != 2):
        raise ValueError(
            "after the paged cache's update, block_table must be this layer group's 2-D "
            f"(requests, max blocks per request) table, got {type(block_table).__name__} "
            f"{tuple(getattr(block_table, 'shape', ()))}"
        )
    return _step(module, query, key, value, cu_q, cu_k, max_q, max_k, block_table, pages, opts)


def _step(module, query, key, value, cu_q, cu_k, max_q, max_k, block_table, pages, opts):
    cu_k = cu_k.to(torch.int32)
    q, k, v = (t.transpose(1, 2)[0] for t in (query, key, value))  # (tokens, heads, D)
    q, k, v = cast_to_kernel_dtype(module, q, k, v)
    if block_table is not None:
        out = _decode_fast_path(q, k, v, pages, block_table, cu_k, opts)
    else:
        # The manager built cu_seqlens itself; padded steps end before the last token, so the
        # API's host-side check (cu[-1] == tokens, one sync) does not apply: shapes only.
        out = varlen_attention(
            q, k, v, cu_q.to(torch.int32), cu_k, as_int(max_q), as_int(max_k),
            softmax_scale=opts["softmax_scale"], causal=opts["causal"],
            window_size=opts["window_size"], softcap=opts["softcap"], check_cu_seqlens=False,
            learnable_sink=opts["learnable_sink"],
        )  # fmt: skip
    return out.unsqueeze(0)


def _decode_fast_path(q, k, v, pages, block_table, cu_k, opts) -> Tensor:
    """One new token per request, appended and attended by the paged kernel."""
    k_cache, v_cache = pages
    if k_cache is None or v_cache is None:
        raise ValueError(
            "the paged cache gave a block_table but no k_cache/v_cache page views for this layer"
        )
    page_size = k_cache.shape[1]
    if page_size % PAGE_MULTIPLE:
        raise ValueError(
            f"hf_flash's paged decode needs a page size that is a multiple of {PAGE_MULTIPLE}, "
            f"but the continuous-batching cache uses {page_size}; pass ContinuousBatchingConfig("
            "page_size=256) (transformers' default; block_size=... before 5.20), or "
            "max_blocks_per_request=0 to decode on the varlen path"
        )
    tokens = q.shape[0]
    if tokens != cu_k.numel() - 1:
        raise ValueError(
            f"the block-table (decode) step carries one token per request, but got {tokens} "
            f"tokens for {cu_k.numel() - 1} requests"
        )
    if q.dtype != k_cache.dtype:
        raise ValueError(
            f"the paged cache holds {k_cache.dtype} but attention runs in {q.dtype}; load the "
            "model in the dtype the cache was built with"
        )
    seqlens_k = (cu_k[1:] - cu_k[:-1]).to(torch.int32)  # keys per request, the new one included
    out = append_attend_paged(
        q.unsqueeze(1), k_cache, v_cache, k.unsqueeze(1), v.unsqueeze(1),
        block_table.to(torch.int32), seqlens_k, softmax_scale=opts["softmax_scale"],
        causal=opts["causal"], window_size=opts["window_size"], softcap=opts["softcap"],
        learnable_sink=opts["learnable_sink"],
    )  # fmt: skip
    return out.squeeze(1)


def _check_step(query: Tensor, opts: dict) -> None:
    if query.shape[0] != 1:
        raise ValueError(
            f"continuous batching packs all requests into one row, but query has batch "
            f"{query.shape[0]} (shape {tuple(query.shape)})"
        )
    if opts["dropout_p"] > 0.0:
        raise ValueError(
            "continuous batching is inference-only, but attention dropout is "
            f"{opts['dropout_p']}; call model.eval() first"
        )


def _check_counts(cu_q: Tensor, cu_k: Tensor) -> None:
    if cu_k.numel() != cu_q.numel():
        raise ValueError(
            f"cu_seq_lens_q has {cu_q.numel()} entries but this layer's cu_seq_lens_k has "
            f"{cu_k.numel()}; both must be number of requests + 1"
        )


def _layer_is_sliding(cache, layer_idx: int, api: str) -> bool:
    try:
        if api == "kwargs":
            return cache.layer_to_allocator[layer_idx].layer_type == SLIDING
        return int(cache.sliding_windows[layer_idx]) > 1
    except (KeyError, IndexError, AttributeError) as err:
        raise ValueError(
            f"the paged cache has no pages for layer_idx={layer_idx} ({err!r}); was it built for "
            "this model?"
        ) from err


def _per_layer_type(value, layer_type: str):
    """transformers passes dicts keyed by layer type when a model mixes full and sliding layers,
    the bare value otherwise."""
    if isinstance(value, dict):
        if layer_type not in value:
            raise ValueError(
                f"continuous-batching keywords have entries for {sorted(value)} but not for this "
                f"layer's type {layer_type!r}"
            )
        return value[layer_type]
    return value


def _required(kwargs: dict, name: str):
    value = kwargs.get(name)
    if value is None:
        raise ValueError(
            f"continuous batching needs the keyword {name!r}, which transformers' "
            "continuous-batching manager passes; call the model through generate_batch() or "
            "init_continuous_batching()"
        )
    return value


def _first_present(kwargs: dict, *names: str):
    for name in names:
        if kwargs.get(name) is not None:
            return kwargs[name]
    return _required(kwargs, names[0])


def _check_cu(name: str, cu, device) -> None:
    if not isinstance(cu, Tensor) or cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(
            f"{name} must be a 1-D tensor of number of requests + 1 >= 2 offsets, got "
            f"{type(cu).__name__} {tuple(getattr(cu, 'shape', ()))}"
        )
    if cu.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must hold integers, got {cu.dtype}")
    if cu.device != device:
        raise ValueError(f"{name} is on {cu.device} but the query is on {device}")


def _check_block_table_shape(block_table, query: Tensor, group_idx: Optional[int]) -> None:
    if not isinstance(block_table, Tensor) or block_table.dim() != 3:
        raise ValueError(
            "block_table must be a 3-D tensor (layer groups, requests, max blocks per request), "
            f"got {type(block_table).__name__} {tuple(getattr(block_table, 'shape', ()))}"
        )
    if group_idx is not None and not 0 <= group_idx < block_table.shape[0]:
        raise ValueError(
            f"block_table has {block_table.shape[0]} layer groups; this layer is in group "
            f"{group_idx}"
        )
    if block_table.device != query.device:
        raise ValueError(
            f"block_table is on {block_table.device} but the query is on {query.device}"
        )


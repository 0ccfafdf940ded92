"""Register ``attn_implementation="hf_flash"`` with transformers (5.17 <= version < 6).

What :func:`register` does, each step idempotent:

1. Version gate: transformers outside ``[5.17, 6)``, or a release whose flash loader no longer has
   the shape patched below, raises an ``ImportError`` that says what to install.
2. ``AttentionInterface.register("hf_flash", hf_flash_attention_forward)`` and
   ``AttentionMaskInterface.register("hf_flash", hf_flash_mask)``.
3. The name contains "flash", so transformers treats it as a FlashAttention flavour: at model
   init it calls ``modeling_flash_attention_utils.lazy_import_flash_attention("hf_flash")``,
   whose ``_lazy_imports`` would fall through to the hub-kernel loader and fail. ``_lazy_imports``
   is wrapped so that exactly the name "hf_flash" resolves to hf_flash's flash-attn-compatible
   functions; every other name goes to the original untouched.
4. ``PreTrainedModel._check_and_adjust_attn_implementation`` rejects model classes that cannot
   run on "hf_flash" (no flash support declared, or a fixed list of flash kernels they need),
   before the model is built. ``PreTrainedModel.post_init`` and ``set_attn_implementation`` are
   wrapped so a model built with, or switched to, "hf_flash" is checked (attention sinks are
   rejected here, at load time) and gets the model-family patches enabled by the switches
   (fused RoPE, fused decode); switching away reverts them.
5. Continuous batching (``generate_batch``, :mod:`hf_flash.integration.continuous_batching`):
   transformers 5.17 - 5.19 switch the model to ``"paged|hf_flash"``, so that name is registered
   too (same attention function) and the flash loader resolves it like "hf_flash"; 5.20+ strip
   the ``paged|`` prefix and call "hf_flash" (with ``cache=`` before 5.24; from 5.24 on the
   attention module updates the paged cache itself). transformers enables the
   block-table decode path only for names matching ``flash.*2``/``flash.*3`` on CUDA
   (``continuous_batching.initialization.ensure_decode_fast_path_is_available``); that function
   is wrapped so that for "hf_flash" the path stays on when hf_flash's paged kernel can serve
   it: every layer full attention, a page size that is a multiple of 16, and a CUDA device (or
   Triton's interpreter). Otherwise decoding runs on the varlen path. If that function is
   missing or changed, nothing is wrapped and decoding stays on the varlen path.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
from typing import Optional

import torch

from .._checks import MAX_HEAD_DIM, PAGE_MULTIPLE
from .._runtime import interpreter_active
from . import decode_patch, rope_patch, unpad_patch
from .attention import ATTN_IMPLEMENTATION, hf_flash_attention_forward
from .families import PATCHES
from .masks import hf_flash_mask

logger = logging.getLogger(__name__)

# transformers 5.17 - 5.19 run continuous batching under this name (5.20+ strip the prefix)
PAGED_NAME = "paged|" + ATTN_IMPLEMENTATION

MIN_TRANSFORMERS = "5.17"
MAX_TRANSFORMERS_EXCLUSIVE = "6"

# switch name -> module providing patch_model(model) / revert_model(model), in the order they
# are applied (fused RoPE first: the fused-decode patch wraps the forward it finds)
PATCH_MODULES = dict(zip(PATCHES, (rope_patch, decode_patch, unpad_patch)))

_switches = {name: True for name in PATCHES}
_lock = threading.RLock()  # re-entered when register() itself triggers the import hook
_registered = False
_PATCHED_ATTR = "_hf_flash_patches"  # on a model: names of the family patches applied to it


def register(*, fused_rope: bool = True, fused_decode: bool = True, unpad: bool = True) -> None:
    """See :func:`hf_flash.integration.register`."""
    with _lock:
        ensure_registered()
        # after: importing transformers above may run the import hook, which must not reset these
        _switches["fused_rope"] = bool(fused_rope)
        _switches["fused_decode"] = bool(fused_decode)
        _switches["unpad"] = bool(unpad)


def ensure_registered() -> None:
    """Register with transformers once; leaves the family-patch switches as they are."""
    global _registered
    with _lock:
        if _registered:
            return
        check_transformers_version()
        from transformers import modeling_flash_attention_utils as fa_utils
        from transformers import modeling_utils
        from transformers.masking_utils import AttentionMaskInterface

        _check_flash_loader_shape(fa_utils)
        from hf_flash.rope_scaling import register_rope_types

        register_rope_types()  # configs saved by extend_context(method="ntk") load too
        modeling_utils.AttentionInterface.register(ATTN_IMPLEMENTATION, hf_flash_attention_forward)
        modeling_utils.AttentionInterface.register(PAGED_NAME, hf_flash_attention_forward)
        AttentionMaskInterface.register(ATTN_IMPLEMENTATION, hf_flash_mask)
        if not hasattr(fa_utils._lazy_imports, "__hf_flash_original__"):
            fa_utils._lazy_imports = _wrap_lazy_imports(fa_utils._lazy_imports)
        model_cls = modeling_utils.PreTrainedModel
        if not hasattr(model_cls._check_and_adjust_attn_implementation, "__hf_flash_original__"):
            model_cls._check_and_adjust_attn_implementation = _wrap_check_and_adjust(
                model_cls._check_and_adjust_attn_implementation
            )
        if not hasattr(model_cls.post_init, "__hf_flash_original__"):
            model_cls.post_init = _wrap_post_init(model_cls.post_init)
        if not hasattr(model_cls.set_attn_implementation, "__hf_flash_original__"):
            model_cls.set_attn_implementation = _wrap_set_attn(model_cls.set_attn_implementation)
        _wrap_decode_fast_path_gate()
        _registered = True


def check_transformers_version() -> str:
    """The installed transformers version; ImportError with the fix when it is unsupported."""
    try:
        import transformers
    except ImportError as err:
        raise ImportError(
            "attn_implementation='hf_flash' needs transformers: pip install "
            f"'transformers>={MIN_TRANSFORMERS},<{MAX_TRANSFORMERS_EXCLUSIVE}'"
        ) from err
    from packaging.version import Version

    found = Version(transformers.__version__)
    if not (Version(MIN_TRANSFORMERS) <= found < Version(MAX_TRANSFORMERS_EXCLUSIVE)):
        raise ImportError(
            f"hf_flash supports transformers >= {MIN_TRANSFORMERS}, < {MAX_TRANSFORMERS_EXCLUSIVE}; "
            f"found {transformers.__version__}. Install a supported release: pip install "
            f"'transformers>={MIN_TRANSFORMERS},<{MAX_TRANSFORMERS_EXCLUSIVE}' (the flash-attention "
            "loader hf_flash plugs into changes between major versions)"
        )
    return transformers.__version__


def _check_flash_loader_shape(fa_utils) -> None:
    loader = getattr(fa_utils, "_lazy_imports", None)
    loader = getattr(loader, "__hf_flash_original__", loader)
    expected = ["implementation", "attention_wrapper", "allow_all_kernels"]
    if loader is None or list(inspect.signature(loader).parameters) != expected:
        import transformers

        raise ImportError(
            "transformers.modeling_flash_attention_utils._lazy_imports(implementation, "
            "attention_wrapper, allow_all_kernels) is missing or changed in transformers "
            f"{transformers.__version__}; hf_flash cannot plug into its flash loader. Install "
            f"transformers>={MIN_TRANSFORMERS},<{MAX_TRANSFORMERS_EXCLUSIVE} at a release hf_flash "
            "was tested with (5.17 ... 5.24)"
        )


def flash_functions():
    """What transformers' flash loader returns for "hf_flash" (and "paged|hf_flash"):
    (flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, pad_input, unpad_input).

    transformers only calls these through its own flash attention function, which "hf_flash"
    never runs; the decode fast-path check of continuous batching looks for the third."""
    from hf_flash import interface, kvcache
    from transformers import modeling_flash_attention_utils as fa_utils

    return (
        interface.flash_attn_func,
        interface.flash_attn_varlen_func,
        kvcache.flash_attn_with_kvcache,
        fa_utils._pad_input,
        fa_utils._unpad_input,
    )


def _wrap_lazy_imports(original):
    @functools.wraps(original)
    def _lazy_imports(implementation, attention_wrapper=None, allow_all_kernels=False):
        if implementation in (ATTN_IMPLEMENTATION, PAGED_NAME):
            return flash_functions()
        return original(implementation, attention_wrapper, allow_all_kernels=allow_all_kernels)

    _lazy_imports.__hf_flash_original__ = original
    return _lazy_imports


def _wrap_decode_fast_path_gate() -> None:
    """Keep transformers' block-table decode path on for "hf_flash" where the paged kernel can
    serve it (module docstring, step 5). No-op when the function is missing or changed."""
    try:
        from transformers.generation.continuous_batching import initialization
    except ImportError:
        return
    original = getattr(initialization, "ensure_decode_fast_path_is_available", None)
    if original is None or hasattr(original, "__hf_flash_original__"):
        return
    if list(inspect.signature(original).parameters) != ["config", "cb_config", "user_requested"]:
        return

    @functools.wraps(original)
    def ensure_decode_fast_path_is_available(config, cb_config, user_requested):
        requested = cb_config.max_blocks_per_request
        ours = getattr(config, "_attn_implementation", None) in (ATTN_IMPLEMENTATION, PAGED_NAME)
        if not (ours and requested and paged_decode_supported(config, cb_config)):
            return original(config, cb_config, user_requested)
        # transformers' checks would turn the path off for the name alone (and warn about it)
        original(config, cb_config, False)
        cb_config.max_blocks_per_request = requested

    ensure_decode_fast_path_is_available.__hf_flash_original__ = original
    initialization.ensure_decode_fast_path_is_available = ensure_decode_fast_path_is_available


def paged_decode_supported(config, cb_config) -> bool:
    """Whether continuous batching may decode "hf_flash" models through a block table: all layers
    full attention (transformers keeps sliding-window layers in ring buffers, which a page table
    cannot describe), a page size that is a multiple of 16 (hf_flash's paged kernel), and a
    device the kernels run on."""
    if not (torch.cuda.is_available() or interpreter_active()):
        return False
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        full = getattr(config, "sliding_window", None) is None
    else:
        full = all(t == "full_attention" for t in layer_types)
    if not full:
        return False
    page_size = getattr(cb_config, "page_size", None) or getattr(cb_config, "block_size", None)
    if not isinstance(page_size, int) or page_size % PAGE_MULTIPLE:
        logger.info(
            "hf_flash: continuous batching decodes on the varlen path because the page size "
            "(%s) is not a multiple of %d, which hf_flash's paged kernel needs",
            page_size, PAGE_MULTIPLE,
        )  # fmt: skip
        return False
    return True


def _wrap_check_and_adjust(original):
    @functools.wraps(original)
    def _check_and_adjust_attn_implementation(self, attn_implementation, *args, **kwargs):
        if attn_implementation in (ATTN_IMPLEMENTATION, PAGED_NAME):
            check_model_supported(type(self))
            compatible = getattr(self, "_compatible_flash_implementations", None)
            if compatible is not None and attn_implementation not in compatible:
                # a sink model (check_model_supported let it through): its kernel list is
                # there for the sinks, which hf_flash implements; list hf_flash on this
                # instance so transformers keeps it instead of swapping in the first listed
                self._compatible_flash_implementations = [*compatible, attn_implementation]
        return original(self, attn_implementation, *args, **kwargs)

    _check_and_adjust_attn_implementation.__hf_flash_original__ = original
    return _check_and_adjust_attn_implementation


def check_model_supported(model_cls) -> None:
    """Raise before the model is built when its class cannot run on "hf_flash"."""
    # transformers only runs its own support check for names "flash_attention_<n>", so models
    # whose attention needs more than a padding mask (they declare no flash support) land here.
    if not getattr(model_cls, "_supports_flash_attn", False) and _model_type(model_cls) not in IMAGE_BLOCK_MODEL_TYPES:
        raise ValueError(
            f"{model_cls.__name__} does not support FlashAttention-style attention "
            "(_supports_flash_attn is False), so attn_implementation='hf_flash' cannot run it; "
            "use 'sdpa' or 'eager'"
        )
    # Models that list the flash kernels they need would otherwise swap "hf_flash" for the first
    # of those, behind the user's back; the ones whose list is there for attention sinks run.
    compatible = getattr(model_cls, "_compatible_flash_implementations", None)
    if compatible is not None and _model_type(model_cls) in SINK_MODEL_TYPES:
        return
    if compatible is not None and ATTN_IMPLEMENTATION not in compatible:
        raise ValueError(
            f"{model_cls.__name__} runs only the flash kernels it lists ({list(compatible)}), "
            "for features hf_flash does not implement (such as attention sinks); use "
            "attn_implementation='eager' or 'sdpa'"
        )


def _wrap_post_init(original):
    @functools.wraps(original)
    def post_init(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if _uses_hf_flash(self):
            on_hf_flash_model(self)
        return result

    post_init.__hf_flash_original__ = original
    return post_init


def _wrap_set_attn(original):
    @functools.wraps(original)
    def set_attn_implementation(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if _uses_hf_flash(self):
            on_hf_flash_model(self)
        else:
            revert_family_patches(self)
        return result

    set_attn_implementation.__hf_flash_original__ = original
    return set_attn_implementation


def _uses_hf_flash(model) -> bool:
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None) in (ATTN_IMPLEMENTATION, PAGED_NAME)


def on_hf_flash_model(model) -> None:
    """The single hook point for a model that runs on "hf_flash": load-time checks, then the
    family patches enabled by :func:`register`'s switches. Called from ``post_init`` (each
    ``PreTrainedModel`` in the tree, inner first) and after ``set_attn_implementation``."""
    reject_unsupported(model)
    apply_family_patches(model)


# Model types whose classes declare no flash support only because flash kernels drop the
# bidirectional mask over image tokens (transformers >= 5.24 on Gemma3ForConditionalGeneration:
# "Flash Attention drops the bidirectional mask over image tokens"); hf_flash keeps it (the
# mask function becomes per-row key ranges, :func:`hf_flash.integration.masks.row_key_bounds`),
# tested with a tiny random model against eager.
IMAGE_BLOCK_MODEL_TYPES = frozenset({"gemma3"})

# Model types with attention sinks (``s_aux``, one logit per head in every softmax, no value)
# that hf_flash runs: their fixed flash-kernel list is there for the sinks, which hf_flash's
# kernels take (``learnable_sink``); each is tested with a tiny random model against eager.
SINK_MODEL_TYPES = frozenset({"gpt_oss"})


def _model_type(model_cls) -> Optional[str]:
    return getattr(getattr(model_cls, "config_class", None), "model_type", None)


def reject_unsupported(model) -> None:
    """Raise at load time for features hf_flash does not implement: attention heads wider than
    the kernels take, and attention sinks of a model type hf_flash has not been checked against
    (their meaning is the model's own)."""
    for name, module in model.named_modules():
        if "Attention" not in type(module).__name__:
            continue
        for attr in ("head_dim", "qk_head_dim"):
            size = getattr(module, attr, None)
            if isinstance(size, int) and size > MAX_HEAD_DIM:
                raise ValueError(
                    f"{type(model).__name__} has attention heads of {size} ({name}.{attr}); "
                    f"hf_flash's kernels take head dims up to {MAX_HEAD_DIM}. Load it with "
                    "attn_implementation='sdpa' or 'eager'"
                )
    if _model_type(type(model)) in SINK_MODEL_TYPES:
        return
    for name, module in model.named_modules():
        if isinstance(getattr(module, "sinks", None), torch.Tensor):
            raise ValueError(
                f"{type(model).__name__} uses attention sinks ({name}.sinks) in a model type "
                f"hf_flash has not been checked against (it runs {sorted(SINK_MODEL_TYPES)}); "
                "load it with attn_implementation='eager' or 'sdpa'"
            )


def apply_family_patches(model) -> None:
    """Apply the enabled family patches (in switch order: fused RoPE, then fused decode, which
    wraps the forward it finds). Each ``patch_model`` is idempotent and a no-op for families it
    does not cover; the model records what was applied so that switching away reverts it."""
    applied = set(getattr(model, _PATCHED_ATTR, ()))
    for switch, enabled in _switches.items():
        if not enabled or switch in applied:
            continue
        PATCH_MODULES[switch].patch_model(model)
        applied.add(switch)
    object.__setattr__(model, _PATCHED_ATTR, frozenset(applied))


def revert_family_patches(model) -> None:
    """Undo what :func:`apply_family_patches` applied to this model or any submodel (the inner
    base model records its own patches at its ``post_init``); patches applied by hand stay."""
    records = [m for m in model.modules() if getattr(m, _PATCHED_ATTR, None)]
    applied = set().union(*(getattr(m, _PATCHED_ATTR) for m in records))
    for switch in reversed(PATCHES):
        if switch in applied:
            PATCH_MODULES[switch].revert_model(model)
    for m in records:
        object.__setattr__(m, _PATCHED_ATTR, frozenset())

"""Long-context RoPE scaling: the maths, and :func:`extend_context` for transformers models.

Every method is a plain function of the head's rotary dimension ``dim`` and the RoPE base that
returns ``(inv_freq, attention_factor)``: ``inv_freq[i]`` is the angle per position of feature
pair ``i`` (float32, ``dim / 2`` values) and ``attention_factor`` multiplies cos and sin (so it
scales q·k by its square), as transformers' rotary modules do. Frequencies are computed in
float64 and rounded once.

With ``s`` the extension factor (target length / trained length ``L``) and
``theta_i = base ** (-2i / dim)``:

* Position Interpolation (``linear``; Chen et al. 2023): positions squeezed by ``1/s``, i.e.
  ``theta_i / s``.
* NTK-aware, static (``ntk``; bloc97 2023): a larger base, ``base * s ** (dim / (dim - 2))``, so
  the lowest frequency is interpolated by ``s`` while the highest barely moves.
* Dynamic NTK (``dynamic``; transformers' definition): the same with ``s`` replaced by
  ``s * n / L - (s - 1)`` for a current length ``n > L`` (no change up to ``L``).
* YaRN (``yarn``; Peng et al. 2023): pairs completing more than ``beta_fast`` turns over ``L``
  keep ``theta_i``, pairs with fewer than ``beta_slow`` turns get ``theta_i / s``, and a linear
  ramp over the pair index blends the two in between; attention temperature
  ``0.1 * ln(s) + 1``.
* Llama 3 (``llama3``): wavelengths shorter than ``L / high_freq_factor`` unchanged, longer than
  ``L / low_freq_factor`` divided by ``s``, smooth blend in between; no temperature.

:func:`extend_context` writes these as transformers 5.x ``rope_parameters``; static NTK, which
transformers lacks, is registered under the rope_type ``"ntk_static"`` (a name without
"dynamic", which transformers would recompute per forward).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

__all__ = [
    "default_rope",
    "linear_rope",
    "ntk_rope",
    "dynamic_ntk_rope",
    "yarn_rope",
    "yarn_attention_factor",
    "llama3_rope",
    "extend_context",
    "register_rope_types",
    "METHODS",
    "NTK_STATIC_ROPE_TYPE",
]

NTK_STATIC_ROPE_TYPE = "ntk_static"


def _check_dim_base(dim: int, base: float) -> None:
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 2 or dim % 2:
        raise ValueError(f"dim={dim!r} must be an even int >= 2 (the rotary dimension)")
    if not (isinstance(base, (int, float)) and math.isfinite(base) and base > 1):
        raise ValueError(f"base={base!r} must be a finite number > 1 (the RoPE theta)")


def _check_factor(factor: float) -> None:
    if isinstance(factor, bool) or not isinstance(factor, (int, float)):
        raise TypeError(f"factor must be a number, got {type(factor).__name__}")
    if not (math.isfinite(factor) and factor > 1.0):
        raise ValueError(f"factor={factor} must be a finite number > 1 (the extension ratio)")


def _theta(dim: int, base: float) -> torch.Tensor:
    # float64 so the float32 result is the correctly rounded value
    return base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)


def default_rope(dim: int, base: float = 10000.0) -> Tuple[torch.Tensor, float]:
    """Unscaled RoPE: ``theta_i = base ** (-2i / dim)``; attention factor 1."""
    _check_dim_base(dim, base)
    return _theta(dim, base).float(), 1.0


def linear_rope(dim: int, base: float, factor: float) -> Tuple[torch.Tensor, float]:
    """Position Interpolation: every frequency divided by ``factor``."""
    _check_dim_base(dim, base)
    _check_factor(factor)
    return (_theta(dim, base) / factor).float(), 1.0


def ntk_rope(dim: int, base: float, factor: float) -> Tuple[torch.Tensor, float]:
    """Static NTK-aware scaling: base becomes ``base * factor ** (dim / (dim - 2))``."""
    _check_dim_base(dim, base)
    _check_factor(factor)
    if dim == 2:
        raise ValueError("NTK scaling needs dim > 2 (the exponent dim / (dim - 2) is undefined)")
    return _theta(dim, base * factor ** (dim / (dim - 2))).float(), 1.0


def dynamic_ntk_rope(
    dim: int, base: float, factor: float, original_max_position_embeddings: int, seq_len: int
) -> Tuple[torch.Tensor, float]:
    """Dynamic NTK as transformers defines it, for the current length ``seq_len``.

    ``n = max(seq_len, L)``; base becomes ``base * (factor * n / L - (factor - 1)) ** (dim /
    (dim - 2))``, which is the unscaled base up to ``L``.
    """
    _check_dim_base(dim, base)
    _check_factor(factor)
    length = int(original_max_position_embeddings)
    n = max(int(seq_len), length)
    scale = factor * n / length - (factor - 1)
    return _theta(dim, base * scale ** (dim / (dim - 2))).float(), 1.0


def yarn_attention_factor(factor: float, mscale: float = 1.0) -> float:
    """YaRN's temperature ``0.1 * mscale * ln(factor) + 1`` (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_rope(
    dim: int,
    base: float,
    factor: float,
    original_max_position_embeddings: int,
    *,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    attention_factor: Optional[float] = None,
    mscale: Optional[float] = None,
    mscale_all_dim: Optional[float] = None,
    truncate: bool = True,
) -> Tuple[torch.Tensor, float]:
    """YaRN ("NTK-by-parts" frequencies plus attention temperature).

    Pair ``i`` turns ``L * theta_i / (2 pi)`` times over the trained length ``L``. Solving for
    the pair index that turns exactly ``r`` times gives ``d(r) = dim * ln(L / (2 pi r)) /
    (2 ln base)``. Pairs below ``low = d(beta_fast)`` keep ``theta_i`` (extrapolate), pairs
    above ``high = d(beta_slow)`` use ``theta_i / factor`` (interpolate), with a linear ramp in
    between (``low``/``high`` rounded outwards when ``truncate``, as the reference code does).
    The attention factor defaults to :func:`yarn_attention_factor` (or, with both ``mscale`` and
    ``mscale_all_dim``, the ratio of the two temperatures, as DeepSeek configs specify).
    """
    _check_dim_base(dim, base)
    _check_factor(factor)
    if not beta_fast > beta_slow > 0:
        raise ValueError(f"need beta_fast > beta_slow > 0, got {beta_fast} and {beta_slow}")
    length = int(original_max_position_embeddings)

    def pair_index(turns: float) -> float:
        return dim * math.log(length / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_index(beta_fast), pair_index(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a step instead of a ramp; avoids 0/0
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    theta = _theta(dim, base)
    inv_freq = theta * (1 - ramp) + (theta / factor) * ramp
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_attention_factor(factor, mscale) / yarn_attention_factor(
                factor, mscale_all_dim
            )
        else:
            attention_factor = yarn_attention_factor(factor)
    return inv_freq.float(), float(attention_factor)


def llama3_rope(
    dim: int,
    base: float,
    factor: float,
    original_max_position_embeddings: int,
    *,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
) -> Tuple[torch.Tensor, float]:
    """Llama 3.1 band scaling; attention factor 1.

    With wavelength ``w_i = 2 pi / theta_i`` and ``L`` the trained length: ``w_i < L /
    high_freq_factor`` keeps ``theta_i``; ``w_i > L / low_freq_factor`` uses ``theta_i /
    factor``; in between ``(1 - a) theta_i / factor + a theta_i`` with ``a = (L / w_i -
    low_freq_factor) / (high_freq_factor - low_freq_factor)``.
    """
    _check_dim_base(dim, base)
    _check_factor(factor)
    if not high_freq_factor > low_freq_factor > 0:
        raise ValueError(
            f"need high_freq_factor > low_freq_factor > 0, got {high_freq_factor} and "
            f"{low_freq_factor}"
        )
    length = float(original_max_position_embeddings)
    theta = _theta(dim, base)
    wavelen = 2 * math.pi / theta
    a = (length / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - a) * theta / factor + a * theta
    out = torch.where(wavelen > length / low_freq_factor, theta / factor, blended)
    out = torch.where(wavelen < length / high_freq_factor, theta, out)
    return out.float(), 1.0


# --------------------------------------------------------------------------------------------
# transformers config / model side
# --------------------------------------------------------------------------------------------

# method name (and aliases) -> rope_type written into the config
METHODS = {
    "linear": "linear",
    "pi": "linear",
    "ntk": NTK_STATIC_ROPE_TYPE,
    NTK_STATIC_ROPE_TYPE: NTK_STATIC_ROPE_TYPE,
    "dynamic": "dynamic",
    "dynamic_ntk": "dynamic",
    "yarn": "yarn",
    "llama3": "llama3",
}

_OPTIONS = {
    "yarn": {"beta_fast", "beta_slow", "attention_factor"},
    "llama3": {"low_freq_factor", "high_freq_factor"},
}


def _rotary_dim(config) -> Tuple[int, dict]:
    rp = config.rope_parameters
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return int(head_dim * rp.get("partial_rotary_factor", 1.0)), rp


def _ntk_static_init(config, device=None, seq_len=None, layer_type=None):
    """``ROPE_INIT_FUNCTIONS`` entry for rope_type "ntk_static" (transformers' signature)."""
    if layer_type is not None:
        rp = config.rope_parameters[layer_type]
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dim = int(head_dim * rp.get("partial_rotary_factor", 1.0))
    else:
        dim, rp = _rotary_dim(config)
    inv_freq, factor = ntk_rope(dim, float(rp["rope_theta"]), float(rp["factor"]))
    return inv_freq.to(device) if device is not None else inv_freq, factor


def _validate_ntk_static(self, rope_parameters, ignore_keys=None):
    required = {"rope_type", "factor"}
    optional = {"rope_theta", "original_max_position_embeddings"}
    self._check_received_keys(
        rope_parameters["rope_type"], set(rope_parameters), required, optional, ignore_keys=ignore_keys
    )
    factor = rope_parameters["factor"]
    if not isinstance(factor, (int, float)) or factor <= 1:
        raise ValueError(f"rope_parameters['factor']={factor!r} must be a number > 1 for ntk_static")


def register_rope_types() -> None:
    """Teach transformers the "ntk_static" rope_type (idempotent).

    Needed before loading a model whose saved config uses it; importing :mod:`hf_flash.rope_scaling` (or
    calling :func:`extend_context`) does it.
    """
    from transformers import modeling_rope_utils as mru

    mru.ROPE_INIT_FUNCTIONS.setdefault(NTK_STATIC_ROPE_TYPE, _ntk_static_init)
    mixin = mru.RotaryEmbeddingConfigMixin
    name = f"_validate_{NTK_STATIC_ROPE_TYPE}_rope_parameters"
    if not hasattr(mixin, name):
        setattr(mixin, name, _validate_ntk_static)


register_rope_types()


def _find_config(config_or_model):
    import torch.nn as nn

    if isinstance(config_or_model, nn.Module):
        config = getattr(config_or_model, "config", None)
        if config is None:
            raise TypeError(
                f"{type(config_or_model).__name__} has no .config; pass a transformers model or "
                "its config"
            )
        return config, config_or_model
    if not hasattr(config_or_model, "rope_parameters"):
        raise TypeError(
            f"expected a transformers PreTrainedConfig with rope_parameters (5.x) or a model, got "
            f"{type(config_or_model).__name__}"
        )
    return config_or_model, None


def extend_context(
    config_or_model,
    target_length: int,
    method: str = "yarn",
    factor: Optional[float] = None,
    **options,
):
    """Rewrite a transformers 5.x config (and a live model's rotary buffers) for a longer context.

    Arguments:
        config_or_model: a ``PreTrainedConfig`` or a model (PEFT-wrapped models too) whose
            config has flat ``rope_parameters`` of rope_type "default" (or already of the
            requested method with ``original_max_position_embeddings``, which is then re-targeted
            from that original length).
        target_length: int. Context length to support; must exceed the original length.
        method: "yarn" (default), "linear" (alias "pi"), "ntk" (static NTK, rope_type
            "ntk_static"), "dynamic" (transformers' dynamic NTK) or "llama3".
        factor: float > 1. Extension ratio; default ``target_length / original length``.
        options: method options written into rope_parameters: yarn ``beta_fast`` (32),
            ``beta_slow`` (1), ``attention_factor`` (0.1 ln(factor) + 1); llama3
            ``low_freq_factor`` (1), ``high_freq_factor`` (4).

    Effect: ``config.rope_parameters`` becomes a valid rope dict for the method and
    ``config.max_position_embeddings`` becomes ``target_length``, except for "dynamic":
    transformers measures the dynamic scale against ``max_position_embeddings``, which must
    therefore stay the original length. On a model, every rotary module using this config is
    rebuilt on its device (float32 frequencies). Returns ``config_or_model``.
    """
    config, model = _find_config(config_or_model)
    register_rope_types()
    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(f"unknown method {method!r}; supported: {sorted(METHODS)}")
    rope_type = METHODS[method]
    allowed = _OPTIONS.get(rope_type, set())
    unknown = set(options) - allowed
    if unknown:
        raise TypeError(
            f"unexpected options {sorted(unknown)} for method {method!r}; it accepts "
            f"{sorted(allowed) or 'none'}"
        )
    if isinstance(target_length, bool) or not isinstance(target_length, int):
        raise TypeError(f"target_length must be an int, got {type(target_length).__name__}")

    rp = dict(config.rope_parameters or {})
    if not rp or "rope_theta" not in rp or any(isinstance(v, dict) for v in rp.values()):
        raise ValueError(
            "extend_context needs flat transformers 5.x rope_parameters with rope_theta (one RoPE "
            f"for all layers); got {config.rope_parameters!r}"
        )
    current = rp.get("rope_type", "default")
    if current == "default":
        original = int(config.max_position_embeddings)
    elif current == rope_type and "original_max_position_embeddings" in rp:
        original = int(rp["original_max_position_embeddings"])
    else:
        raise ValueError(
            f"the model already uses rope_type {current!r}; extend_context rewrites default RoPE, "
            f"or re-targets a {rope_type!r} config that records original_max_position_embeddings"
        )
    if target_length <= original:
        raise ValueError(
            f"target_length={target_length} must exceed the original context length {original}"
        )
    factor = target_length / original if factor is None else factor
    _check_factor(factor)

    new = {"rope_type": rope_type, "rope_theta": rp["rope_theta"], "factor": float(factor)}
    if "partial_rotary_factor" in rp:
        new["partial_rotary_factor"] = rp["partial_rotary_factor"]
    if rope_type in ("yarn", "llama3", NTK_STATIC_ROPE_TYPE):
        new["original_max_position_embeddings"] = original
    if rope_type == "yarn":
        new["beta_fast"] = float(options.get("beta_fast", 32.0))
        new["beta_slow"] = float(options.get("beta_slow", 1.0))
        if options.get("attention_factor") is not None:
            new["attention_factor"] = float(options["attention_factor"])
    if rope_type == "llama3":
        new["low_freq_factor"] = float(options.get("low_freq_factor", 1.0))
        new["high_freq_factor"] = float(options.get("high_freq_factor", 4.0))

    config.rope_parameters = new
    config.max_position_embeddings = original if rope_type == "dynamic" else int(target_length)
    config.validate_rope()
    if model is not None:
        _rebuild_rotary_modules(model, config)
    return config_or_model


def _rebuild_rotary_modules(model, config) -> int:
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if getattr(child, "config", None) is config and hasattr(child, "inv_freq") and hasattr(
                child, "rope_type"
            ):
                fresh = type(child)(config=config)
                fresh.to(child.inv_freq.device)
                setattr(parent, name, fresh)
                count += 1
    if count == 0:
        raise ValueError(
            f"no rotary embedding module built from this config was found in "
            f"{type(model).__name__}; extend the config before building the model instead"
        )
    return count


def inv_freq_for_config(config, seq_len: Optional[int] = None) -> Tuple[torch.Tensor, float]:
    """hf_flash's maths applied to a transformers config (what its rotary module should hold)."""
    dim, rp = _rotary_dim(config)
    base = float(rp["rope_theta"])
    kind = rp.get("rope_type", "default")
    if kind == "default":
        return default_rope(dim, base)
    if kind == "linear":
        return linear_rope(dim, base, rp["factor"])
    if kind == NTK_STATIC_ROPE_TYPE:
        return ntk_rope(dim, base, rp["factor"])
    if kind == "dynamic":
        return dynamic_ntk_rope(dim, base, rp["factor"], config.max_position_embeddings,
                                seq_len or config.max_position_embeddings)  # fmt: skip
    if kind == "yarn":
        return yarn_rope(
            dim, base, rp["factor"], rp["original_max_position_embeddings"],
            beta_fast=rp.get("beta_fast") or 32.0, beta_slow=rp.get("beta_slow") or 1.0,
            attention_factor=rp.get("attention_factor"), mscale=rp.get("mscale"),
            mscale_all_dim=rp.get("mscale_all_dim"), truncate=rp.get("truncate", True),
        )  # fmt: skip
    if kind == "llama3":
        return llama3_rope(
            dim, base, rp["factor"], rp["original_max_position_embeddings"],
            low_freq_factor=rp["low_freq_factor"], high_freq_factor=rp["high_freq_factor"],
        )  # fmt: skip
    raise ValueError(f"rope_type {kind!r} is not one of hf_flash's methods")

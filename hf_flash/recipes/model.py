"""Model side of the recipe: the embedded tiny model, loading with hf_flash, RoPE extension,
LoRA, the loss wrapper, and the start-up memory prediction."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from .config import MAX_ROPE_FACTOR, ConfigError
from hf_flash.training.loss import (
    chunked_linear_cross_entropy, full_linear_cross_entropy, liger_linear_cross_entropy,
)

TINY_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=32,
)
"""Embedded default: head_dim 32, GQA 2:1, original context 32 tokens (so any recipe seq_len
above 32 exercises RoPE scaling). Small enough for Triton's CPU interpreter."""


def build_tiny_model(path: Path, family: str, vocab_size: int, seed: int) -> Path:
    """Write a randomly initialised tiny Llama or Mistral to ``path`` (idempotent)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig

    if (path / "config.json").is_file():
        return path
    common = dict(TINY_SHAPE, vocab_size=vocab_size, bos_token_id=256, eos_token_id=257,
                  pad_token_id=None, tie_word_embeddings=False)
    if family == "llama":
        config = LlamaConfig(**common)
    else:
        config = MistralConfig(**common, sliding_window=TINY_SHAPE["max_position_embeddings"])
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp)
    from .data import ByteTokenizer

    ByteTokenizer().save_pretrained(tmp)
    tmp.rename(path)
    return path


def require_attention(name: str) -> None:
    """Fail early, with the reason, when ``name`` is not an attention implementation we can use."""
    from transformers import AttentionInterface

    if name == "hf_flash":
        try:
            import hf_flash

            register = getattr(hf_flash, "register", None)
            if register is not None:
                register()
        except Exception as e:  # the integration itself failed: say so, never fall back
            raise ConfigError(f"attn_implementation='hf_flash': registering hf_flash failed: {e}") from e
    builtin = {"eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3"}
    if name not in builtin and name not in AttentionInterface._global_mapping:
        raise ConfigError(
            f"attn_implementation={name!r} is not registered with transformers"
            + (
                " (hf_flash's transformers integration, hf_flash.integration, is not available in "
                "this installation). Use another attn_implementation explicitly if you must."
                if name == "hf_flash" else ""
            )
        )


def original_context(config) -> int:
    rope = getattr(config, "rope_parameters", None) or {}
    orig = rope.get("original_max_position_embeddings") if isinstance(rope, dict) else None
    return int(orig or config.max_position_embeddings)


def check_context(config, cfg) -> None:
    """``cfg.seq_len`` against what the model's RoPE allows: within its context without
    rope_method, above its original context with one, and at most :data:`MAX_ROPE_FACTOR` times
    it. Raises ConfigError. Runs before the data is built (a huge seq_len would otherwise spend
    minutes synthesising documents first)."""
    orig = original_context(config)
    if cfg.rope_method == "none":
        if cfg.seq_len > config.max_position_embeddings:
            raise ConfigError(
                f"seq_len={cfg.seq_len} exceeds the model's context ({config.max_position_embeddings}) "
                f"and rope_method is 'none'; choose rope_method yarn, pi or ntk"
            )
        return
    if cfg.seq_len <= orig:
        raise ConfigError(
            f"rope_method={cfg.rope_method!r} extends the context, but seq_len={cfg.seq_len} is not "
            f"above the model's original context of {orig} tokens; raise seq_len or set rope_method: none"
        )
    limit = orig * MAX_ROPE_FACTOR
    if cfg.seq_len > limit:
        raise ConfigError(
            f"seq_len={cfg.seq_len} is {cfg.seq_len / orig:.0f}x the model's original context of {orig} "
            f"tokens, beyond the {MAX_ROPE_FACTOR}x the recipe's RoPE scaling accepts; use seq_len <= {limit}"
        )


def extend_rope(config, cfg, log=print) -> None:
    """Apply hf_flash.extend_context to ``config`` for ``cfg.seq_len`` (or check none is needed)."""
    check_context(config, cfg)
    orig = original_context(config)
    if cfg.rope_method == "none":
        return
    try:
        from hf_flash import rope_scaling as hf_rope
    except ImportError as e:
        raise ConfigError(
            f"rope_method={cfg.rope_method!r} needs hf_flash.rope_scaling.extend_context, which this "
            f"installation lacks ({e})"
        ) from e
    hf_rope.extend_context(config, cfg.seq_len, method=cfg.rope_method, factor=cfg.rope_factor)
    log(f"rope: {cfg.rope_method} from {orig} to {cfg.seq_len} tokens: {config.rope_parameters}")


def load_model(cfg, model_path: Path, log=print, device: Optional[torch.device] = None):
    """Load (or, with ``random_init``, build) the model with the RoPE extension applied to its
    config first. ``device``: where to place it directly (None: the CPU)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    require_attention(cfg.attn_implementation)
    config = AutoConfig.from_pretrained(model_path)
    extend_rope(config, cfg, log)
    dtype = getattr(torch, cfg.dtype)
    if cfg.random_init:
        with torch.device(device or "cpu"):
            model = AutoModelForCausalLM.from_config(
                config, dtype=dtype, attn_implementation=cfg.attn_implementation
            )
    else:
        model = AutoModelForCausalLM.from_pretrained(
            model_path, config=config, dtype=dtype, attn_implementation=cfg.attn_implementation,
            device_map={"": device} if device is not None and device.type == "cuda" else None,
        )
    got = model.config._attn_implementation
    if got != cfg.attn_implementation:
        raise ConfigError(f"asked for attn_implementation={cfg.attn_implementation!r}, model uses {got!r}")
    for attr in ("final_logit_softcapping", "logit_scale"):
        if getattr(model.config, attr, None) not in (None, 1.0):
            raise ConfigError(
                f"model config sets {attr}; the recipe's linear cross-entropy does not apply it"
            )
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ConfigError("the model's LM head has a bias; the recipe's linear cross-entropy does not support it")
    return model


def apply_lora(model, cfg, autocast: bool = False, checkpointing: bool = True):
    """peft LoRA on ``cfg.lora_target_modules``. ``autocast``: the forward runs under bf16/fp16
    autocast (the recipe's mixed precision): peft's input casts are then skipped
    (``hf_flash.training.keep_lora_inputs_under_autocast``). ``checkpointing``:
    switch on ``cfg.gradient_checkpointing`` here (False: :func:`plan_memory` does it)."""
    from peft import LoraConfig, get_peft_model

    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    missing = [t for t in cfg.lora_target_modules if t not in names]
    if missing:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ConfigError(
            f"lora_target_modules {missing} match no module of this model; linear modules are: {linear}"
        )
    if cfg.gradient_checkpointing and checkpointing:
        from hf_flash.checkpointing import enable_activation_checkpointing

        enable_activation_checkpointing(model, checkpointing_kwargs(cfg))
    model.config.use_cache = False
    lora = LoraConfig(
        r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
        target_modules=list(cfg.lora_target_modules), bias="none", task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, lora)
    if autocast:
        from hf_flash.training import keep_lora_inputs_under_autocast

        keep_lora_inputs_under_autocast(model)
    return model


def checkpointing_kwargs(cfg) -> dict:
    """``torch.utils.checkpoint`` options for transformers' gradient checkpointing: non-reentrant,
    keeping hf_flash's attention outputs when ``cfg.keeps_attention_outputs()``."""
    if not cfg.keeps_attention_outputs():
        return {"use_reentrant": False}
    try:
        from hf_flash import gradient_checkpointing_kwargs
    except ImportError as e:
        raise ConfigError(
            f"keep_attention_outputs needs hf_flash.gradient_checkpointing_kwargs, which this "
            f"installation lacks ({e}); set keep_attention_outputs: false"
        ) from e
    return gradient_checkpointing_kwargs(keep_attention=True)


class CausalLMWithLinearCE(nn.Module):
    """Runs the decoder, then the LM head fused with the loss; returns the summed token loss.

    Wrapping both in one module keeps DDP/FSDP hooks on the whole forward while the logits are
    never materialised. The wrapper deliberately has no ``get_output_embeddings``: accelerate's
    FSDP2 preparation would then shard the LM head as a unit of its own, gathered only when that
    module is called, while the loss reads its weight directly; in the root unit it is gathered
    for the whole forward.
    """

    def __init__(self, peft_model, loss_impl: str, chunk_tokens: Optional[int]):
        super().__init__()
        self.model = peft_model
        base = peft_model.get_base_model()
        self._no_split_modules = getattr(base, "_no_split_modules", None)  # FSDP auto-wrap
        if loss_impl == "chunked":
            self._loss = lambda h, w, y: chunked_linear_cross_entropy(h, w, y, chunk_tokens)
        elif loss_impl == "liger":
            self._loss = liger_linear_cross_entropy()
        else:
            self._loss = full_linear_cross_entropy

    def forward(self, input_ids, position_ids, labels, **attn_kwargs):
        base = self.model.get_base_model()
        out = base.get_decoder()(
            input_ids=input_ids, position_ids=position_ids, use_cache=False, **attn_kwargs
        )
        hidden = out.last_hidden_state
        hidden = hidden.reshape(-1, hidden.shape[-1])
        return self._loss(hidden, base.get_output_embeddings().weight, labels.reshape(-1))


def predict_memory_gib(model, cfg, world_size: int, fsdp: bool) -> float:
    """Peak memory per device of one training step with the configuration as given
    (``memory_plan: fixed``, FSDP, ``sp_size > 1``): hf_flash.training's memory model
    (:func:`hf_flash.training.plan.predict`) for the checkpointing form the options ask for, with
    the weights sharded ``world_size`` ways under FSDP and ``1 / sp_size`` of the tokens per rank
    (the kept attention output too: all tokens for ``heads / sp_size`` heads, the same bytes);
    attention implementations other than hf_flash and sdpa also materialise the scores and
    probabilities of one layer."""
    import dataclasses

    from hf_flash.training.plan import GIB, SLACK, Shape, predict

    tokens = cfg.micro_batch_size * cfg.seq_len // cfg.sp_size
    wbytes = torch.finfo(getattr(torch, cfg.dtype)).bits // 8
    act = 2 if cfg.mixed_precision != "no" or wbytes == 2 else 4
    shape = Shape.of(model)
    if fsdp and world_size > 1:
        shape = dataclasses.replace(shape, param_bytes=shape.param_bytes // world_size)
    if not cfg.gradient_checkpointing:
        form = "none"
    else:
        form = "keep_attention" if cfg.keeps_attention_outputs() else "recompute"
    device_gib, _ = predict(shape, tokens, checkpointing=form, chunked_loss=cfg.loss_impl != "full",
                            tiled_mlp_tokens=None, act_bytes=act, loss_chunk_tokens=cfg.loss_chunk_tokens)  # fmt: skip
    if cfg.attn_implementation not in ("hf_flash", "sdpa"):
        device_gib += shape.heads * cfg.seq_len * tokens * 4 * 2 * SLACK / GIB
    return device_gib


def plan_memory(model, cfg, device, log=print):
    """memory_plan auto: ``hf_flash.training.enable`` on the LoRA model for one micro-batch of
    ``cfg.seq_len`` tokens per row (the recipe's own chunked loss counted, not patched in).
    Raises ConfigError when no setting is predicted to fit, unless ``skip_memory_check``."""
    from hf_flash.training import enable

    if not cfg.gradient_checkpointing:
        form = "none"
    elif cfg.keep_attention_outputs is None:
        form = "on" if cfg.attn_implementation == "hf_flash" else "no_keep"
    else:
        form = "keep_attention" if cfg.keep_attention_outputs else "no_keep"
    tiled = "auto" if cfg.tiled_mlp_tokens is None else (cfg.tiled_mlp_tokens or False)
    offload = "auto" if cfg.offload_activations is None else cfg.offload_activations
    plan = enable(
        model, seq_len=cfg.seq_len, micro_batch_size=cfg.micro_batch_size, checkpointing=form,
        chunked_loss="external" if cfg.loss_impl != "full" else False, tiled_mlp=tiled,
        offload=offload, liger="auto" if cfg.liger_norm_mlp is None else cfg.liger_norm_mlp, device=device, device_budget_gib=available_memory_gib(cfg, device), log=log,
    )  # fmt: skip
    if not plan.fits and not cfg.skip_memory_check:
        host = f" and {plan.host_gib:.1f} GiB of pinned host memory" if plan.host_gib else ""
        raise ConfigError(
            f"predicted peak memory {plan.device_gib:.1f} GiB per device{host} with the most frugal memory "
            f"plan ({plan.name}) exceeds the {plan.device_budget_gib or 0:.1f} GiB available (seq_len="
            f"{cfg.seq_len}, micro_batch_size={cfg.micro_batch_size}); lower seq_len or micro_batch_size, "
            f"or set skip_memory_check: true to try anyway"
        )
    return plan


def plan_summary(plan) -> dict:
    """The plan's fields for summary.json."""
    return {
        "memory_plan": plan.name, "checkpointing": plan.checkpointing,
        "tiled_mlp_tokens": plan.tiled_mlp_tokens, "offload_activations": plan.checkpointing == "offload",
        "liger": "+".join(plan.liger) or "off",
        "predicted_peak_gib": round(plan.device_gib, 2), "predicted_host_gib": round(plan.host_gib, 2),
    }  # fmt: skip


def available_memory_gib(cfg, device) -> Optional[float]:
    if cfg.max_memory_gib is not None:
        return float(cfg.max_memory_gib)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 2**30
    return None


def check_memory(model, cfg, device, world_size: int, fsdp: bool, log=print) -> float:
    need = predict_memory_gib(model, cfg, world_size, fsdp)
    have = available_memory_gib(cfg, device)
    if have is not None and not cfg.skip_memory_check and need > have:
        raise ConfigError(
            f"predicted peak memory {need:.1f} GiB per device exceeds the {have:.1f} GiB available "
            f"(seq_len={cfg.seq_len}, micro_batch_size={cfg.micro_batch_size}); lower seq_len or "
            f"micro_batch_size, enable gradient_checkpointing, shard with FSDP, or set "
            f"skip_memory_check: true to try anyway"
        )
    log(f"memory: predicted peak {need:.2f} GiB per device" + (f" of {have:.1f} GiB" if have else ""))
    return need


def count_parameters(model) -> tuple[int, int]:
    total = sum(p.numel() for p in model.parameters())
    train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return total, train


def human(n: float) -> str:
    for unit in ("", "K", "M", "B"):
        if abs(n) < 1000:
            return f"{n:.3g}{unit}"
        n /= 1000
    return f"{n:.3g}T"


def lr_lambda(cfg):
    """Linear warmup to 1, then cosine down to ``min_lr_ratio`` at ``max_steps``."""
    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        span = max(1, cfg.max_steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return f

"""``hf_flash.training.enable``: one call that prepares a transformers model for long-context
training on one GPU, for ``Trainer``, TRL's ``SFTTrainer``, or a loop of your own."""

from __future__ import annotations

import types
from typing import Callable, Optional, Union

import torch

from . import causal_lm
from .plan import Plan, Shape, device_available_gib, host_available_gib, make_plan

_PLAN_ATTR = "_hf_flash_training_plan"


def _base(model):
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _act_bytes(model, autocast: Optional[bool]) -> int:
    if autocast:
        return 2
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point() and not p.requires_grad}
    dtypes = dtypes or {p.dtype for p in model.parameters() if p.is_floating_point()}
    return 2 if dtypes and all(d in (torch.bfloat16, torch.float16) for d in dtypes) else 4


def _tri(name: str, value) -> Optional[bool]:
    if value in ("auto", None):
        return None
    if isinstance(value, bool):
        return value
    raise ValueError(f"{name}={value!r}; pass True, False or 'auto'")


def enable(
    model,
    *,
    seq_len: Optional[int] = None,
    micro_batch_size: int = 1,
    tokens: Optional[int] = None,
    checkpointing: str = "auto",
    chunked_loss: Union[bool, str] = "auto",
    tiled_mlp: Union[bool, int, str] = "auto",
    offload: Union[bool, str] = "auto",
    liger: Union[bool, str] = "auto",
    autocast: Optional[bool] = None,
    device: Optional[Union[str, torch.device]] = None,
    device_budget_gib: Optional[float] = None,
    host_budget_gib: Optional[float] = None,
    log: Optional[Callable[[str], None]] = print,
) -> Plan:
    """Plan and switch on the memory features a training run of ``model`` needs, and nothing else.

    Arguments:
        model: a transformers causal LM loaded with ``attn_implementation="hf_flash"``, or peft's
            wrapper of one (call it after ``get_peft_model``, so the plan counts the adapters).
        seq_len, micro_batch_size: tokens per row and rows per micro-batch; or ``tokens``: their
            product (a packed row of ``DataCollatorWithFlattening`` holds ``per_device_train_batch_size``
            documents: pass the longest row you expect).
        checkpointing: ``"auto"`` (the plan's choice), ``"on"`` (the plan's choice among the
            checkpointing forms), ``"no_keep"`` (recompute or offload), ``"none"``,
            ``"keep_attention"``, ``"recompute"`` or ``"offload"``.
        chunked_loss, tiled_mlp, offload: ``"auto"`` or True/False to force; ``tiled_mlp`` may be
            an int, the tokens per MLP chunk. ``chunked_loss="external"``: the caller computes a
            chunked loss of its own (hf_flash's recipe, TRL's fused LM head); planned as chunked,
            the model's forward is left alone.
        liger: run the model's RMSNorms and SwiGLU MLPs on Liger-Kernel's fused functions
            (:mod:`hf_flash.training.fused_ops`: less memory per layer, the norms' float32 copies
            gone). ``"auto"``: when liger-kernel is installed, training runs on CUDA and the model
            type is supported (the plan's notes say why not otherwise); True: required (an error
            names what is missing); False: transformers' own.
        autocast: whether the forward runs under bf16/fp16 autocast (``Trainer``'s ``bf16=True``
            with fp32 weights); None reads the weights' dtype. Only sizes activations.
        device: where training runs (default: the model's device, or the current CUDA device when
            the model is still on the CPU and CUDA is available).
        device_budget_gib, host_budget_gib: memory the plan may use (default: the device's free
            memory plus what this process holds; the host's MemAvailable).
        log: where the plan is printed (None: silent).

    Returns the :class:`~hf_flash.training.plan.Plan`, also kept on the model. What it switches on:
    activation checkpointing (through transformers; later ``activation_checkpointing_enable``
    calls, e.g. from ``TrainingArguments(gradient_checkpointing=True)``, keep the planned form),
    the chunked loss in the model's training forward, Liger-Kernel's RMSNorm and SwiGLU, the
    tiled MLP, the offload of checkpointed layer inputs; and, always, peft's LoRA layers skip their fp32 input cast while autocast is on
    (same bits, one full-size copy less per adapted layer).
    """
    base = _base(model)
    if tokens is None:
        if seq_len is None:
            raise ValueError("pass seq_len (tokens per row; with micro_batch_size) or tokens, so the plan "
                             "knows the size of a micro-batch")  # fmt: skip
        tokens = int(seq_len) * int(micro_batch_size)
    if tokens < 1:
        raise ValueError(f"tokens per micro-batch must be >= 1, got {tokens}")
    if checkpointing not in ("auto", "on", "no_keep", "none", "keep_attention", "recompute", "offload"):
        raise ValueError(f"checkpointing={checkpointing!r}; choose auto, on, no_keep, none, keep_attention, recompute "
                         "or offload")  # fmt: skip
    allow: dict = {"checkpointing": checkpointing}
    external_loss = chunked_loss == "external"
    want_loss = True if external_loss else _tri("chunked_loss", chunked_loss)
    want_offload = _tri("offload", offload)
    if isinstance(tiled_mlp, int) and not isinstance(tiled_mlp, bool):
        if tiled_mlp < 1:
            raise ValueError(f"tiled_mlp={tiled_mlp}: tokens per chunk must be >= 1")
        allow["tiled_mlp"] = tiled_mlp
    else:
        allow["tiled_mlp"] = _tri("tiled_mlp", tiled_mlp)
    if want_offload is True:
        if checkpointing not in ("auto", "on", "no_keep", "offload"):
            raise ValueError(f"offload=True needs checkpointing 'offload' or 'auto', not {checkpointing!r}")
        allow["checkpointing"] = "offload"
    elif want_offload is False:
        allow["offload"] = False
    problem = None if external_loss else causal_lm.chunked_loss_problem(base)
    if want_loss and problem:
        raise causal_lm.ChunkedLossUnsupported(f"chunked_loss=True: {problem}")
    allow["chunked_loss"] = False if problem else want_loss

    if device is None:
        first = next(base.parameters()).device
        device = first if first.type != "cpu" or not torch.cuda.is_available() else torch.device(
            "cuda", torch.cuda.current_device())  # fmt: skip
    from .fused_ops import liger_problem

    want_liger = _tri("liger", liger)
    liger_reason = liger_problem(model, device) if want_liger is not False else None
    if want_liger and liger_reason:
        raise RuntimeError(f"liger=True: {liger_reason}")
    use_liger = want_liger is not False and liger_reason is None
    budget = device_budget_gib if device_budget_gib is not None else device_available_gib(device)
    host = host_budget_gib if host_budget_gib is not None else host_available_gib()
    shape = Shape.of(model)
    plan = make_plan(shape, tokens, act_bytes=_act_bytes(base, autocast), device_budget_gib=budget,
                     host_budget_gib=host, allow=allow,
                     liger=("rms_norm", "swiglu") if use_liger else ())  # fmt: skip
    _apply(model, plan, apply_loss=not external_loss, device=device)
    setattr(base, _PLAN_ATTR, plan)
    if problem and want_loss is None:
        plan.notes.append(f"the chunked loss is not available: {problem}")
    if liger_reason and want_liger is None:
        plan.notes.append(f"Liger-Kernel's RMSNorm and SwiGLU not used: {liger_reason}")
    if log is not None:
        log(plan.describe())
    return plan


def plan_of(model) -> Optional[Plan]:
    """The plan :func:`enable` applied to ``model`` (None if it was not called)."""
    return getattr(_base(model), _PLAN_ATTR, None)


def _apply(model, plan: Plan, apply_loss: bool = True, device=None) -> None:
    base = _base(model)
    if plan.liger:  # before the tiled MLP, which then tiles the fused forward
        from .fused_ops import use_liger

        use_liger(base, rms_norm="rms_norm" in plan.liger, swiglu="swiglu" in plan.liger, device=device)
    if plan.tiled_mlp_tokens:
        from .tiled_mlp import tile_mlp

        tile_mlp(base, plan.tiled_mlp_tokens)
    if plan.chunked_loss and apply_loss:
        causal_lm.use_chunked_loss(base)
    _apply_checkpointing(base, plan.checkpointing)
    keep_lora_inputs_under_autocast(base)
    # Trainer (TrainingArguments(gradient_checkpointing=True)) calls this after enable(): keep the
    # plan's form, or the fastest one when the plan had none
    setattr(base, _override_name(base), types.MethodType(_planned_checkpointing_enable, base))


def _checkpoint_kwargs(form: str) -> dict:
    from hf_flash.checkpointing import gradient_checkpointing_kwargs

    return gradient_checkpointing_kwargs(keep_attention=form == "keep_attention")


def _override_name(base) -> str:
    # one entry point: 5.23+ routes a gradient_checkpointing_enable override through
    # activation_checkpointing_enable; 5.17 has only gradient_checkpointing_enable
    return ("activation_checkpointing_enable" if hasattr(type(base), "activation_checkpointing_enable")
            else "gradient_checkpointing_enable")  # fmt: skip


def _apply_checkpointing(base, form: str) -> None:
    if form == "none":
        return
    # transformers' own method, not the plan's override (which calls back into here)
    override = base.__dict__.pop(_override_name(base), None)
    try:
        if form == "offload":
            from .offload import offload_checkpoints

            offload_checkpoints(base, checkpoint_kwargs=_checkpoint_kwargs("recompute"))
        else:
            from hf_flash.checkpointing import enable_activation_checkpointing

            enable_activation_checkpointing(base, _checkpoint_kwargs(form))
    finally:
        if override is not None:
            setattr(base, _override_name(base), override)


def _planned_checkpointing_enable(self, *args, **kwargs):
    """Installed on the model by :func:`enable`: a later request for activation checkpointing
    (``Trainer`` with ``gradient_checkpointing=True``, TRL's default) gets the plan's form, or
    keep-attention checkpointing when the plan had none; its own options are not used."""
    plan = getattr(self, _PLAN_ATTR)
    if plan.checkpointing == "none":
        plan.checkpointing = "keep_attention"
    _apply_checkpointing(self, plan.checkpointing)


def keep_lora_inputs_under_autocast(model) -> int:
    """Skip peft's cast of each adapted layer's input while autocast is on; returns the number of
    LoRA layers (0: none, nothing installed).

    peft keeps the adapter weights in fp32 and casts the layer input to fp32 before ``lora_A``;
    under autocast the matmul then casts it back to bf16. The result is the same bits as using the
    bf16 input directly (bf16 -> fp32 -> bf16 is exact, and the gradient takes the same casts in
    reverse), but each cast is a full-size pass over the input: on the 1.2B Llama shape at 32K
    tokens these copies were ~200 ms of a 1.65 s step. Without autocast the cast is what makes the
    fp32 matmul work, so a forward pre-hook on the model sets peft's switch
    (``cast_input_dtype_enabled``) from the autocast state of each forward. Idempotent.
    """
    base = _base(model)
    layers = [m for m in base.modules() if hasattr(m, "cast_input_dtype_enabled") and hasattr(m, "lora_A")]
    if not layers or getattr(base, "_hf_flash_lora_hook", None) is not None:
        return len(layers)
    state = {"cast": None}

    def hook(module, args):
        device_type = next(module.parameters()).device.type
        cast = not torch.is_autocast_enabled(device_type)
        if cast != state["cast"]:
            for layer in layers:
                layer.cast_input_dtype_enabled = cast
            state["cast"] = cast

    base._hf_flash_lora_hook = base.register_forward_pre_hook(hook)
    return len(layers)

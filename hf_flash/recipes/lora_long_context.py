"""Long-context LoRA fine-tuning with hf_flash attention.

    hf-flash-finetune                                     # embedded tiny default (CPU or GPU)
    hf-flash-finetune --config llama-32k --model /models/llama
    accelerate launch --config_file recipes/configs/accelerate_fsdp.yaml \\
        -m hf_flash.recipes.lora_long_context --config llama-64k --model /models/llama
    accelerate launch --config_file recipes/configs/accelerate_fsdp.yaml --num_processes 2 \\
        -m hf_flash.recipes.lora_long_context --config llama-128k --sp_size 2 --model /models/llama
    hf-flash-finetune --config tiny                       # CPU, no downloads, ~2-3 min

(``python -m hf_flash.recipes.lora_long_context`` is the same command; from a checkout,
``python -m recipes.lora_long_context`` too. ``--config NAME`` finds the configs shipped in
``recipes/configs``, installed with the package.)

Steps: validate the options; load the model with ``attn_implementation`` (hf_flash by default)
after extending its RoPE with ``hf_flash.extend_context``; add LoRA; read, tokenise and pack the
documents (restarting ``position_ids``, no padding); check the predicted memory; train with
warmup + cosine, gradient accumulation, gradient checkpointing (keeping hf_flash's attention
outputs, so the attention forward runs once per layer) and a chunked linear cross-entropy; save
atomic checkpoints, the adapter and optionally the merged model. Every option is documented in
:mod:`hf_flash.recipes.config` and listed by ``--help``; see recipes/README.md.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from .checkpoint import (
    RESUME_KEYS, clean_partial, latest_checkpoint, load_checkpoint, save_checkpoint,
    trainable_only_hook,
)
from .config import EMBEDDED_DEFAULT, ConfigError, RecipeConfig, load_config, uses_embedded_default
from .data import IGNORE_INDEX, PackedBatches, build_rows, load_tokenizer
from hf_flash.training.loss import loss_name
from .model import (
    CausalLMWithLinearCE, apply_lora, build_tiny_model, check_context, check_memory, count_parameters,
    plan_memory, plan_summary,
    human, load_model, lr_lambda,
)


def write_atomic(path: Path, text: str) -> None:
    """Write ``path`` through a temporary file and a rename: never left half-written."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _memory_gib(device) -> tuple[float, float]:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**30, torch.cuda.max_memory_allocated(device) / 2**30
    rss = _host_peak_gib()
    return rss, rss


def _host_peak_gib() -> float:
    """This process's peak resident host memory (pinned offload buffers included once touched)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class MetricsLog:
    """Append-only JSONL on the main process; on resume, lines past the checkpoint are dropped."""

    def __init__(self, path: Path, keep_until_step: int, enabled: bool):
        self.path = path
        self.enabled = enabled
        if not enabled:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = []
        if keep_until_step > 0 and path.is_file():
            lines = [l for l in path.read_text().splitlines() if l.strip() and json.loads(l).get("step", 0) <= keep_until_step]
        write_atomic(path, "".join(l + "\n" for l in lines))

    def write(self, row: dict) -> None:
        if self.enabled:
            with self.path.open("a") as fh:
                fh.write(json.dumps(row) + "\n")


@dataclass
class _Run:
    """What the set-up hands to the loop and the final save."""

    cfg: RecipeConfig
    accelerator: Any
    log: Callable[..., None]
    out: Path
    model_path: Path
    tokenizer: Any
    batches: PackedBatches
    wrapper: Any = None  # CausalLMWithLinearCE, prepared by accelerate
    optimizer: Any = None
    scheduler: Any = None
    params: list = field(default_factory=list)  # the trainable parameters, for gradient clipping
    sp: Any = None  # hf_flash's SequenceParallel of this process (sp_size > 1), else None
    plan: Any = None  # hf_flash.training's Plan (memory_plan auto), else None

    @property
    def main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def device(self) -> torch.device:
        return self.accelerator.device


@dataclass
class _Progress:
    """Where the loop stands: the step, the tokens seen, and the throughput of this run's steps."""

    step: int
    tokens_seen: int
    loss: float = float("nan")
    run_tokens: int = 0
    run_time: float = 0.0
    steps_this_run: int = 0


def train(cfg: RecipeConfig) -> dict:
    """Run the recipe; returns a summary (final loss, tokens/s, peak memory, paths)."""
    run = _set_up(cfg)
    _prepare_model(run)
    progress = _resume(run)
    interrupted = _loop(run, progress)
    if interrupted is not None:
        return interrupted
    return _finish(run, progress)


def _set_up(cfg: RecipeConfig) -> _Run:
    """The accelerator, the tokenizer and the packed data (before the model: bad data fails
    before a large model is loaded)."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    accelerator = Accelerator(
        mixed_precision=None if os.environ.get("ACCELERATE_MIXED_PRECISION") else cfg.mixed_precision,
        cpu=not torch.cuda.is_available(),
    )
    main = accelerator.is_main_process
    log = (lambda *a: print(*a, flush=True)) if main else (lambda *a: None)
    device = accelerator.device
    out = Path(cfg.output_dir)
    set_seed(cfg.seed)
    log(f"accelerate: {accelerator.num_processes} process(es), {accelerator.distributed_type.value}, "
        f"backend {accelerator.state.backend}, device {device}, mixed precision {accelerator.mixed_precision}")
    dp_rank, dp_size = accelerator.process_index, accelerator.num_processes
    if cfg.sp_size > 1:
        from hf_flash.integration.sequence_parallel import (
            SequenceParallelError, check_sequence_parallel, require_deepspeed,
        )

        try:
            check_sequence_parallel(None, cfg.sp_size, seq_len=cfg.seq_len, world_size=accelerator.num_processes,
                                    attn_implementation=cfg.attn_implementation)
            require_deepspeed()
        except SequenceParallelError as e:
            raise ConfigError(str(e)) from e
        # DeepSpeed's layout: consecutive ranks share a sequence; each group is one data replica
        dp_rank, dp_size = accelerator.process_index // cfg.sp_size, accelerator.num_processes // cfg.sp_size
        log(f"sequence parallel: {dp_size} group(s) of sp_size={cfg.sp_size}, "
            f"{cfg.seq_len // cfg.sp_size} tokens of each row per process (DeepSpeed Ulysses, hf_flash attention)")

    if cfg.model is None:
        from .data import ByteTokenizer

        tiny_dir = out / f"tiny-{cfg.tiny_model}-base"
        if main:
            build_tiny_model(tiny_dir, cfg.tiny_model, ByteTokenizer.vocab_size, cfg.seed)
        accelerator.wait_for_everyone()
        model_path = tiny_dir
        log(f"model: embedded tiny {cfg.tiny_model} ({tiny_dir})")
    else:
        model_path = Path(cfg.model)
    from transformers import AutoConfig

    check_context(AutoConfig.from_pretrained(model_path), cfg)  # before the data is built
    tokenizer = load_tokenizer(cfg.tokenizer or str(model_path))
    rows = build_rows(cfg, tokenizer, log)
    batches = PackedBatches(
        rows, cfg.micro_batch_size, dp_rank, dp_size, cfg.seed,
        # under sequence parallelism every rank's attention sees the gathered row and finds the
        # documents from the gathered position_ids; the row's cu_seqlens would not describe a slice
        flash_kwargs="flash" in cfg.attn_implementation and cfg.sp_size == 1,
    )
    return _Run(cfg, accelerator, log, out, model_path, tokenizer, batches)


def _prepare_model(run: _Run) -> None:
    """The model with LoRA, the memory check, then the optimiser and its schedule, prepared by
    accelerate (sharded under FSDP)."""
    from accelerate.utils import DistributedType

    cfg, accelerator, device, log, tokenizer = run.cfg, run.accelerator, run.device, run.log, run.tokenizer
    fsdp = accelerator.distributed_type == DistributedType.FSDP
    if cfg.sp_size > 1:  # the head counts, before any weight is loaded
        from transformers import AutoConfig

        from hf_flash.integration.sequence_parallel import SequenceParallelError, check_sequence_parallel

        try:
            check_sequence_parallel(AutoConfig.from_pretrained(run.model_path), cfg.sp_size)
        except SequenceParallelError as e:
            raise ConfigError(str(e)) from e
    # FSDP loads real weights on the CPU and shards them; random weights are built in place
    model = load_model(cfg, run.model_path, log, device=device if cfg.random_init or not fsdp else None)
    if getattr(tokenizer, "vocab_size", 0) > model.config.vocab_size:
        raise ConfigError(
            f"tokenizer has {tokenizer.vocab_size} tokens but the model's vocabulary is {model.config.vocab_size}"
        )
    planned = cfg.memory_plan == "auto" and not fsdp and cfg.sp_size == 1
    model = apply_lora(model, cfg, autocast=accelerator.mixed_precision in ("bf16", "fp16"),
                       checkpointing=not planned)  # fmt: skip
    total, trainable = count_parameters(model)
    checkpointing = "off"
    if planned:
        checkpointing = "planned"
    elif cfg.gradient_checkpointing:
        checkpointing = "keeping attention outputs" if cfg.keeps_attention_outputs() else "on"
    log(f"model: {human(total)} parameters, {human(trainable)} trainable (LoRA r={cfg.lora_r}), "
        f"attention {cfg.attn_implementation}, loss {loss_name(cfg.loss_impl, device)}, gradient checkpointing "
        f"{checkpointing}")
    if planned:
        run.plan = plan_memory(model, cfg, device, log)
    else:
        check_memory(model, cfg, device, accelerator.num_processes, fsdp, log)
    if cfg.sp_size > 1:
        from hf_flash.integration.sequence_parallel import enable_sequence_parallel

        run.sp = enable_sequence_parallel(model, cfg.sp_size, seq_len=cfg.seq_len * cfg.micro_batch_size)

    wrapper = CausalLMWithLinearCE(model, cfg.loss_impl, cfg.loss_chunk_tokens)
    optimizer = torch.optim.AdamW(
        [p for p in wrapper.parameters() if p.requires_grad], lr=cfg.learning_rate,
        betas=(cfg.adam_beta1, cfg.adam_beta2), weight_decay=cfg.weight_decay,
    )
    # not passed to prepare(): accelerate would step it once per process per optimiser step
    run.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    accelerator.register_for_checkpointing(run.scheduler)
    # one call: FSDP2 must shard the model and remap the optimizer's parameters together
    run.wrapper, run.optimizer = accelerator.prepare(wrapper, optimizer)
    run.params = [p for p in run.wrapper.parameters() if p.requires_grad]
    if not fsdp:
        accelerator.register_save_state_pre_hook(trainable_only_hook)


def _resume(run: _Run) -> _Progress:
    """Drop partial checkpoints; with --resume, load the latest complete one and start from its step."""
    cfg, accelerator, out = run.cfg, run.accelerator, run.out
    start_step, tokens_seen = 0, 0
    if run.main:
        clean_partial_outputs(out)
    accelerator.wait_for_everyone()
    if cfg.resume:
        ckpt = latest_checkpoint(out)
        if ckpt is None:
            raise ConfigError(f"--resume: no complete checkpoint under {out / 'checkpoints'}")
        state = load_checkpoint(accelerator, ckpt, cfg)
        start_step, tokens_seen = state["step"], state["tokens_seen"]
        run.log(f"resumed from {ckpt} at step {start_step}")
    elif run.main and latest_checkpoint(out) is not None:
        run.log(f"note: {out / 'checkpoints'} holds checkpoints; starting fresh (pass --resume to continue)")
    return _Progress(start_step, tokens_seen)


def _loop(run: _Run, progress: _Progress) -> dict | None:
    """Optimiser steps up to ``max_steps`` (config.json and metrics.jsonl first): metrics, the
    progress bar, the profiled step and checkpoints. Returns ``{"interrupted_at": step}`` when
    ``interrupt_after`` stops it."""
    cfg, accelerator, device = run.cfg, run.accelerator, run.device
    start_step = progress.step
    metrics = MetricsLog(run.out / "metrics.jsonl", start_step, run.main)
    if run.main:
        write_atomic(run.out / "config.json", json.dumps(cfg.to_dict(), indent=1))
    run.wrapper.train()
    bar = None
    if run.main and cfg.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.max_steps, initial=start_step, desc="train", dynamic_ncols=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    # distinct tokens per optimiser step: a sequence-parallel group shares its rows
    step_tokens = cfg.micro_batch_size * cfg.seq_len * cfg.gradient_accumulation_steps * (
        accelerator.num_processes // cfg.sp_size
    )
    while progress.step < cfg.max_steps:
        prof = _start_profiler(device) if progress.step + 1 == cfg.profile_step else None
        t0 = time.perf_counter()
        grad_norm, loss_sum = _optimizer_step(run, progress.step)
        progress.step += 1
        progress.steps_this_run += 1
        step = progress.step
        progress.loss = float(accelerator.reduce(loss_sum, reduction="mean"))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        progress.tokens_seen += step_tokens
        if prof is not None:
            _save_profile(run, prof, step, dt)
        elif progress.steps_this_run > 1 or cfg.max_steps - start_step == 1:  # first step pays warm-up costs
            progress.run_tokens += step_tokens
            progress.run_time += dt
        mem, peak = _memory_gib(device)
        if step % cfg.log_every == 0 or step == cfg.max_steps:
            metrics.write({
                "step": step, "loss": progress.loss, "lr": run.scheduler.get_last_lr()[0],
                "grad_norm": float(grad_norm), "tokens": progress.tokens_seen, "step_time_s": dt,
                "tok_per_s": step_tokens / dt, "mem_gib": round(mem, 3), "peak_mem_gib": round(peak, 3),
            })
        if bar is not None:
            bar.set_postfix(loss=f"{progress.loss:.4f}", tok_s=f"{step_tokens / dt:,.0f}", mem=f"{peak:.1f}GiB")
            bar.update(1)
        if cfg.save_every and step % cfg.save_every == 0 and step < cfg.max_steps:
            save_checkpoint(accelerator, run.out, step, {
                "step": step, "tokens_seen": progress.tokens_seen, "world_size": accelerator.num_processes,
                "config": {k: cfg.to_dict()[k] for k in RESUME_KEYS},
            }, cfg.keep_checkpoints)
        if cfg.interrupt_after is not None and progress.steps_this_run >= cfg.interrupt_after:
            if bar is not None:
                bar.close()
            run.log(f"interrupt_after={cfg.interrupt_after}: stopping at step {step} without saving")
            accelerator.wait_for_everyone()
            return {"interrupted_at": step}
    if bar is not None:
        bar.close()
    return None


def _optimizer_step(run: _Run, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s micro-batches (gradient accumulation, the loss divided by the step's label
    count), clipping, optimiser and schedule. Returns the gradient norm and this process's loss.

    Under sequence parallelism every rank of a group builds the same rows, counts their labels
    (already the next token, so slicing after that keeps the target of each slice's last token),
    and runs its own slice; its summed loss is scaled by sp_size because DDP/FSDP average the
    gradients over all processes while the group's loss is the sum over its ranks."""
    cfg, accelerator, device = run.cfg, run.accelerator, run.device
    ga = cfg.gradient_accumulation_steps
    micro = [run.batches.get(step * ga + i, device) for i in range(ga)]
    n_label = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in micro)
    scale = 1
    if run.sp is not None:
        from hf_flash.integration.sequence_parallel import sequence_parallel_loss_scale, shard_batch

        micro = [shard_batch(b, run.sp, labels_shifted=True) for b in micro]
        scale = sequence_parallel_loss_scale(run.sp)
    loss_sum = torch.zeros((), device=device)
    for i, batch in enumerate(micro):
        sync = accelerator.no_sync(run.wrapper) if i < ga - 1 else _nullcontext()
        with sync, accelerator.autocast():
            loss = run.wrapper(**batch) * (scale / max(n_label, 1))
        accelerator.backward(loss)
        loss_sum += loss.detach()
    grad_norm = accelerator.clip_grad_norm_(run.params, cfg.max_grad_norm)
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    return grad_norm, loss_sum


def _save_profile(run: _Run, prof, step: int, seconds: float) -> None:
    prof.stop()
    if run.main:
        from .profiling import summary

        path = run.out / f"profile-step{step}.txt"
        path.write_text(summary(prof, seconds) + "\n")
        run.log(f"profile of step {step}: {path}")


def _finish(run: _Run, progress: _Progress) -> dict:
    """The summary (tokens/s over this run's steps after the first), the adapter and merged model
    when asked for, summary.json."""
    cfg, accelerator = run.cfg, run.accelerator
    summary = {
        "final_loss": progress.loss, "steps": progress.step,
        "tok_per_s": progress.run_tokens / progress.run_time if progress.run_time else None,
        "peak_mem_gib": _memory_gib(run.device)[1],
        "peak_host_gib": _host_peak_gib(),
        "gradient_checkpointing": cfg.gradient_checkpointing,
        "keep_attention_outputs": cfg.keeps_attention_outputs(),
        "num_processes": accelerator.num_processes,
        **(plan_summary(run.plan) if run.plan is not None else {}),
        "sp_size": cfg.sp_size,
    }
    accelerator.wait_for_everyone()
    if cfg.save_adapter or cfg.save_merged:
        summary.update(save_outputs(accelerator, run.wrapper, cfg, run.model_path, run.tokenizer, run.out, run.log))
    if run.main:
        write_atomic(run.out / "summary.json", json.dumps(summary, indent=1))
        run.log(f"done: loss {progress.loss:.4f}, {summary['tok_per_s'] or 0:,.0f} tok/s, "
                f"peak {summary['peak_mem_gib']:.2f} GiB")
    accelerator.end_training()
    return summary


def _start_profiler(device):
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    prof = profile(activities=activities)
    prof.start()
    return prof


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def save_outputs(accelerator, wrapper, cfg, model_path: Path, tokenizer, out: Path, log) -> dict:
    """The LoRA adapter (with the RoPE-extended base config beside it) and, optionally, the
    merged model, rebuilt on the CPU from the base weights so it works under FSDP too."""
    state = accelerator.get_state_dict(wrapper)  # full tensors on the main process under FSDP
    result = {}
    if not accelerator.is_main_process:
        return result
    unwrapped = accelerator.unwrap_model(wrapper)
    peft_model = unwrapped.model
    prefix = "model."
    peft_state = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    adapter_dir = out / "adapter"
    tmp = _fresh(out / ".tmp-adapter")
    peft_model.save_pretrained(tmp, state_dict=peft_state)
    peft_model.get_base_model().config.save_pretrained(tmp / "base_config")
    tokenizer.save_pretrained(tmp)
    _replace_dir(tmp, adapter_dir)
    result["adapter_dir"] = str(adapter_dir)
    log(f"saved LoRA adapter to {adapter_dir} (base config with the extended RoPE in base_config/)")
    if cfg.save_merged:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(
            model_path, config=peft_model.get_base_model().config, dtype=getattr(torch, cfg.dtype),
        )
        merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
        merged_dir = out / "merged"
        tmp = _fresh(out / ".tmp-merged")
        merged.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _replace_dir(tmp, merged_dir)
        result["merged_dir"] = str(merged_dir)
        log(f"saved merged model to {merged_dir}")
    return result


def _fresh(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def _replace_dir(tmp: Path, final: Path) -> None:
    """Put a fully written folder in place of ``final`` (a Ctrl-C leaves the old one or the new)."""
    if final.exists():
        old = final.with_name(f".old-{final.name}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


def clean_partial_outputs(out: Path) -> None:
    """Remove what an interrupted run was writing: partial checkpoints, adapter, merged model."""
    clean_partial(out)
    for p in out.glob(".tmp-*"):
        shutil.rmtree(p, ignore_errors=True)
    for p in out.glob(".*.tmp"):
        p.unlink(missing_ok=True)


RECIPE_PACKAGES = {"yaml": "pyyaml", "accelerate": "accelerate", "peft": "peft", "tqdm": "tqdm"}


def missing_recipe_packages() -> list[str]:
    """The distributions of the ``[recipes]`` extra that are not installed."""
    return [dist for module, dist in RECIPE_PACKAGES.items() if importlib.util.find_spec(module) is None]


def prepare_device(cfg: RecipeConfig) -> str:
    """Without CUDA, switch on Triton's CPU interpreter (before any kernel is defined) and check
    that it can run here; returns where the run goes ("cuda" or "cpu (Triton interpreter)")."""
    if torch.cuda.is_available():
        return "cuda"
    if cfg.attn_implementation != "hf_flash":
        return "cpu"
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ["TRITON_INTERPRET"] in ("", "0"):
        raise ConfigError(
            "no CUDA GPU and TRITON_INTERPRET=0: hf_flash's kernels run on the CPU only through "
            "Triton's interpreter; unset TRITON_INTERPRET or use --attn_implementation sdpa"
        )
    from hf_flash._cli import interpreter_problem

    problem = interpreter_problem()
    if problem is not None:
        raise ConfigError(problem)
    if cfg.dtype == "bfloat16" or cfg.mixed_precision == "bf16":
        raise ConfigError(
            f"no CUDA GPU: hf_flash runs through Triton's CPU interpreter, which computes bfloat16 "
            f"wrongly (dtype={cfg.dtype}, mixed_precision={cfg.mixed_precision}); use --dtype float32 "
            f"--mixed_precision no"
        )
    return "cpu (Triton's interpreter)"


def _prog() -> str:
    """How this recipe was started, for the resume hint."""
    argv0 = Path(sys.argv[0])
    if argv0.name.startswith("hf-flash-finetune"):
        return "hf-flash-finetune"
    if argv0.name == "lora_long_context.py" and argv0.parent.name == "recipes":
        package = "hf_flash.recipes" if argv0.parent.parent.name == "hf_flash" else "recipes"
        return f"python -m {package}.lora_long_context"
    return "hf-flash-finetune"


def _interrupted(cfg: RecipeConfig, argv: list) -> None:
    """Ctrl-C: drop what was being written, say where the run stands and how to resume."""
    out = Path(cfg.output_dir)
    clean_partial_outputs(out)
    try:
        ckpt = latest_checkpoint(out)
    except ConfigError:
        ckpt = None
    again = " ".join([_prog(), shlex.join(argv)]).strip()
    if ckpt is not None:
        resume = again if "--resume" in argv else f"{again} --resume"
        msg = f"interrupted: nothing half-written; latest complete checkpoint {ckpt}. Resume with: {resume}"
    else:
        msg = (f"interrupted: nothing half-written; no checkpoint was saved yet (save_every={cfg.save_every}). "
               f"Start again with: {again}")
    print(f"\n{msg}", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    """The ``hf-flash-finetune`` command. Returns the exit status: 0, 2 (a configuration error,
    reported in one line) or 130 (interrupted)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" not in argv and "--help" not in argv:
        missing = missing_recipe_packages()
        if missing:
            print(f"error: the recipe needs hf_flash's [recipes] extra (missing: {', '.join(missing)}): "
                  f"pip install 'hf-flash[recipes]'", file=sys.stderr)
            return 2
    embedded = uses_embedded_default(argv)
    cfg = None
    try:
        cfg = load_config(argv, base=EMBEDDED_DEFAULT if embedded else None, prog=_prog())
        where = prepare_device(cfg)
        if embedded:
            print(
                f"hf-flash-finetune: no --config or --model given, running the embedded default on {where}: "
                f"a tiny {cfg.tiny_model} (2 layers, hidden 64, context 32) extended to {cfg.seq_len} tokens "
                f"with {cfg.rope_method}, {cfg.max_steps} LoRA steps on synthetic pass-key documents, "
                f"output in {cfg.output_dir}. A plumbing check, not a useful model: see --help and "
                f"--config NAME for real runs.", flush=True,
            )
        train(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if cfg is not None:
            _interrupted(cfg, argv)
        else:
            print("\ninterrupted before the run started", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

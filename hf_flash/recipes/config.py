"""Recipe configuration: one flat dataclass, filled from a YAML file and then the command line.

Every field can be set in the YAML file (``--config``) and overridden as ``--name value`` on the
command line; values on the command line are parsed as YAML scalars/lists, so
``--lora_target_modules "[q_proj, v_proj]"``, ``--max_steps 50`` and ``--save_merged true`` all
work. Unknown keys are errors (a typo must not silently train with a default).

Checks that need only the configuration run in :func:`RecipeConfig.validate`; checks that need
the model (LoRA targets, original context, predicted memory) run in the recipe right after the
model is loaded, still before the first training step.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

ROPE_METHODS = ("none", "pi", "linear", "ntk", "dynamic", "yarn", "llama3")
LOSS_IMPLS = ("chunked", "liger", "full")
DTYPES = ("float32", "bfloat16", "float16")
MIXED_PRECISION = ("no", "bf16", "fp16")
TINY_FAMILIES = ("llama", "mistral")
MAX_ROPE_FACTOR = 64
"""Largest context extension the recipe accepts (seq_len / the model's original context): RoPE
scaling is studied up to 32x in the literature (YaRN, LongRoPE); beyond that the positions are
meaningless and the synthetic documents alone would take minutes to build."""


class ConfigError(ValueError):
    """A configuration problem found before training starts."""


@dataclass
class RecipeConfig:
    # model ------------------------------------------------------------------------------------
    model: Optional[str] = None
    """Local model directory (config.json + weights). None: build the embedded tiny model."""
    tiny_model: str = "llama"
    """Family of the embedded tiny model when ``model`` is None: llama or mistral."""
    tokenizer: Optional[str] = None
    """Tokenizer directory; defaults to ``model`` (the tiny model uses a byte tokenizer)."""
    random_init: bool = False
    """Initialise the weights randomly from ``model``'s config.json instead of loading them
    (throughput benchmarks of a model shape; the directory then needs no weight files)."""
    attn_implementation: str = "hf_flash"
    """transformers attention implementation: hf_flash, or sdpa / eager / flex_attention to compare."""
    dtype: str = "bfloat16"
    """dtype of the frozen base weights; LoRA weights stay float32."""
    mixed_precision: str = "bf16"
    """accelerate autocast: bf16, fp16 or no. Overridden by ``accelerate launch`` flags."""
    gradient_checkpointing: bool = True
    """Recompute each decoder layer's activations in the backward pass (transformers' activation
    checkpointing) instead of keeping them: the memory that makes long contexts fit."""
    keep_attention_outputs: Optional[bool] = None
    """With gradient checkpointing, keep every layer's attention output and log-sum-exp from the
    forward pass so the backward pass does not run the attention forward kernel again
    (``hf_flash.gradient_checkpointing_kwargs``; costs tokens x heads x head_dim in the compute
    dtype plus tokens x heads float32 per layer). None: on when attn_implementation is hf_flash
    and gradient_checkpointing is on, off otherwise. true needs both."""
    memory_plan: str = "auto"
    """auto: hf_flash.training's planner picks, from the model shape, the tokens per micro-batch
    and the free device and host memory, the fastest checkpointing form that fits (within what
    gradient_checkpointing and keep_attention_outputs allow: keeping the attention outputs,
    plain, or with each checkpointed layer input offloaded to pinned host memory) and whether the
    MLP runs in sequence chunks; it prints the plan and its predicted peak. fixed: exactly
    gradient_checkpointing and keep_attention_outputs, no tiled MLP or offload. Runs with FSDP or
    sp_size > 1 always use fixed."""
    offload_activations: Optional[bool] = None
    """Hold each checkpointed layer input in pinned host memory between the forward pass and its
    recomputation (asynchronous copies, prefetched; ``hf_flash.training.offload``). None: the
    planner decides (memory_plan auto). true needs gradient_checkpointing and memory_plan auto."""
    liger_norm_mlp: Optional[bool] = None
    """Run the model's RMSNorms and SwiGLU MLPs on Liger-Kernel's fused functions
    (``hf_flash.training.fused_ops``: no float32 copy of each norm's input kept for the backward
    pass). None: wherever liger-kernel is installed, training runs on CUDA and the model type is
    supported (memory_plan auto); true: required (an error says what is missing); false: off."""
    tiled_mlp_tokens: Optional[int] = None
    """Run every MLP over chunks of this many tokens in forward and backward, so its
    intermediate (tokens x intermediate_size) never exists whole (``hf_flash.training.tiled_mlp``).
    None: the planner decides (memory_plan auto); 0: off."""

    sp_size: int = 1
    """Sequence parallelism: processes sharing one sequence (1: off). Each rank of a group of
    ``sp_size`` takes ``seq_len / sp_size`` consecutive tokens of the same rows; DeepSpeed's Ulysses
    exchanges q/k/v by all-to-all so hf_flash attends the whole sequence for ``heads / sp_size``
    heads (``hf_flash.integration.sequence_parallel``). Needs attn_implementation hf_flash,
    deepspeed (``pip install 'hf_flash[sp]'``), a number of processes that ``sp_size`` divides,
    seq_len divisible by sp_size, and head counts Ulysses can split. Weights: FSDP2 or DDP over all
    processes as without it."""

    # context extension --------------------------------------------------------------------------
    seq_len: int = 16384
    """Tokens per packed row (the training context)."""
    rope_method: str = "yarn"
    """hf_flash.extend_context method: yarn, pi (alias linear), ntk, dynamic, llama3, or none."""
    rope_factor: Optional[float] = None
    """Scaling factor; None derives it from seq_len / the model's original context."""

    # data -------------------------------------------------------------------------------------
    data: Optional[list] = None
    """Local files/directories: .jsonl/.json (``text_field``), .txt/.md (one document per file),
    or a ``datasets`` directory saved with save_to_disk. None: synthetic long documents."""
    text_field: str = "text"
    """Field (column) holding the text in .jsonl/.json files and ``datasets`` directories."""
    synthetic_documents: int = 256
    """Number of synthetic documents when ``data`` is None."""
    max_documents: Optional[int] = None
    """Read at most this many documents (after the deterministic shuffle)."""

    # LoRA -------------------------------------------------------------------------------------
    lora_r: int = 16
    """LoRA rank."""
    lora_alpha: float = 32.0
    """LoRA scaling numerator (the update is scaled by lora_alpha / lora_r)."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA branch's input."""
    lora_target_modules: list = field(
        default_factory=lambda: [
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
        ]
    )
    """Names of the linear modules LoRA adapts (a YAML list or comma-separated)."""

    # optimisation -----------------------------------------------------------------------------
    micro_batch_size: int = 1
    """Packed rows per process per forward pass (flattened into one row for varlen attention)."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimiser step."""
    max_steps: int = 200
    """Optimiser steps of the whole run."""
    learning_rate: float = 2e-4
    """Peak learning rate (after warmup)."""
    min_lr_ratio: float = 0.1
    """Cosine schedule floor as a fraction of learning_rate."""
    warmup_steps: int = 20
    """Linear warmup steps before the cosine schedule; at most max_steps."""
    weight_decay: float = 0.0
    """AdamW weight decay of the LoRA weights."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.95
    """AdamW beta2."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm."""
    loss_impl: str = "chunked"
    """chunked (hf_flash recipes' chunked linear cross-entropy), liger (Liger-Kernel's fused
    linear cross-entropy, if installed), or full (materialises the logits; small models only)."""
    loss_chunk_tokens: Optional[int] = None
    """Tokens per logits chunk of the chunked loss; None: about 512 MiB of fp32 logits."""
    seed: int = 0
    """Seed of the data order, the synthetic documents, the tiny model and the LoRA init."""

    # output, checkpoints, logging -------------------------------------------------------------
    output_dir: str = "runs/lora_long_context"
    """Where checkpoints, metrics.jsonl, config.json, summary.json and the adapter go."""
    save_every: int = 0
    """Save a resumable checkpoint every N optimiser steps (0: never)."""
    keep_checkpoints: int = 2
    """Complete checkpoints kept (older ones are deleted)."""
    resume: bool = False
    """Continue from ``output_dir``'s latest complete checkpoint."""
    save_adapter: bool = True
    """Save the LoRA adapter to ``output_dir/adapter`` at the end."""
    save_merged: bool = False
    """Also save base + LoRA merged into one model directory at the end."""
    log_every: int = 1
    """Write a metrics.jsonl row every N steps."""
    progress: bool = True
    """Show a progress bar."""

    # safety checks ----------------------------------------------------------------------------
    max_memory_gib: Optional[float] = None
    """Memory available per device for the start-up prediction; None: the device's total."""
    skip_memory_check: bool = False
    """Start even when the predicted peak memory exceeds what is available."""
    interrupt_after: Optional[int] = None
    """Testing aid: stop abruptly after this many steps of this run, as a kill would."""
    profile_step: int = 0
    """Profile optimiser step N (1-based; 0: off) with torch.profiler and write
    ``output_dir/profile-step{N}.txt``: operators and kernels by device time, grouped by kind.
    That step is left out of tokens/s (the profiler slows it)."""

    # ------------------------------------------------------------------------------------------

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, values: dict, source: str = "config") -> "RecipeConfig":
        unknown = sorted(set(values) - set(cls.field_names()))
        if unknown:
            raise ConfigError(
                f"unknown option(s) in {source}: {', '.join(unknown)}. "
                f"Valid options: {', '.join(cls.field_names())}"
            )
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        cfg = cls(**{k: _coerce(k, v, types[k]) for k, v in values.items()})
        cfg.normalise()
        return cfg

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def keeps_attention_outputs(self) -> bool:
        """``keep_attention_outputs`` with its default (None) resolved."""
        if self.keep_attention_outputs is None:
            return self.attn_implementation == "hf_flash" and self.gradient_checkpointing
        return self.keep_attention_outputs

    def normalise(self) -> None:
        if isinstance(self.data, (str, Path)):
            self.data = [str(self.data)]
        if isinstance(self.lora_target_modules, str):
            self.lora_target_modules = [
                m.strip() for m in self.lora_target_modules.split(",") if m.strip()
            ]
        if self.rope_method == "linear":
            self.rope_method = "pi"

    def validate(self) -> None:
        """Checks that need nothing but the configuration. Raises ConfigError."""
        errors = []

        def need(cond: bool, msg: str) -> None:
            if not cond:
                errors.append(msg)

        need(self.dtype in DTYPES, f"dtype={self.dtype!r}; choose one of {DTYPES}")
        need(
            self.mixed_precision in MIXED_PRECISION,
            f"mixed_precision={self.mixed_precision!r}; choose one of {MIXED_PRECISION}",
        )
        need(
            self.rope_method in ROPE_METHODS,
            f"rope_method={self.rope_method!r}; choose one of {ROPE_METHODS}",
        )
        need(self.loss_impl in LOSS_IMPLS, f"loss_impl={self.loss_impl!r}; choose one of {LOSS_IMPLS}")
        need(
            self.tiny_model in TINY_FAMILIES,
            f"tiny_model={self.tiny_model!r}; choose one of {TINY_FAMILIES}",
        )
        need(self.seq_len >= 2, f"seq_len={self.seq_len} must be at least 2")
        need(self.rope_factor is None or self.rope_factor > 1, f"rope_factor={self.rope_factor} must be > 1")
        for name in ("micro_batch_size", "gradient_accumulation_steps", "max_steps", "lora_r", "log_every"):
            need(getattr(self, name) >= 1, f"{name}={getattr(self, name)} must be >= 1")
        for name in ("warmup_steps", "save_every", "keep_checkpoints", "profile_step"):
            need(getattr(self, name) >= 0, f"{name}={getattr(self, name)} must be >= 0")
        need(
            self.warmup_steps <= self.max_steps,
            f"warmup_steps={self.warmup_steps} is longer than the whole run (max_steps={self.max_steps}); "
            f"lower warmup_steps or raise max_steps",
        )
        need(self.keep_checkpoints >= 1 or self.save_every == 0, "keep_checkpoints must be >= 1 when save_every > 0")
        need(
            self.profile_step <= self.max_steps,
            f"profile_step={self.profile_step} is beyond max_steps={self.max_steps}",
        )
        need(self.learning_rate > 0, f"learning_rate={self.learning_rate} must be > 0")
        need(0 <= self.min_lr_ratio <= 1, f"min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        need(0 <= self.lora_dropout < 1, f"lora_dropout={self.lora_dropout} must be in [0, 1)")
        need(
            isinstance(self.lora_target_modules, list) and len(self.lora_target_modules) > 0,
            "lora_target_modules must be a non-empty list of module names",
        )
        need(
            self.loss_chunk_tokens is None or self.loss_chunk_tokens >= 1,
            f"loss_chunk_tokens={self.loss_chunk_tokens} must be >= 1",
        )
        need(self.synthetic_documents >= 1, "synthetic_documents must be >= 1")
        need(self.sp_size >= 1, f"sp_size={self.sp_size} must be >= 1")
        if self.sp_size > 1:
            need(
                self.attn_implementation == "hf_flash",
                f"sp_size={self.sp_size} runs hf_flash's kernels under DeepSpeed's Ulysses, but "
                f"attn_implementation={self.attn_implementation!r}; use attn_implementation hf_flash",
            )
            need(
                self.seq_len % self.sp_size == 0,
                f"seq_len={self.seq_len} is not divisible by sp_size={self.sp_size} (every rank takes "
                f"an equal slice of each row); use a multiple of {self.sp_size}",
            )
        if self.keep_attention_outputs:
            need(
                self.attn_implementation == "hf_flash",
                f"keep_attention_outputs: true keeps hf_flash's attention op, but "
                f"attn_implementation={self.attn_implementation!r}; use attn_implementation "
                f"hf_flash or set keep_attention_outputs: false",
            )
            need(
                self.gradient_checkpointing,
                "keep_attention_outputs: true only applies with gradient_checkpointing: true "
                "(without checkpointing nothing is recomputed); enable gradient_checkpointing or "
                "set keep_attention_outputs: false",
            )
        need(self.memory_plan in ("auto", "fixed"), f"memory_plan={self.memory_plan!r}; choose auto or fixed")
        if self.offload_activations:
            need(
                self.gradient_checkpointing and self.memory_plan == "auto",
                "offload_activations: true holds checkpointed layer inputs on the host: it needs "
                "gradient_checkpointing: true and memory_plan: auto",
            )
            need(
                not self.keep_attention_outputs,
                "offload_activations: true with keep_attention_outputs: true: the offload recomputes "
                "the attention; set keep_attention_outputs: false (or leave it unset)",
            )
        need(self.tiled_mlp_tokens is None or self.tiled_mlp_tokens >= 0,
             f"tiled_mlp_tokens={self.tiled_mlp_tokens} must be >= 0 (0: off)")
        need(not self.liger_norm_mlp or self.memory_plan == "auto", "liger_norm_mlp needs memory_plan: auto")
        need(not self.tiled_mlp_tokens or self.memory_plan == "auto",
             "tiled_mlp_tokens needs memory_plan: auto")
        need(not self.random_init or self.model is not None, "random_init needs model (a directory with config.json)")
        need(not (self.random_init and self.save_merged), "save_merged with random_init: there are no base weights to merge into")
        if self.model is not None:
            path = Path(self.model)
            need(path.is_dir(), f"model directory {self.model} does not exist (give a local model directory)")
            need(
                not path.is_dir() or (path / "config.json").is_file(),
                f"model directory {self.model} has no config.json (is it a transformers model directory?)",
            )
        if self.tokenizer is not None:
            need(Path(self.tokenizer).exists(), f"tokenizer path {self.tokenizer} does not exist")
        for p in self.data or []:
            need(Path(p).exists(), f"data path {p} does not exist")
        if errors:
            raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(errors))


def _coerce(name: str, value: Any, type_name: str) -> Any:
    """Check/convert one option against its annotation (YAML reads ``1e-4`` as a string)."""
    optional = type_name.startswith("Optional[")
    base = type_name[len("Optional["):-1] if optional else type_name
    if value is None:
        if optional:
            return None
        raise ConfigError(f"option {name} cannot be null")
    try:
        if base == "float" and isinstance(value, (int, float, str)) and not isinstance(value, bool):
            return float(value)
        if base == "int" and not isinstance(value, bool):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            if isinstance(value, (int, str)):
                return int(value)
        if base == "bool" and isinstance(value, bool):
            return value
        if base == "str" and value is False and name == "mixed_precision":  # unquoted `no` in YAML
            return "no"
        if base == "str" and isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        if base == "list" and isinstance(value, (list, str)):
            return value
    except ValueError:
        pass
    raise ConfigError(f"option {name}={value!r} is not a valid {base}")


def _parse_value(text: str) -> Any:
    import yaml

    if text.lower() in ("no", "yes", "on", "off"):  # YAML 1.1 would read these as booleans
        return text
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def field_docs() -> dict[str, str]:
    """Each option's documentation: the string literal under its field in :class:`RecipeConfig`."""
    tree = ast.parse(inspect.getsource(RecipeConfig))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:] + [None]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            doc = ""
            if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
                doc = " ".join(after.value.value.split())
            docs[node.target.id] = doc
    return docs


def configs_dir() -> Path:
    """The shipped YAML configs: package data of an installed hf_flash, or the checkout's
    ``recipes/configs`` (an editable install or ``PYTHONPATH=.``)."""
    installed = Path(__file__).resolve().parent / "configs"
    if installed.is_dir():
        return installed
    return Path(__file__).resolve().parents[2] / "recipes" / "configs"


def shipped_configs() -> list[str]:
    """Names of the shipped recipe configs (accelerate's launcher configs left out)."""
    return sorted(p.stem for p in configs_dir().glob("*.yaml") if not p.stem.startswith("accelerate_"))


def resolve_config_path(path: Path) -> Path:
    """``--config``: a YAML file, or the name of a shipped config (``tiny``, ``llama-32k``, ...)."""
    if path.is_file():
        return path
    name = path.name if path.suffix in (".yaml", ".yml") else path.name + ".yaml"
    if path.parent == Path(".") or path.parent.parts[-2:] == ("recipes", "configs"):
        shipped = configs_dir() / name
        if shipped.is_file():
            return shipped
    names = ", ".join(shipped_configs())
    raise ConfigError(f"config file {path} does not exist (shipped configs, usable by name: {names})")


class OneLineParser(argparse.ArgumentParser):
    """argparse with its usage errors (unknown option, missing value) as one line, exit code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser(prog: str = "hf-flash-finetune") -> argparse.ArgumentParser:
    docs = field_docs()
    parser = OneLineParser(
        prog=prog,
        usage="%(prog)s [-h] [--config FILE] [--OPTION VALUE ...]",
        description="Long-context LoRA fine-tuning with hf_flash attention, RoPE scaling, packing "
        "and a chunked cross-entropy (accelerate + peft). Every option can be set in a YAML file "
        "(--config) and overridden on the command line (values are YAML scalars or lists). With no "
        "--config and no --model it runs the embedded default: a tiny Llama on synthetic pass-key "
        "documents for a few steps (on the CPU through Triton's interpreter when there is no GPU); "
        "any option given then changes that default.",
        epilog="The embedded default (no --config, no --model) sets "
        + ", ".join(f"{k}={v}" for k, v in EMBEDDED_DEFAULT.items())
        + f" over the defaults above. Shipped configs (--config NAME): {', '.join(shipped_configs())}.",
    )
    parser.add_argument(
        "--config", type=Path, metavar="FILE",
        help="YAML file with any of the options below, or the name of a shipped config (see the end)",
    )
    defaults = RecipeConfig().to_dict()
    for f in dataclasses.fields(RecipeConfig):
        doc = docs.get(f.name, "").replace("%", "%%")
        # nargs="?" lets boolean options be given as bare flags (--resume) or with a value
        parser.add_argument(
            f"--{f.name}", dest=f.name, type=_parse_value, nargs="?", const=True,
            default=argparse.SUPPRESS, metavar="VALUE",
            help=f"{doc} [{f.type}; default {defaults[f.name]!r}]".strip(),
        )
    return parser


EMBEDDED_DEFAULT = dict(
    model=None, tiny_model="llama", seq_len=64, rope_method="yarn", dtype="float32",
    mixed_precision="no", gradient_checkpointing=False, synthetic_documents=16, lora_r=8,
    lora_alpha=16, max_steps=4, warmup_steps=1, learning_rate=1e-2, save_every=2,
    output_dir="runs/hf-flash-finetune-default",
)
"""What the recipe runs when given neither --config nor --model: the embedded tiny Llama (2 layers,
hidden 64, original context 32) extended 2x with YaRN, 4 LoRA steps on 64-token rows of synthetic
pass-key documents, in float32 (the CPU interpreter is not faithful for bfloat16), a checkpoint
every 2 steps. A plumbing check that finishes on a CPU in about a minute, not a useful model."""


def uses_embedded_default(argv: list) -> bool:
    """True when ``argv`` names neither a config file nor a model."""
    return not any(a in ("--config", "--model") or a.startswith(("--config=", "--model=")) for a in argv)


def load_config(argv: Optional[list] = None, base: Optional[dict] = None,
                prog: str = "hf-flash-finetune") -> RecipeConfig:
    """``base`` (e.g. :data:`EMBEDDED_DEFAULT`), then the YAML file, then command-line
    overrides; validated."""
    import yaml

    args = vars(build_parser(prog).parse_args(argv))
    values: dict = dict(base or {})
    config_path = args.pop("config", None)
    if config_path is not None:
        config_path = resolve_config_path(config_path)
        try:
            loaded = yaml.safe_load(config_path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{config_path} is not valid YAML: {' '.join(str(e).split())}") from e
        if not isinstance(loaded, dict):
            raise ConfigError(f"{config_path} must hold a mapping of option: value")
        RecipeConfig.from_dict(loaded, source=str(config_path))  # unknown keys named per file
        values.update(loaded)
    values.update(args)
    cfg = RecipeConfig.from_dict(values)
    cfg.validate()
    return cfg

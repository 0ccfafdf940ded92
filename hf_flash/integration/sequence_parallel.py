"""Sequence parallelism: one long sequence split across GPUs, hf_flash's kernels attending.

The engine is DeepSpeed's Ulysses for Hugging Face models (ALST,
``deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPAttentionHF``). Its hook is the
attention registry of transformers: ``register_with_transformers(model, core_attn_implementation)``
replaces the function registered under the model's attention name with a wrapper that, in every
layer,

1. all-gathers ``position_ids`` over the sequence-parallel group (so the full row's document
   boundaries are known on every rank),
2. exchanges q, k, v with an all-to-all: each rank goes from ``(S / P)`` tokens x all heads to
   all ``S`` tokens x ``H / P`` heads (k/v heads are repeated when ``P > Hkv``),
3. calls the core attention function (here hf_flash's, registered as ``"hf_flash"``) on the
   whole sequence for its heads: packed documents go through the varlen kernel with the
   boundaries read from the gathered ``position_ids``, exactly as on one GPU,
4. exchanges the output back to ``(S / P)`` tokens x all heads.

Every rank attends the whole sequence for its heads, so causal attention needs no load
balancing and documents may cross shard boundaries freely. Everything else in the model
(projections, MLP, norms, RoPE with each token's own position, the loss) works on the rank's
own tokens. What this module adds around the engine:

* :func:`check_sequence_parallel`: the configuration checks, before any weight is loaded;
* :func:`enable_sequence_parallel`: DeepSpeed's communication layer over the process group
  accelerate (or torchrun) already created, and the Ulysses registration for a loaded model;
* :func:`shard_batch`: one rank's slice of a batch, labels shifted *before* slicing (the last
  token of a shard predicts the first token of the next shard) and the full-row varlen
  keywords dropped (each rank's attention sees the gathered row, not its slice);
* :func:`sequence_parallel_loss_scale`: the factor that turns a rank's summed token loss into
  its share of the group's mean once DDP/FSDP average the gradients over all processes;
* :func:`sequence_parallel_trainer`: the same for a transformers ``Trainer`` (or TRL's
  ``SFTTrainer``) running DDP or FSDP2 through accelerate.

The weights are sharded (FSDP2) or replicated (DDP) by accelerate over all processes, as without
sequence parallelism; the DeepSpeed engine itself (ZeRO) is not needed for the attention.

Imports transformers and DeepSpeed lazily (inside the functions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch

from . import ATTN_IMPLEMENTATION

IGNORE_INDEX = -100
MIN_DEEPSPEED = "0.19.8"
"""DeepSpeed release whose Ulysses accepts any registered attention (tested); older releases
accept only flash_attention_2/3 and sdpa by name."""

VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")

__all__ = [
    "SequenceParallel", "SequenceParallelError", "check_sequence_parallel", "enable_sequence_parallel",
    "shard_batch", "sequence_parallel_loss_scale", "sequence_parallel_trainer",
]


class SequenceParallelError(ValueError):
    """A sequence-parallel set-up that cannot work, found before any kernel runs."""


@dataclass(frozen=True)
class SequenceParallel:
    """This process's place: ``rank`` in its sequence-parallel group of ``size`` processes (the
    consecutive global ranks ``dp_rank * size ... dp_rank * size + size - 1``, DeepSpeed's
    layout), which is one of ``dp_size`` data-parallel replicas."""

    group: Any
    rank: int
    size: int
    dp_rank: int
    dp_size: int


def check_sequence_parallel(
    config, sp_size: int, *, seq_len: Optional[int] = None, world_size: Optional[int] = None,
    attn_implementation: Optional[str] = None,
) -> None:
    """Raise :class:`SequenceParallelError` naming what is wrong and what is supported.

    Arguments:
        config: the model's ``PretrainedConfig`` (or its text config): the head counts.
        sp_size: int. Processes per sequence (1: off, nothing is checked).
        seq_len: int. Tokens per row fed to the model (the whole row, before sharding).
        world_size: int. Processes in the job; must be a multiple of ``sp_size``.
        attn_implementation: str. The model's attention; must be ``"hf_flash"``.
    """
    if not isinstance(sp_size, int) or sp_size < 1:
        raise SequenceParallelError(f"sp_size={sp_size!r} must be an integer >= 1")
    if sp_size == 1:
        return
    errors = []
    if attn_implementation is not None and attn_implementation != ATTN_IMPLEMENTATION:
        errors.append(
            f"attn_implementation={attn_implementation!r}: sequence parallelism here runs hf_flash's "
            f"kernels; use attn_implementation='{ATTN_IMPLEMENTATION}'"
        )
    if world_size is not None and world_size % sp_size:
        errors.append(
            f"{world_size} process(es) cannot be split into sequence-parallel groups of sp_size={sp_size}; "
            f"launch a multiple of {sp_size} processes (accelerate launch --num_processes N)"
        )
    if seq_len is not None and seq_len % sp_size:
        errors.append(
            f"seq_len={seq_len} is not divisible by sp_size={sp_size}: every rank takes an equal "
            f"slice; use a multiple of {sp_size}"
        )
    if config is not None:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        hq = getattr(text, "num_attention_heads", None)
        hkv = getattr(text, "num_key_value_heads", None) or hq
        if hq is not None and hq % sp_size:
            errors.append(
                f"the model has {hq} attention heads, not divisible by sp_size={sp_size}: Ulysses gives "
                f"each rank heads/sp_size heads; choose sp_size dividing {hq}"
            )
        if hkv is not None and hkv % sp_size and sp_size % hkv:
            errors.append(
                f"the model has {hkv} key/value heads; Ulysses needs sp_size={sp_size} to divide them or "
                f"be a multiple of them (k/v heads are then repeated)"
            )
    if errors:
        raise SequenceParallelError("sequence parallelism cannot run:\n  - " + "\n  - ".join(errors))


def require_deepspeed() -> str:
    """DeepSpeed's version; :class:`SequenceParallelError` with the install command otherwise."""
    from importlib import metadata

    from packaging.version import Version

    try:
        found = metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        found = None
    if found is None or Version(found) < Version(MIN_DEEPSPEED):
        have = "is not installed" if found is None else f"is {found}"
        raise SequenceParallelError(
            f"sequence parallelism (sp_size > 1) runs on DeepSpeed's Ulysses, which needs "
            f"deepspeed >= {MIN_DEEPSPEED}; deepspeed {have}. Install it with "
            f"pip install 'hf_flash[sp]' (or pip install 'deepspeed>={MIN_DEEPSPEED}'); no DeepSpeed "
            f"engine or compiled op is used"
        )
    return found


_ENABLED: Optional[SequenceParallel] = None


def enable_sequence_parallel(model, sp_size: int, *, seq_len: Optional[int] = None) -> Optional[SequenceParallel]:
    """Run ``model``'s attention sequence-parallel over groups of ``sp_size`` processes.

    Call once per process, after ``torch.distributed`` is initialised (``Accelerator()`` or
    torchrun) and the model is loaded with ``attn_implementation="hf_flash"``, before its first
    forward pass. Batches must then be sliced with :func:`shard_batch`, and each rank's loss
    summed over its own tokens and scaled by :func:`sequence_parallel_loss_scale`.

    Only modules in training mode are sequence-parallel: after ``model.eval()`` every rank
    attends its own whole batch (DeepSpeed's ``disable_in_eval``), so evaluation and generation
    run unsplit, data-parallel.

    Arguments:
        model: a transformers model (or a peft wrapper of one) using ``"hf_flash"``.
        sp_size: int. Processes per sequence; 1 does nothing and returns None.
        seq_len: int. Optional; the row length, checked for divisibility.

    Return:
        the :class:`SequenceParallel` of this process, or None for ``sp_size == 1``.

    Raises:
        SequenceParallelError: a configuration that cannot work (the message says which and
            what is supported), DeepSpeed missing, or a second call in the same process
            (DeepSpeed's Ulysses keeps its groups and the wrapped function process-wide).
    """
    global _ENABLED
    if sp_size == 1:
        return None
    import torch.distributed as tdist

    world = tdist.get_world_size() if tdist.is_available() and tdist.is_initialized() else None
    config = getattr(model, "config", None)
    check_sequence_parallel(
        config, sp_size, seq_len=seq_len, world_size=world,
        attn_implementation=getattr(config, "_attn_implementation", None),
    )
    if world is None:
        raise SequenceParallelError(
            f"sp_size={sp_size} needs torch.distributed initialised first (create the Accelerator, or "
            f"launch with torchrun / accelerate launch, before enabling sequence parallelism)"
        )
    if _ENABLED is not None:
        raise SequenceParallelError(
            "sequence parallelism is already enabled in this process (DeepSpeed's Ulysses wraps the "
            "'hf_flash' attention process-wide); enable it once per process"
        )
    require_deepspeed()
    import deepspeed.comm as ds_comm
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    if tdist.get_backend() == "gloo":
        _skip_cpu_shm_build()
    # DeepSpeed's communication layer over the process group that already exists
    ds_comm.init_distributed(dist_backend=tdist.get_backend(), auto_mpi_discovery=False,
                             dist_init_required=False)
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation=ATTN_IMPLEMENTATION,
        sequence_parallel_size=sp_size, micro_batch_size=1, seq_length_is_variable=True,
        disable_in_eval=True,
    )
    rank = tdist.get_rank()
    _ENABLED = SequenceParallel(
        group=mpu.get_sequence_parallel_group(), rank=mpu.get_sequence_parallel_rank(),
        size=mpu.get_sequence_parallel_world_size(), dp_rank=rank // sp_size, dp_size=world // sp_size,
    )
    assert _ENABLED.rank == rank % sp_size and _ENABLED.size == sp_size
    return _ENABLED


def _padding_free(batch: Mapping[str, Any]) -> dict:
    """``batch`` without the keys that describe the whole row (``cu_seq_lens_*``,
    ``max_length_*``) or that would split it per rank (an all-ones ``attention_mask``); a mask
    with padding is refused (DeepSpeed's Ulysses drops masks, and hf_flash would unpad each
    slice on its own)."""
    mask = batch.get("attention_mask")
    if mask is not None and not bool((mask != 0).all()):
        raise SequenceParallelError(
            "sequence parallelism takes padding-free rows, but this batch's attention_mask has padding; "
            "pack the documents into one row with restarting position_ids instead "
            "(DataCollatorWithFlattening, or the recipe's packing)"
        )
    return {k: v for k, v in batch.items() if k not in VARLEN_KEYS and k != "attention_mask"}


def _skip_cpu_shm_build() -> None:
    """DeepSpeed's communication layer JIT-compiles a shared-memory allreduce for its CPU
    accelerator when it starts (a C++ compiler and ~30 s). Ulysses exchanges tensors with
    ``all_to_all_single`` and ``all_gather`` of torch.distributed and never uses it, and without
    it DeepSpeed's own allreduce goes through torch.distributed too; so over gloo it is not built."""
    import sys

    import deepspeed.comm.torch  # noqa: F401  (the attribute `torch` of deepspeed.comm is torch)

    module = sys.modules["deepspeed.comm.torch"]
    if hasattr(module, "build_shm_op"):
        module.build_shm_op = lambda: None


def shard_batch(batch: Mapping[str, Any], sp: SequenceParallel, *, labels_shifted: bool) -> dict:
    """This rank's slice of a ``(B, S, ...)`` batch along the sequence.

    Arguments:
        batch: ``input_ids``, ``position_ids`` (required: the engine gathers them to find the
            document boundaries and each token keeps its position) and ``labels``; any other
            tensor with a sequence axis is sliced too; ``cu_seq_lens_*`` / ``max_length_*``
            describe the whole row and are dropped, so is an ``attention_mask`` of ones (one
            with padding is refused: pack instead).
        sp: this process's :class:`SequenceParallel`.
        labels_shifted: bool. True: ``labels[i]`` is already the target of token ``i`` (the
            recipe's labels). False: transformers' convention (the model shifts): they are
            shifted here, on the whole row, into ``shift_labels`` (``labels`` is dropped), so
            the last token of a shard predicts the first token of the next one.

    Return:
        a new dict; ``labels`` (or ``shift_labels``) of the slice, never crossing a document
        start (``position_ids == 0`` at the next token gives ``-100``).
    """
    if "position_ids" not in batch or "input_ids" not in batch:
        raise SequenceParallelError(
            "a sequence-parallel batch needs input_ids and position_ids (restarting at 0 at each "
            "packed document); DataCollatorWithFlattening(return_position_ids=True) provides them"
        )
    seq = batch["input_ids"].shape[1]
    if seq % sp.size:
        raise SequenceParallelError(
            f"the batch has {seq} tokens per row, not divisible by sp_size={sp.size}; pad or pack rows "
            f"to a multiple of {sp.size}"
        )
    out = _padding_free(batch)
    if "labels" in out and not labels_shifted:
        labels = out.pop("labels")
        shifted = torch.full_like(labels, IGNORE_INDEX)
        shifted[:, :-1] = labels[:, 1:]
        # the next token starts a new document: nothing to predict across the boundary
        pos = batch["position_ids"].expand_as(labels)
        shifted[:, :-1] = shifted[:, :-1].masked_fill(pos[:, 1:] == 0, IGNORE_INDEX)
        out["shift_labels"] = shifted
    chunk = seq // sp.size
    lo, hi = sp.rank * chunk, (sp.rank + 1) * chunk
    for k, v in out.items():
        if torch.is_tensor(v) and v.dim() >= 2 and v.shape[1] == seq:
            out[k] = v[:, lo:hi]
    return out


def sequence_parallel_loss_scale(sp: Optional[SequenceParallel]) -> int:
    """Multiply a rank's token-loss sum divided by its *group's* label count by this: DDP and
    FSDP average gradients over all ``dp_size * size`` processes, and the group's loss is the
    sum over its ``size`` ranks."""
    return 1 if sp is None else sp.size


def sequence_parallel_trainer(trainer, sp_size: int) -> Optional[SequenceParallel]:
    """Make a built ``transformers.Trainer`` (or a subclass such as TRL's ``SFTTrainer``) train
    sequence-parallel over groups of ``sp_size`` processes. Call it after constructing the
    trainer (which initialises torch.distributed) and before ``trainer.train()``::

        trainer = Trainer(model=model, args=args, train_dataset=ds,
                          data_collator=DataCollatorWithFlattening())   # padding-free packing
        sequence_parallel_trainer(trainer, sp_size=2)
        trainer.train()

    The model uses ``attn_implementation="hf_flash"``; launch with ``accelerate launch`` (DDP, or
    FSDP2 for the weights) on a multiple of ``sp_size`` processes. Batches need ``input_ids``,
    ``position_ids`` and ``labels`` of one row (``per_device_train_batch_size=1`` with
    ``DataCollatorWithFlattening``, whose ``labels`` already hold -100 at each document start),
    their length a multiple of ``sp_size``.

    What changes: the training dataloader is wrapped in DeepSpeed's
    ``UlyssesSPDataLoaderAdapter``, which gathers the batches of the ``sp_size`` ranks of a group
    and hands them out one after the other, each rank taking its slice with the labels shifted on
    the whole row (``shift_labels``); ``labels`` is set to the same slice so that the Trainer
    counts the tokens and the model computes its loss from ``shift_labels`` (transformers'
    ``ForCausalLMLoss`` does not shift them again). The Trainer's own token counting over all
    processes (``average_tokens_across_devices``, on by default) then gives every rank the step's
    token count, and each sum of token losses over it is the right share of the mean. An epoch
    therefore has ``sp_size`` times as many steps of ``1 / sp_size`` of the tokens each.

    Raises:
        SequenceParallelError: as :func:`enable_sequence_parallel`, and for
            ``average_tokens_across_devices=False`` (each rank would divide by its own count).
    """
    if sp_size == 1:
        return None
    if not getattr(trainer.args, "average_tokens_across_devices", False):
        raise SequenceParallelError(
            "sequence parallelism with the Trainer needs average_tokens_across_devices=True (the "
            "default): each rank's loss is a sum over its slice divided by the step's token count over "
            "all processes"
        )
    model = trainer.accelerator.unwrap_model(trainer.model)
    sp = enable_sequence_parallel(model, sp_size)
    build = trainer.get_train_dataloader

    def get_train_dataloader():
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

        inner = _WithoutVarlenKeys(build())
        adapter = UlyssesSPDataLoaderAdapter(inner, sp_rank=sp.rank, sp_group=sp.group, sp_world_size=sp.size,
                                             device=trainer.accelerator.device)
        return _TrainerSlices(adapter)

    trainer.get_train_dataloader = get_train_dataloader
    return sp


class _WithoutVarlenKeys:
    """A dataloader whose batches lose ``cu_seq_lens_*`` / ``max_length_*`` (they describe the
    whole row; each rank's attention finds the documents from the gathered ``position_ids``) and
    an all-ones ``attention_mask``; padding is refused (:func:`_padding_free`)."""

    def __init__(self, dl):
        self.dl = dl

    def __len__(self):
        return len(self.dl)

    def __iter__(self):
        for batch in self.dl:
            yield _padding_free(batch)

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dl, "set_epoch"):
            self.dl.set_epoch(epoch)


class _TrainerSlices:
    """DeepSpeed's adapter, with ``labels`` restored as the slice's shifted labels."""

    def __init__(self, adapter):
        self.adapter = adapter

    def __len__(self):
        return len(self.adapter)

    def __iter__(self):
        for batch in iter(self.adapter):
            batch["labels"] = batch["shift_labels"]
            yield batch

    def set_epoch(self, epoch: int) -> None:
        self.adapter.dl.set_epoch(epoch)

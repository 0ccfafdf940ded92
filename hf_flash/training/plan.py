"""The memory planner: which of hf_flash's training memory features a run needs.

Each feature buys memory with time, so a run should switch on only what it needs. From the model's
shape, the tokens of one micro-batch and the free device and host memory, :func:`make_plan`
predicts the peak of one training step for a ladder of settings, fastest first, and picks the
first that fits:

1. nothing: every layer keeps its activations; transformers' loss (full logits);
2. the chunked loss (:mod:`hf_flash.training.causal_lm`): no full logits;
3. activation checkpointing that keeps hf_flash's attention outputs (:mod:`hf_flash.checkpointing`):
   one attention forward per layer and step;
4. plain checkpointing (the attention forward runs again in the recomputation);
5. plus the tiled MLP (:mod:`hf_flash.training.tiled_mlp`): the MLP's intermediate
   (tokens x intermediate_size, several times the hidden state) exists one chunk at a time;
6. plus offloading each checkpointed layer input to pinned host memory
   (:mod:`hf_flash.training.offload`), which then needs ``layers x tokens x hidden`` bytes of host
   memory instead of device memory.

The model of a step's memory, per token (``a``: bytes of an activation element; ``h`` hidden,
``i`` intermediate, ``q``/``kv`` the query and key/value widths, ``L`` layers, ``V`` vocabulary):

- weights and LoRA state: every parameter's bytes, plus a gradient and two fp32 Adam moments per
  trainable parameter;
- a layer's forward-and-backward working set: ``attn = a(3h + 2q + 2kv) + 4h + 4 heads`` (norm
  input and output, projections, attention output, the RMSNorm's fp32 copy, the log-sum-exp;
  Liger-Kernel's RMSNorm keeps no fp32 copy, so ``4h`` goes here and in ``mlp``)
  plus the attention backward's ``4q + a(q + 2kv)`` (dQ's fp32 accumulator, dQ, dK, dV) and
  ``mlp = a(4i + 2h) + 4h`` (gate, up, activation, product; ``3i`` with Liger's SwiGLU, which
  keeps no activation), the MLP term counted for one chunk only when tiled;
- what crosses layers: nothing extra without checkpointing (every layer keeps its working set),
  ``a h`` per layer with checkpointing (its input), plus ``q a + 4 heads`` per layer when the
  attention outputs are kept; with offload two layer inputs stay on the device (the one being
  recomputed and the one prefetched) and each layer's input takes its own size of pinned host
  memory (held in power-of-two pieces, which torch's caching host allocator does not round up);
- the loss: ``V (2a + 8)`` per token for transformers' loss (the logits, their fp32 copy and
  gradients) or one chunk of ``V a`` plus ``a h`` per token (``dL/dh``) for the chunked loss;
- 3 ``a h`` per token of gradients and residuals in flight, and 10% allocator slack.

It is a prediction; ``benchmarks/results`` holds measured peaks beside it (the long-context
search), and the printed plan always says what it assumed.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from .offload import MIN_PIECE_BYTES

GIB = 2**30
SLACK = 1.10
# the ladder of settings, fastest first: (name, checkpointing, chunked loss, tiled MLP)
LADDER = (
    ("none", "none", False, False),
    ("chunked loss", "none", True, False),
    ("keep-attention checkpointing + chunked loss", "keep_attention", True, False),
    ("checkpointing + chunked loss", "recompute", True, False),
    ("checkpointing + tiled MLP + chunked loss", "recompute", True, True),
    ("offloaded checkpointing + tiled MLP + chunked loss", "offload", True, True),
)
CHECKPOINTING = ("none", "keep_attention", "recompute", "offload")


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the memory model reads from a model: its widths and parameter bytes."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    param_bytes: int
    trainable_params: int
    trainable_bytes: int

    @classmethod
    def of(cls, model) -> "Shape":
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        params = list(model.parameters())
        train = [p for p in params if p.requires_grad]
        return cls(
            hidden=config.hidden_size, intermediate=config.intermediate_size,
            layers=config.num_hidden_layers, heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads, head_dim=head_dim,
            vocab=config.vocab_size, param_bytes=sum(p.numel() * p.element_size() for p in params),
            trainable_params=sum(p.numel() for p in train),
            trainable_bytes=sum(p.numel() * p.element_size() for p in train),
        )  # fmt: skip


@dataclasses.dataclass
class Plan:
    """What :func:`make_plan` chose, and why."""

    tokens: int
    checkpointing: str  # one of CHECKPOINTING
    chunked_loss: bool
    tiled_mlp_tokens: Optional[int]  # chunk of the tiled MLP; None: not tiled
    device_gib: float  # predicted peak device memory
    host_gib: float  # predicted pinned host memory (offload)
    device_budget_gib: Optional[float]
    host_budget_gib: Optional[float]
    name: str = ""
    liger: tuple = ()  # Liger-Kernel functions used: "rms_norm", "swiglu"
    fits: bool = True
    considered: list = dataclasses.field(default_factory=list)  # (name, device GiB, host GiB)
    notes: list = dataclasses.field(default_factory=list)  # lines for describe()

    def describe(self) -> str:
        head = (f"hf_flash training plan for {self.tokens} tokens per micro-batch: {self.name or 'custom'}"
                f" (checkpointing={self.checkpointing}, chunked_loss={self.chunked_loss}, "
                f"tiled_mlp={self.tiled_mlp_tokens or 'off'}, liger={'+'.join(self.liger) or 'off'})")  # fmt: skip
        budget = f" of {self.device_budget_gib:.1f} GiB" if self.device_budget_gib else ""
        lines = [head, f"  predicted peak device memory {self.device_gib:.1f} GiB{budget}"]
        if self.host_gib:
            hb = f" of {self.host_budget_gib:.1f} GiB available" if self.host_budget_gib else ""
            lines.append(f"  pinned host memory for offloaded layer inputs {self.host_gib:.1f} GiB{hb}")
        if not self.fits:
            lines.append("  WARNING: no setting is predicted to fit; this is the most frugal one")
        lines += [f"  {note}" for note in self.notes]
        for name, dev, host in self.considered:
            lines.append(f"  considered: {name}: {dev:.1f} GiB device" + (f", {host:.1f} GiB host" if host else ""))
        return "\n".join(lines)


def rung_name(checkpointing: str, chunked_loss: bool, tiled_mlp: bool) -> str:
    """A setting in words, e.g. ``"offloaded checkpointing + tiled MLP + chunked loss"``."""
    parts = {"none": [], "keep_attention": ["keep-attention checkpointing"],
             "recompute": ["checkpointing"], "offload": ["offloaded checkpointing"]}[checkpointing]  # fmt: skip
    parts = parts + (["tiled MLP"] if tiled_mlp else []) + (["chunked loss"] if chunked_loss else [])
    return " + ".join(parts) or "none"


def predict(shape: Shape, tokens: int, *, checkpointing: str, chunked_loss: bool,
            tiled_mlp_tokens: Optional[int], act_bytes: int,
            loss_chunk_tokens: Optional[int] = None, fused_norm: bool = False,
            fused_swiglu: bool = False) -> tuple[float, float]:  # fmt: skip
    """Predicted (device GiB, pinned host GiB) of one training step (module docstring).
    ``fused_norm`` / ``fused_swiglu``: Liger-Kernel's RMSNorm (no float32 copy of the norm's
    input) / SwiGLU (no ``act(gate)``) run (:mod:`hf_flash.training.fused_ops`)."""
    if checkpointing not in CHECKPOINTING:
        raise ValueError(f"checkpointing={checkpointing!r}; choose one of {CHECKPOINTING}")
    a, h, i = act_bytes, shape.hidden, shape.intermediate
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    norm_copy = 0 if fused_norm else 4 * h  # the float32 copy autograd keeps, per norm
    attn = a * (3 * h + 2 * q + 2 * kv) + norm_copy + 4 * shape.heads
    # the attention backward's own buffers: dQ accumulated in fp32, then dQ, dK, dV in the
    # activation dtype (measured: without them the plan under-predicted the 8B shape at 256K
    # tokens by 3.3 GiB and the 1.2B shape at 512K by more than 4.5 GiB, an OOM)
    attn += 4 * q + a * (q + 2 * kv)
    mlp_rest = a * 2 * h + norm_copy
    mlp_wide = a * (3 if fused_swiglu else 4) * i
    wide_tokens = min(tokens, tiled_mlp_tokens) if tiled_mlp_tokens else tokens
    layer = tokens * (attn + mlp_rest) + wide_tokens * mlp_wide  # one layer's working set
    if checkpointing == "none":
        crossing = shape.layers * layer
        host = 0
    else:
        per_layer = tokens * a * h
        if checkpointing == "keep_attention":
            per_layer += tokens * (q * a + 4 * shape.heads)
        if checkpointing == "offload":
            # held in power-of-two pieces (offload.host_pieces): exact, but for the last piece
            host = shape.layers * (tokens * a * h + MIN_PIECE_BYTES)
            crossing = 2 * tokens * a * h
        else:
            host = 0
            crossing = shape.layers * per_layer
        crossing += layer  # the layer being recomputed and differentiated
    if chunked_loss:
        from .loss import default_chunk_tokens

        chunk = min(tokens, loss_chunk_tokens or default_chunk_tokens(shape.vocab, a))
        loss = chunk * shape.vocab * a + tokens * a * h
    else:
        loss = tokens * shape.vocab * (2 * a + 8)
    state = shape.trainable_bytes + shape.trainable_params * 8  # gradient + Adam moments
    inflight = 3 * tokens * a * h
    device = (shape.param_bytes + state + crossing + loss + inflight) * SLACK
    return device / GIB, host / GIB


def default_mlp_chunk(shape: Shape, tokens: int) -> int:
    """Tokens per tiled-MLP chunk: 8192 (the chunk's GEMMs stay large enough to run at full rate,
    and its intermediates, 8192 x intermediate_size each, stay far below one hidden state of a
    long sequence), or the whole input when shorter."""
    return min(tokens, 8192)


def host_available_gib() -> Optional[float]:
    """MemAvailable from /proc/meminfo (Linux), else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 / GIB
    except OSError:
        return None
    return None


def device_available_gib(device) -> Optional[float]:
    """What a step on ``device`` may use: its free memory plus what this process already holds
    (the weights, when the model is on it already). None off CUDA."""
    import torch

    if device is None or torch.device(device).type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return (free + torch.cuda.memory_reserved(device)) / GIB


def make_plan(shape: Shape, tokens: int, *, act_bytes: int, device_budget_gib: Optional[float],
              host_budget_gib: Optional[float] = None, allow: Optional[dict] = None,
              loss_chunk_tokens: Optional[int] = None, liger: tuple = ()) -> Plan:  # fmt: skip
    """The fastest rung of :data:`LADDER` predicted to fit ``device_budget_gib`` (and, when it
    offloads, 80% of ``host_budget_gib``); without a device budget (CPU) the first rung.
    ``allow`` restricts the choice: ``{"chunked_loss": False}``, ``{"checkpointing": "recompute"}``,
    ``{"tiled_mlp": False}``, ``{"offload": False}`` (a fixed value forces it; ``"checkpointing"``
    also takes ``"on"``: any form but none, and ``"no_keep"``: recompute or offload).
    ``liger``: the Liger-Kernel functions the run uses on every rung, ``("rms_norm", "swiglu")``
    or a part of it (:mod:`hf_flash.training.fused_ops`)."""
    if tokens < 1:
        raise ValueError(f"tokens={tokens} must be >= 1")
    allow = dict(allow or {})
    unknown = set(allow) - {"chunked_loss", "checkpointing", "tiled_mlp", "offload"}
    if unknown:
        raise ValueError(f"unknown plan constraints {sorted(unknown)}")
    tiled = allow.get("tiled_mlp")
    given_chunk = isinstance(tiled, int) and not isinstance(tiled, bool)
    mlp_chunk = tiled if given_chunk else default_mlp_chunk(shape, tokens)
    considered = []
    candidates = []
    for _, ckpt, chunked, tiled in LADDER:
        # a fixed value replaces the rung's own; the other features still climb the ladder
        if allow.get("checkpointing") == "on":  # any form but none
            ckpt = "keep_attention" if ckpt == "none" else ckpt
        elif allow.get("checkpointing") == "no_keep":  # a form that recomputes the attention
            ckpt = "recompute" if ckpt in ("none", "keep_attention") else ckpt
        elif allow.get("checkpointing") not in (None, "auto"):
            ckpt = allow["checkpointing"]
        if allow.get("offload") is False and ckpt == "offload":
            ckpt = "recompute"
        if allow.get("chunked_loss") is not None:
            chunked = bool(allow["chunked_loss"])
        if allow.get("tiled_mlp") is not None:
            tiled = bool(allow["tiled_mlp"])
        if (ckpt, chunked, tiled) not in [c[1:] for c in candidates]:
            candidates.append((rung_name(ckpt, chunked, tiled), ckpt, chunked, tiled))
    best = None
    for name, ckpt, chunked, tiled in candidates:
        dev, host = predict(shape, tokens, checkpointing=ckpt, chunked_loss=chunked,
                            tiled_mlp_tokens=mlp_chunk if tiled else None, act_bytes=act_bytes,
                            loss_chunk_tokens=loss_chunk_tokens, fused_norm="rms_norm" in liger,
                            fused_swiglu="swiglu" in liger)  # fmt: skip
        considered.append((name, dev, host))
        plan = Plan(tokens=tokens, checkpointing=ckpt, chunked_loss=chunked,
                    tiled_mlp_tokens=mlp_chunk if tiled else None, device_gib=dev, host_gib=host,
                    device_budget_gib=device_budget_gib, host_budget_gib=host_budget_gib, name=name,
                    liger=tuple(liger))  # fmt: skip
        best = plan
        fits_device = device_budget_gib is None or dev <= device_budget_gib
        fits_host = host == 0 or host_budget_gib is None or host <= 0.8 * host_budget_gib
        if fits_device and fits_host:
            break
    else:
        best.fits = False
    best.considered = considered
    return best

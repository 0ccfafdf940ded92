"""Where one training step's device time goes: a torch.profiler summary grouped by kind.

Used by the recipe's ``profile_step`` option. Kernels are grouped by name into kinds
(hf_flash attention, GEMMs, elementwise, ...) so that a long step's time can be compared
with a FLOP estimate of its GEMMs and attention; the raw tables follow the summary.
"""

from __future__ import annotations

import re

# first match wins; patterns are matched against the kernel's name, lower-cased
KINDS = (
    ("attention forward (hf_flash)", r"_flash_fwd_kernel|_attn_fwd_kernel|_document_schedule_kernel"),
    # the backward's launches: the preprocess, [the key-bounds pre-pass], dK/dV (Triton or Gluon,
    # split-D too), dQ (Triton or Gluon), the fragment-order dQ's cast into dq, the tail pieces' sum
    ("attention backward (hf_flash)",
     r"_bwd_(dkdv|dq)_kernel|_bwd_preprocess|_bwd_bounds_pre_pass|_attn_bwd|_attn_dq_kernel|_dq_frag_to_bshd|_tail_sum"),
    ("attention (other)", r"flash|fmha|attention|sdpa|cudnn"),
    ("rotary (hf_flash)", r"_rotary_kernel"),
    ("cross-entropy (hf_flash)", r"_cross_entropy"),
    ("GEMM", r"gemm|cutlass|nvjet|xmma|cublas|sm90_|sm80_|matmul"),
    ("optimizer", r"multi_tensor|adam|foreach"),
    ("reduction", r"reduce|norm|softmax|sum"),
    ("copy / cast / fill", r"copy|cast|fill|memcpy|memset|cat|index|scatter|gather"),
    ("elementwise", r"elementwise|vectorized|unrolled|triton_"),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, pattern in KINDS:
        if re.search(pattern, low):
            return kind
    return "other"


def device_events(prof):
    """Kernel-level events (device side) of a finished ``torch.profiler.profile``."""
    import torch

    cuda = torch.autograd.DeviceType.CUDA
    return [e for e in prof.events() if e.device_type == cuda]


def _per_name(kernels) -> dict[str, list]:
    """Kernel name -> [device microseconds, launches]."""
    per_name: dict[str, list] = {}
    for e in kernels:
        entry = per_name.setdefault(e.name, [0.0, 0])
        entry[0] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        entry[1] += 1
    return per_name


def by_kind(per_name: dict[str, list]) -> dict[str, list]:
    """Kind (``KINDS``) -> [device microseconds, launches]."""
    kinds: dict[str, list] = {}
    for name, (us, n) in per_name.items():
        entry = kinds.setdefault(kind_of(name), [0.0, 0])
        entry[0] += us
        entry[1] += n
    return kinds


def attention_share(prof) -> dict:
    """Device time of one profiled step: the attention kernels' milliseconds (every kind whose
    name starts with "attention", whoever provides them) and their share of the busy time."""
    kinds = by_kind(_per_name(device_events(prof)))
    busy = sum(v[0] for v in kinds.values())
    attention = sum(v[0] for k, v in kinds.items() if k.startswith("attention"))
    return {"device_ms": busy / 1e3, "attention_ms": attention / 1e3,
            "attention_share": attention / busy if busy else None}  # fmt: skip


def summary(prof, wall_s: float, top: int = 30) -> str:
    """A text report: device time by kind, the top kernels, the top host operators."""
    kernels = device_events(prof)
    per_name = _per_name(kernels)
    kinds = by_kind(per_name)
    busy = sum(v[0] for v in kinds.values())
    lines = [
        f"step wall {wall_s * 1e3:.1f} ms (under the profiler), kernels {len(kernels)}, "
        f"device busy {busy / 1e3:.1f} ms ({busy / 1e4 / max(wall_s, 1e-9):.0f}% of wall)",
        "",
        f"{'kind':<32} {'ms':>10} {'share':>7} {'kernels':>8}",
    ]
    for kind, (us, n) in sorted(kinds.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"{kind:<32} {us / 1e3:>10.1f} {us / max(busy, 1e-9):>7.1%} {n:>8}")
    lines += ["", f"top {top} kernels by device time", f"{'ms':>10} {'count':>6}  {'kind':<24} name"]
    for name, (us, n) in sorted(per_name.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"{us / 1e3:>10.2f} {n:>6}  {kind_of(name):<24} {name[:110]}")
    lines += ["", "host operators by self CPU time", prof.key_averages().table(
        sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60)]
    return "\n".join(lines)

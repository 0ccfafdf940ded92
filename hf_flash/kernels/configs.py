"""Launch configurations (tile sizes, warps, pipeline stages) per GPU generation.

Every launcher asks this module, so a faster variant for one architecture is a new entry here,
not a change to the kernels or the API. Choices are data, not autotuning: autotuning would time
every candidate inside the first training step (and every candidate in the CPU interpreter), and
the set below was picked by ``benchmarks/attention.py --sweep-configs`` on the hardware named
next to each entry.

``override(...)`` replaces the choice for a block of code; the sweep uses it.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Optional

import torch

# A module global, not a ContextVar: autograd runs the backward on its own worker thread, where
# a context variable set by the caller is not visible (torch < 2.12).
_OVERRIDE: Optional[dict] = None
# Whether forward calls the Gluon Hopper kernel covers run on it (kernels/hopper); read once,
# HF_FLASH_HOPPER=0 keeps every call on the Triton kernels. use_hopper() switches it for a block.
_HOPPER = os.environ.get("HF_FLASH_HOPPER", "1") not in ("0", "", "false", "False")
# The Gluon backward alone: HF_FLASH_HOPPER_BWD=0 (or use_hopper_backward(False)) keeps the
# backward on the Triton kernels while the Gluon forward runs.
_HOPPER_BWD = os.environ.get("HF_FLASH_HOPPER_BWD", "1") not in ("0", "", "false", "False")
# Packed (varlen) forward calls on the Gluon kernel (head dim 128): on by default;
# HF_FLASH_HOPPER_VARLEN=0 (or use_hopper_varlen(False)) keeps them on the Triton varlen kernel.
# H100, 12 documents in 16K tokens: 504 vs 366 TFLOP/s through the API, 0.34 vs 0.26 ms of host
# time per call (one schedule launch and the cached Gluon launch).
_HOPPER_VARLEN = os.environ.get("HF_FLASH_HOPPER_VARLEN", "1") not in ("0", "", "false", "False")
# Bitwise-deterministic gradients (the default). HF_FLASH_DETERMINISTIC=0 (or
# use_deterministic(False)) lets the Gluon Hopper backward add dQ with atomic reductions where that
# measured faster; the gradients then differ between runs by float32 rounding.
_DETERMINISTIC = os.environ.get("HF_FLASH_DETERMINISTIC", "1") not in ("0", "", "false", "False")


def interpreting() -> bool:
    """True when Triton's CPU interpreter is on (``TRITON_INTERPRET`` set and not 0). The one
    interpreter check of hf_flash (``hf_flash._runtime.interpreter_active`` is this function):
    kernels defined while it is on are interpreted, and the launchers then take CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class InterpreterUnsupported(RuntimeError):
    """Triton's CPU interpreter cannot run with the installed packages (one-line message)."""


def _version(text: str) -> tuple:
    parts = []
    for piece in text.split("+")[0].split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def _interpreter_needs_mend() -> bool:
    """Triton <= 3.6's CPU interpreter turns a scalar tensor into a Python index with
    ``int(ndarray)`` (``tensor.__index__``: loop bounds loaded from memory, e.g. cu_seqlens),
    which numpy >= 2.4 refuses for one-element arrays (``TypeError: only 0-dimensional arrays
    can be converted to Python scalars``)."""
    import numpy
    import triton

    return _version(triton.__version__) <= (3, 6) and _version(numpy.__version__) >= (2, 4)


def mend_interpreter_index() -> bool:
    """Make Triton's interpreter read a scalar tensor's one element for ``__index__`` (what
    ``int()`` of a one-element array did before numpy 2.4). It wraps the interpreter's
    ``_patch_lang_tensor`` (which installs ``tl.tensor``'s Python-level methods for the length of
    an interpreted launch and restores them after): the original runs, then ``__index__`` is
    replaced within the same restorable scope. True when the mend is in place; False when this
    Triton's interpreter does not have the function it wraps (then nothing is changed)."""
    try:
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - every supported Triton has it
        return False
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None:
        return False
    if getattr(original, "_hf_flash_index_mend", False):
        return True

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patch_lang_tensor._hf_flash_index_mend = True
    patch_lang_tensor.__wrapped__ = original
    interpreter._patch_lang_tensor = patch_lang_tensor
    return True


def interpreter_numpy_problem() -> Optional[str]:
    """Why Triton's CPU interpreter would fail with the installed numpy, or None.

    Triton <= 3.6 with numpy >= 2.4 (see :func:`_interpreter_needs_mend`) works once
    :func:`mend_interpreter_index` is in place (:func:`check_interpreter` puts it there); this
    names the fix only when the mend cannot apply."""
    import numpy
    import triton

    if not _interpreter_needs_mend():
        return None
    from triton.runtime import interpreter

    if getattr(interpreter, "_patch_lang_tensor", None) is not None:
        return None
    return (
        f"Triton {triton.__version__}'s CPU interpreter (TRITON_INTERPRET=1) does not work "
        f"with numpy {numpy.__version__}: install numpy<2.4 (pip install 'numpy<2.4')"
    )


def check_interpreter() -> None:
    """With the interpreter on: mend it for numpy >= 2.4 where needed, and raise
    :class:`InterpreterUnsupported` when it still cannot work here."""
    if interpreting():
        if _interpreter_needs_mend():
            mend_interpreter_index()
        problem = interpreter_numpy_problem()
        if problem is not None:
            raise InterpreterUnsupported(problem)


@functools.lru_cache(maxsize=None)
def _properties(index: int):
    return torch.cuda.get_device_properties(index)


def _cuda_properties(device: torch.device):
    """The CUDA device's properties, read once per device (a launcher asks on every call)."""
    return _properties(device.index if device.index is not None else torch.cuda.current_device())


def _capability(device: torch.device) -> tuple[int, int]:
    if device.type != "cuda":
        return (0, 0)
    props = _cuda_properties(device)
    return (props.major, props.minor)


def sm_count(device: torch.device, default: int) -> int:
    """Streaming multiprocessors of a CUDA ``device``; ``default`` for any other device (the
    interpreter, or a CPU-side compile check), where a launcher still sizes its grid."""
    if device.type != "cuda":
        return default
    return _cuda_properties(device).multi_processor_count


# Host-side integer helpers for launchers. triton.cdiv and triton.next_power_of_2 are constexpr
# functions in Triton 3.6 (usable inside kernels too); every host call goes through their
# argument-unwrapping wrapper, ~2 us each, which a decode step paid dozens of times per layer.
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (0 for n <= 0, as triton.next_power_of_2)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def _first_tensor(args):
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
        if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
            return a[0]
    return None


def on_input_device(launcher):
    """Decorator for host launchers: Triton launches on the *current* CUDA device, so make the
    device of the first tensor argument current for the call (a model split over several GPUs
    by ``device_map`` runs layers on a device that is not the current one). When it already is
    current this costs one device query."""

    @functools.wraps(launcher)
    def wrapper(*args, **kwargs):
        t = _first_tensor(args)
        if t is None:
            return launcher(*args, **kwargs)
        with device_guard(t.device):
            return launcher(*args, **kwargs)

    return wrapper


_SAME_DEVICE = contextlib.nullcontext()


def device_guard(device: torch.device):
    """``torch.cuda.device(device)`` for a launch on ``device``, or a no-op context when it is
    already the current device (the usual case: entering and leaving torch's device context
    costs ~3 us of host time, the check ~0.5)."""
    if device.type != "cuda" or device.index is None or device.index == torch.cuda.current_device():
        return _SAME_DEVICE
    return torch.cuda.device(device)


def head_dim_block(head_dim: int) -> int:
    """Head dimension padded to a power of two (>= 16, tl.dot's minimum); at most 512
    (``hf_flash._checks.MAX_HEAD_DIM``)."""
    return max(16, 1 << (head_dim - 1).bit_length())


@contextlib.contextmanager
def override(**kw):
    """Force launch parameters, e.g. ``override(fwd={"BLOCK_M": 64, ...})``.

    Keys: ``fwd``, ``bwd_dkdv``, ``bwd_dq`` mapping to dicts of BLOCK_M, BLOCK_N, num_warps,
    num_stages and optionally packed_maxnreg / one_wave_stages (a named kernel's defaults for
    these are dropped unless given again). Unnamed kernels keep their defaults.
    """
    global _OVERRIDE
    previous, _OVERRIDE = _OVERRIDE, kw
    try:
        yield
    finally:
        _OVERRIDE = previous


@contextlib.contextmanager
def use_hopper(enabled: bool):
    """Switch the Gluon Hopper forward on or off for a block (benchmarks time both paths)."""
    global _HOPPER
    previous, _HOPPER = _HOPPER, bool(enabled)
    try:
        yield
    finally:
        _HOPPER = previous


@contextlib.contextmanager
def use_hopper_varlen(enabled: bool):
    """Switch packed (varlen) forward calls onto the Gluon Hopper kernel (the default) or off it
    for a block (``HF_FLASH_HOPPER_VARLEN``; benchmarks and tests time and check both paths)."""
    global _HOPPER_VARLEN
    previous, _HOPPER_VARLEN = _HOPPER_VARLEN, bool(enabled)
    try:
        yield
    finally:
        _HOPPER_VARLEN = previous


def hopper_varlen_enabled() -> bool:
    """Packed forward calls may take the Gluon kernel (the default; ``HF_FLASH_HOPPER_VARLEN=0``
    keeps them on Triton)."""
    return _HOPPER_VARLEN


@contextlib.contextmanager
def use_hopper_backward(enabled: bool):
    """Switch the Gluon Hopper backward alone on or off for a block (the forward follows
    :func:`use_hopper`); benchmarks time the Triton backward behind the Gluon forward."""
    global _HOPPER_BWD
    previous, _HOPPER_BWD = _HOPPER_BWD, bool(enabled)
    try:
        yield
    finally:
        _HOPPER_BWD = previous


@contextlib.contextmanager
def use_deterministic(enabled: bool):
    """Require bitwise-deterministic gradients (True, the default) or allow the backward's atomic
    dQ accumulation (False) for a block."""
    global _DETERMINISTIC
    previous, _DETERMINISTIC = _DETERMINISTIC, bool(enabled)
    try:
        yield
    finally:
        _DETERMINISTIC = previous


def deterministic() -> bool:
    """Whether the backward must be bitwise deterministic (``HF_FLASH_DETERMINISTIC``,
    :func:`use_deterministic`)."""
    return _DETERMINISTIC


# Bumped by every switch that changes which Gluon variant a call runs without changing the call
# (the kernels' ``pinned`` context managers, on entry and on exit): the public path's call plans
# (``hf_flash.interface._dense_plan``) hold it in their key, so none outlives the tables it was
# built from. Changing a variant table by hand (tests' monkeypatches) does not bump it: such code
# runs the general path or switches plans off (``launch.launch_plans(False)``).
_DISPATCH_EPOCH = 0


def dispatch_changed() -> None:
    """Say that the variant tables changed: call plans built before are not used again."""
    global _DISPATCH_EPOCH
    _DISPATCH_EPOCH += 1


def dispatch_epoch() -> int:
    """How many times :func:`dispatch_changed` has run (a call plan's key holds it)."""
    return _DISPATCH_EPOCH


def hopper_backward_enabled(device: torch.device) -> bool:
    """The Gluon Hopper backward may run on ``device``: :func:`hopper_enabled` and not switched
    off on its own (``HF_FLASH_HOPPER_BWD``, :func:`use_hopper_backward`)."""
    return _HOPPER_BWD and hopper_enabled(device)


# Gluon (triton.experimental.gluon) changes its API between Triton releases: the Hopper kernels
# are written and measured against these.
GLUON_TRITON = ("3.6.",)


def gluon_triton_supported() -> bool:
    """The installed Triton is one the Gluon Hopper kernels are written for (:data:`GLUON_TRITON`)."""
    import triton

    return triton.__version__.startswith(GLUON_TRITON)


_GLUON_NOTE_SHOWN = False


def hopper_enabled(device: torch.device) -> bool:
    """The Gluon Hopper kernels may run on ``device``: switched on (``HF_FLASH_HOPPER``,
    :func:`use_hopper`), a compute-capability 9.0 GPU (H100, H200; the kernels are built for
    sm_90a), a Triton release the kernels are written for (:func:`gluon_triton_supported`; with
    another one the Triton kernels run and a warning says so once), not under the interpreter,
    and no :func:`override` of the Triton tiles in force (a sweep times the Triton kernels)."""
    if not (
        _HOPPER and _OVERRIDE is None and device.type == "cuda" and not interpreting()
        and _capability(device) == (9, 0)
    ):  # fmt: skip
        return False
    if gluon_triton_supported():
        return True
    global _GLUON_NOTE_SHOWN
    if not _GLUON_NOTE_SHOWN:
        import warnings

        import triton

        _GLUON_NOTE_SHOWN = True
        warnings.warn(
            f"hf_flash: the Gluon Hopper kernels are written for Triton {', '.join(v + 'x' for v in GLUON_TRITON)}; "
            f"with Triton {triton.__version__} every call runs hf_flash's portable Triton kernels "
            "(install triton==3.6.* for the faster H100/H200 path)", stacklevel=2,
        )  # fmt: skip
    return False


def _pick(kind: str, default: dict) -> dict:
    forced = _OVERRIDE
    if forced and kind in forced:
        # a register cap or a one-wave stage count belongs to the tile it was chosen for: kept
        # only if the override says so
        base = {k: v for k, v in default.items() if k not in ("packed_maxnreg", "one_wave_stages")}
        return {**base, **forced[kind]}
    return default


def launch_options(cfg: dict, packed: bool = False) -> dict:
    """The Triton launch options of a config: warps, stages and, for packed (varlen) launches,
    the config's ``packed_maxnreg`` register cap where it has one."""
    opts = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    if packed and cfg.get("packed_maxnreg"):
        opts["maxnreg"] = cfg["packed_maxnreg"]
    return opts


# Small tiles in the interpreter: numpy-backed, so cost follows the number of tiles touched and
# tests want several tiles per sequence to exercise boundaries.
_INTERPRETER = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}


# Head dims 257..512 (BLOCK_D = 512; gemma4's global layers use 512). Not swept on hardware:
# sized so that every tile fits shared memory with margin and the fp32 accumulators stay near
# 128 registers per thread. Shared memory is roughly stages x (the streamed tiles) x BLOCK_D x
# bytes per element, plus the tiles a program keeps (its Q, or its K and V) x BLOCK_D x bytes;
# budgets are 227 KB (Hopper), 164 KB (A100), 99 KB (sm_86 / Ada) and 64 KB (Turing).
# * forward, bf16/fp16, Hopper (64, 32, 8 warps, 2 stages): Q 64 x 512 x 2 = 64 KB, K and V
#   2 stages x 2 x 32 x 512 x 2 = 128 KB, 192 KB in all; the 64 x 512 fp32 accumulator over 256
#   threads is 128 registers each.
# * forward, bf16/fp16, Ampere / Ada (32, 16, 8, 1): Q 32 KB + K and V 2 x 16 x 512 x 2 = 32 KB,
#   64 KB (fits sm_86's 99 KB); accumulator 32 x 512 / 256 threads = 64 registers.
# * forward, float32 or older GPUs (16, 16, 4, 1), the smallest tl.dot tiles: Q 16 x 512 x 4 =
#   32 KB + K and V 2 x 16 x 512 x 4 = 64 KB, 96 KB in float32 (48 KB in 16-bit).
# * backward dK/dV (keeps K, V and the fp32 dK, dV of BLOCK_N keys; streams Q and dO tiles of
#   BLOCK_M rows), Hopper (32, 32, 8, 1; measured faster than the (16, 32, 8, 2) this arithmetic
#   first gave): Q, dO 2 x 32 x 512 x 2 = 64 KB, K, V 2 x 32 x 512 x 2 = 64 KB, 128 KB; dK + dV
#   2 x 32 x 512 fp32 / 256 threads = 128 registers.
#   Elsewhere (16, 16, 8, 1): 32 + 32 = 64 KB (128 KB in float32), 64 registers.
# * backward dQ (keeps Q, dO and the fp32 dQ of BLOCK_M rows; streams K and V tiles), Hopper
#   (64, 32, 8, 1; measured, as dK/dV): K, V 2 x 32 x 512 x 2 = 64 KB + Q, dO 2 x 64 x 512 x 2 =
#   128 KB, 192 KB; dQ 64 x 512 / 256 threads = 128 registers. Elsewhere (16, 16, 8, 1): 32 + 32 = 64 KB (128 KB
#   in float32, which therefore wants an A100 or a Hopper GPU at these head dims).
def _wide_fwd_config(dtype: torch.dtype, major: int) -> dict:
    if dtype == torch.float32 or major < 8:
        return {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    if major >= 9:
        return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2}
    return {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 8, "num_stages": 1}


def _wide_bwd_configs(dtype: torch.dtype, major: int) -> tuple[dict, dict]:
    if dtype != torch.float32 and major >= 9:
        # benchmarks/attention.py --sweep-configs --head-dims 512 (H100 bf16 causal, whole
        # backward, the other kernel at its previous default, 2026-11-25): dK/dV (32, 32, 8 warps,
        # 1 stage) 74.9 / 299.8 ms at S = 4K / 16K against 96.8 / 384.4 for (16, 32, 8, 2);
        # dQ (64, 32, 8, 1) 85.4 / 335.8 against the same (its 1-stage (32, 32) 193 / 793)
        return ({"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 8, "num_stages": 1},
                {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 8, "num_stages": 1})  # fmt: skip
    small = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 8, "num_stages": 1}
    return dict(small), dict(small)


def fwd_config(head_dim: int, dtype: torch.dtype, device: torch.device) -> dict:
    if interpreting():
        return _pick("fwd", dict(_INTERPRETER))
    d = head_dim_block(head_dim)
    major, _ = _capability(device)
    if d > 256:
        cfg = _wide_fwd_config(dtype, major)
    elif dtype == torch.float32:
        cfg = {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    elif major >= 9:  # Hopper (H100 / H200), measured on H100 SXM
        # benchmarks/diagnostics/probe_attention.py, bf16 d=128 causal, B*S = 16K: (128, 128,
        # 8 warps, 3 stages) 426 / 486 TFLOP/s at S = 4K / 16K; (128, 64, 8, 3) 414 / 473;
        # (64, 64, 4, 3) 435 / 453; (128, 64, 4, 3) 195 / 232 (too few warps for a 128-row tile).
        # d <= 64: benchmarks/attention.py --sweep-configs --head-dims 64 (results/
        # attention_configs-*.json): (128, 64, 8, 3) 0.737 / 2.636 ms at S = 4K / 16K against
        # 0.910 / 3.084 for the d=128 tile (128, 128, 8, 3), the best of 8 candidates at both.
        # packed_maxnreg 128: ptxas gives the packed (varlen) build of this tile 143 registers
        # per thread (the dense one 124), one 8-warp program per SM instead of two, and the
        # packed forward ran 1.3x slower than the dense one at S = 32K (13.7 vs 10.5 ms,
        # benchmarks/diagnostics/probe_layouts.py). Capped it takes 109, no spills
        # (benchmarks/diagnostics/kernel_registers.py), and runs as fast as the dense one
        # (10.5-10.8 ms). The dense build, already at two programs per SM, is left as the tile
        # sweep measured it.
        if d <= 64:
            cfg = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3,
                   "packed_maxnreg": 128}  # fmt: skip
        elif d <= 128:
            cfg = {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}
        else:
            cfg = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
    elif major == 8:  # Ampere / Ada: 100-164 KB of shared memory
        if d <= 128:
            cfg = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4 if d <= 64 else 8, "num_stages": 2}
        else:
            cfg = {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    else:  # older or unknown GPUs: small tiles that fit any shared-memory budget
        cfg = {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}
    return _pick("fwd", cfg)


def bwd_configs(head_dim: int, dtype: torch.dtype, device: torch.device) -> tuple[dict, dict]:
    """(dK/dV kernel, dQ kernel). dK/dV tiles keys by BLOCK_N and walks queries by BLOCK_M;
    dQ tiles queries by BLOCK_M and walks keys by BLOCK_N."""
    if interpreting():
        return _pick("bwd_dkdv", dict(_INTERPRETER)), _pick("bwd_dq", dict(_INTERPRETER))
    d = head_dim_block(head_dim)
    major, _ = _capability(device)
    if d > 256:
        dkdv, dq = _wide_bwd_configs(dtype, major)
    elif dtype == torch.float32 or major < 8:
        dkdv = {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1}
        dq = {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}
    elif d <= 64 and major >= 9:
        # the same sweep at d=64 (whole backward, other kernel at its default): dK/dV
        # (64, 64, 4 warps, 3 stages) 2.29 / 7.75 ms at S = 4K / 16K vs 2.36 / 8.76 for the d=128
        # tiles; dQ (128, 32, 4, 3) 2.37 / 8.15 (best at 16K; (64, 64, 4, 3) 2.28 / 8.22).
        dkdv = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
        dq = {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3}
    elif d <= 128:
        # benchmarks/attention.py --sweep-configs, H100 bf16 d=128 causal (results/
        # attention_configs-*.json): dK/dV (32, 64, 4 warps, 3 stages) 3.93 / 14.68 ms at
        # S = 4K / 16K vs 4.53 / 15.79 for (32, 128, 8, 2); dQ (64, 32, 4, 3) 4.45 / 15.69 vs
        # 4.52 / 15.80 for (128, 64, 8, 2) (whole backward, other kernel at its default).
        dkdv = {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
        dq = {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3}
    elif major >= 9:
        # head dims 129..256, H100: benchmarks/attention.py --sweep-configs --head-dims 256 (bf16
        # causal, whole backward, the other kernel at its previous default; session 22): dQ
        # (128, 32, 8 warps, 2 stages) 15.2 / 55.7 ms at S = 4K / 16K against 22.0 / 83.8 for
        # (64, 32, 8, 1), which spilled 532 bytes per thread (0 now); dK/dV (32, 64, 8, 3) 19.9 /
        # 75.2 against 22.0 / 83.8 for (32, 64, 8, 1) (spills 248 bytes instead of 564)
        dkdv = {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
        dq = {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2}
    else:
        dkdv = {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 8, "num_stages": 1}
        dq = {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 8, "num_stages": 1}
    return _pick("bwd_dkdv", dkdv), _pick("bwd_dq", dq)

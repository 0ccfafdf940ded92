"""The error rule of DESIGN.md, shared by every attention test.

A kernel result is compared against the float32 oracle. Its max error must be at most ``factor``
times the max error of the same oracle computed in the input dtype (2x for outputs, 3x for
gradients), plus a small absolute floor for float32, where the low-precision oracle *is* the
float32 oracle and its own error is zero.
"""

from __future__ import annotations

import torch

from hf_flash.reference import max_abs_err

FWD_FACTOR = 2.0
GRAD_FACTOR = 3.0


def floor_for(dtype: torch.dtype) -> float:
    # float32: summation-order differences only (~1e-6 on unit-scale data); half types: the
    # rounding of one output element, so all-zero reference errors do not demand exactness.
    return {torch.float32: 2e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]


def assert_close_to_ref(name: str, got, ref_exact, ref_lowp, factor: float, dtype) -> None:
    """got / ref_lowp versus ref_exact: err(got) <= factor * err(ref_lowp) + floor."""
    err = max_abs_err(got, ref_exact)
    budget = max_abs_err(ref_lowp, ref_exact)
    allowed = factor * budget + floor_for(dtype)
    mean = (got.float() - ref_exact.float()).abs().mean().item() if got.numel() else 0.0
    assert err <= allowed, (
        f"{name}: max err {err:.3e} (mean {mean:.3e}) exceeds {factor}x the {dtype} reference's "
        f"own error {budget:.3e} + floor {floor_for(dtype):.1e}"
    )


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    """torch.empty_like filled with NaN, so unwritten elements fail comparisons."""
    return torch.full_like(t, float("nan"))

"""pytest plugin for the upstream runs (``-p hf_flash_upstream``; scripts/upstream_tests.sh).

- transformers' tests: ``require_flash_attn`` passes only where hf_flash can run (a CUDA device,
  or ``HF_FLASH_UPSTREAM_CPU=1`` for Triton's interpreter); the files themselves name "hf_flash"
  where they named "flash_attention_2" (tests/upstream/layout.py).
- flash-attn's tests: cases whose check needs flash-attn's CUDA internals are skipped with the
  reason; ``HF_FLASH_UPSTREAM_PER_TEST=N`` keeps N runnable cases per test function (a fixed
  pseudo-random sample), since the full grid is tens of thousands of cases.
- ``HF_FLASH_UPSTREAM_LOG=path``: each outcome appended as soon as it is known.
"""

from __future__ import annotations

import os
import random
import unittest

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import hf_flash  # noqa: E402,F401  (registers "hf_flash" with transformers)

# flash-attn's S_dmask is exp(s - m) with m the running maximum of its kernel's key blocks, and
# these tests rebuild the probabilities from it with _get_block_size_n; hf_flash returns the
# probabilities themselves, so only those checks cannot apply.
_NEEDS_BLOCK_SCALING = {
    "test_flash_attn_qkvpacked", "test_flash_attn_varlen_qkvpacked", "test_flash_attn_output",
    "test_flash_attn_varlen_output",
}  # fmt: skip
_BLOCK_SCALING_REASON = (
    "needs flash-attn's CUDA-kernel block scaling of S_dmask (_get_block_size_n) to rebuild "
    "the probabilities; hf_flash returns them normalised"
)


def _hf_flash_runs() -> bool:
    return torch.cuda.is_available() or os.environ.get("HF_FLASH_UPSTREAM_CPU") == "1"


def pytest_configure(config):
    try:
        import transformers.testing_utils as tu
    except ImportError:
        return

    def require_flash_attn(test_case):
        return unittest.skipUnless(_hf_flash_runs(), "hf_flash needs a CUDA device here")(test_case)

    tu.require_flash_attn = require_flash_attn


def _skip_reason(item) -> str | None:
    params = getattr(getattr(item, "callspec", None), "params", {})
    if item.originalname in _NEEDS_BLOCK_SCALING and params.get("dropout_p", 0.0) > 0.0:
        return _BLOCK_SCALING_REASON
    return None


def pytest_collection_modifyitems(config, items):
    per_test = int(os.environ.get("HF_FLASH_UPSTREAM_PER_TEST", "0"))
    groups: dict = {}
    for item in items:
        if item.module.__name__.endswith("test_flash_attn"):
            groups.setdefault(item.originalname, []).append(item)
    keep, deselected = [], []
    for item in items:
        name = getattr(item, "originalname", None)
        if name not in groups:
            keep.append(item)
    for name, group in groups.items():
        runnable = [it for it in group if _skip_reason(it) is None]
        skipped = [it for it in group if _skip_reason(it) is not None]
        if per_test:
            chosen = set(map(id, random.Random(name).sample(runnable, min(per_test, len(runnable)))))
            # a few skipped cases stay in the report, so the reason is visible
            chosen |= set(map(id, random.Random(name).sample(skipped, min(2, len(skipped)))))
        else:
            chosen = set(map(id, group))
        for it in group:
            if id(it) in chosen:
                reason = _skip_reason(it)
                if reason:
                    it.add_marker(pytest.mark.skip(reason=reason))
                keep.append(it)
            else:
                deselected.append(it)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = keep


def pytest_runtest_logreport(report):
    path = os.environ.get("HF_FLASH_UPSTREAM_LOG")
    if not path or not (report.when == "call" or report.outcome != "passed"):
        return
    if report.when != "call" and report.outcome == "passed":
        return
    with open(path, "a") as f:
        f.write(f"{report.outcome.upper()} {report.nodeid} ({report.duration:.1f}s)\n")
        if report.failed:
            f.write(str(report.longrepr)[-3000:] + "\n")

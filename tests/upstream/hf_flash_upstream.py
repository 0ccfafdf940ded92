"""pytest plugin for the upstream runs (``-p hf_flash_upstream``; scripts/upstream_tests.sh).

- transformers' tests: ``require_flash_attn`` passes only where hf_flash can run (a CUDA device,
  or ``HF_FLASH_UPSTREAM_CPU=1`` for Triton's interpreter); the files themselves name "hf_flash"
  where they named "flash_attention_2" (tests/upstream/layout.py).
- flash-attn's tests: cases whose check needs flash-attn's CUDA internals are skipped with the
  reason; ``HF_FLASH_UPSTREAM_PER_TEST=N`` keeps N runnable cases per test function (a fixed
  pseudo-random sample), since the full grid is tens of thousands of cases.
- transformers' tests whose file (the git tree's, older than the installed release) does not
  match the installed library are skipped with the reason, decided from the library at run
  time (:func:`_tree_mismatch`), never from a list of failing names: a test looking for a
  ``*FlashAttention*`` layer class the installed modeling file no longer defines, and the compile
  test of a class that sets ``_torch_compile_train_cls = None`` (the tree's way of saying "no
  compile test"; the release's common test only checks that the attribute exists).
- A test that fails only because it downloads from the Hub (checkpoints, tokenizers) while
  ``HF_HUB_OFFLINE=1`` is reported as skipped with that reason: it cannot run on these machines.
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


def _tree_mismatch(item) -> str | None:
    """Why a transformers test cannot apply to the installed library, or None."""
    cls = getattr(item, "cls", None)
    name = getattr(item, "originalname", item.name)
    if cls is None:
        return None
    if name.endswith("can_compile_with_attention_mask_None_without_graph_break"):
        if "_torch_compile_train_cls" in vars(cls) and cls._torch_compile_train_cls is None:
            return (f"{cls.__name__} sets _torch_compile_train_cls = None (no compile test "
                    f"for this family); the installed release's common test expects it absent")
    if name == "test_use_flash_attention_2_true":
        module = _modeling_module(item)
        if module is not None and not any("FlashAttention" in n for n in vars(module)):
            return (f"looks for a *FlashAttention* layer class; {module.__name__} in the installed "
                    f"transformers defines none (one attention class, through the attention "
                    f"interface), so it fails the same with flash_attention_2")  # fmt: skip
    return None


def _modeling_module(item):
    """transformers.models.<family>.modeling_<family> for a test under tests/models/<family>/."""
    import importlib

    parts = item.module.__name__.split(".")
    if "models" not in parts[:-1]:
        return None
    family = parts[parts.index("models") + 1]
    try:
        return importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    except ImportError:
        return None


_OFFLINE_MARKS = (
    "couldn't connect to 'https://huggingface.co'", "outgoing traffic has been disabled",
)  # fmt: skip


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.when != "call" or not report.failed or call.excinfo is None:
        return
    if os.environ.get("HF_HUB_OFFLINE") != "1" or not isinstance(call.excinfo.value, OSError):
        return
    if any(m in str(call.excinfo.value) for m in _OFFLINE_MARKS):
        report.outcome = "skipped"
        reason = "Skipped: downloads from the Hugging Face Hub (HF_HUB_OFFLINE=1 here)"
        report.longrepr = (str(item.path), item.location[1] or 0, reason)


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
            reason = _tree_mismatch(item)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))
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

"""Triton <= 3.6's CPU interpreter with numpy >= 2.4: hf_flash mends the interpreter's scalar
``__index__`` (``int()`` of a one-element array, which numpy 2.4 refuses) so the kernels run; only
where the mend cannot apply is the pair refused up front, in one line that says what to install."""

import numpy
import pytest
import torch
import triton
from triton.runtime import interpreter

from hf_flash._cli import interpreter_problem
from hf_flash.kernels import configs


def test_numpy_24_with_triton_36_is_mended(monkeypatch):
    monkeypatch.setattr(numpy, "__version__", "2.4.1")
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    assert configs._interpreter_needs_mend()
    assert configs.interpreter_numpy_problem() is None  # the interpreter has what the mend wraps


def test_numpy_24_without_the_mendable_function_names_the_fix(monkeypatch):
    monkeypatch.setattr(numpy, "__version__", "2.4.1")
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    monkeypatch.delattr(interpreter, "_patch_lang_tensor")
    problem = configs.interpreter_numpy_problem()
    assert problem is not None and "numpy<2.4" in problem and "\n" not in problem
    assert not configs.mend_interpreter_index()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert interpreter_problem() == problem
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the compiled kernels do not care
    assert interpreter_problem() is None


def test_supported_pairs_pass(monkeypatch):
    for np_version, triton_version in [("2.3.5", "3.6.0"), ("2.4.1", "3.9.0"), ("1.26.4", "3.2.0")]:
        monkeypatch.setattr(numpy, "__version__", np_version)
        monkeypatch.setattr(triton, "__version__", triton_version)
        assert not configs._interpreter_needs_mend() or np_version == "2.4.1"
        assert configs.interpreter_numpy_problem() is None


@pytest.mark.skipif(not configs.interpreting(), reason="runs a kernel in Triton's CPU interpreter")
def test_mended_index_reads_the_one_element(monkeypatch):
    """The mended ``__index__`` is what a data-dependent loop bound goes through; with it the
    interpreter runs such a kernel whatever numpy is installed (numpy >= 2.4 refuses
    ``int()`` of the one-element arrays the original passes)."""
    original = interpreter._patch_lang_tensor
    original = getattr(original, "__wrapped__", original)
    monkeypatch.setattr(interpreter, "_patch_lang_tensor", original)
    assert configs.mend_interpreter_index()
    assert configs.mend_interpreter_index()  # idempotent
    from hf_flash import flash_attn_varlen_func
    from hf_flash.reference import FWD_FACTOR, assert_close_to_ref, attention_varlen_ref

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(300, 4, 64, generator=g), torch.randn(300, 2, 64, generator=g)
    cu = torch.tensor([0, 100, 300], dtype=torch.int32)  # per-sequence loops bounded by loads
    out = flash_attn_varlen_func(q, k, k, cu, cu, 200, 200, causal=True)
    ref = attention_varlen_ref(q, k, k, cu, cu, causal=True)
    ref_lp = attention_varlen_ref(q, k, k, cu, cu, causal=True, upcast=False)
    assert_close_to_ref("out", out, ref, ref_lp, FWD_FACTOR, torch.float32)

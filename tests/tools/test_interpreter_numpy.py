"""Triton <= 3.6's CPU interpreter with numpy >= 2.4 is refused up front, in one line that says
what to install (the commands print it; hf_flash.kernels raises it at import)."""

import numpy
import triton

from hf_flash._cli import interpreter_problem
from hf_flash.kernels import configs


def test_numpy_24_with_triton_36_interpreter_names_the_fix(monkeypatch):
    monkeypatch.setattr(numpy, "__version__", "2.4.1")
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    problem = configs.interpreter_numpy_problem()
    assert problem is not None and "numpy<2.4" in problem and "\n" not in problem
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert interpreter_problem() == problem
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the compiled kernels do not care
    assert interpreter_problem() is None


def test_supported_pairs_pass(monkeypatch):
    for np_version, triton_version in [("2.3.5", "3.6.0"), ("2.4.1", "3.9.0"), ("1.26.4", "3.2.0")]:
        monkeypatch.setattr(numpy, "__version__", np_version)
        monkeypatch.setattr(triton, "__version__", triton_version)
        assert configs.interpreter_numpy_problem() is None

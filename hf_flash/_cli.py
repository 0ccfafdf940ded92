"""Shared start-up checks of the console commands (hf-flash-demo, -eval, -finetune, -study)."""

from __future__ import annotations

import os
from typing import Optional


def use_cpu_interpreter() -> None:
    """Without CUDA, switch on Triton's CPU interpreter; must run before any hf_flash kernel is
    defined (they load on first use, so after ``import hf_flash`` is fine)."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def interpreter_problem() -> Optional[str]:
    """Why Triton's CPU interpreter, when it is on, cannot run here (one line), or None.

    ``hf_flash.kernels`` makes the same check when it is first imported and raises
    :class:`hf_flash.kernels.configs.InterpreterUnsupported` (a RuntimeError); a command asks
    first, so the user sees the line and no traceback."""
    try:
        from hf_flash.kernels.configs import check_interpreter

        check_interpreter()
    except RuntimeError as e:  # InterpreterUnsupported, raised by the import or the call
        return str(e)
    return None

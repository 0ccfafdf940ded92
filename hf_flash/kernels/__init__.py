"""Triton kernels and their host launchers. Imports nothing beyond torch and triton."""

from .configs import check_interpreter as _check_interpreter

# with TRITON_INTERPRET=1, fail here with what to install rather than inside the first kernel
_check_interpreter()

"""Test-only stand-in for the ``flash_attn`` package, so that flash-attn's own tests import
hf_flash's functions unchanged (see tests/upstream/README section in tests/README.md).

Never installed and never on the path of anything but ``scripts/upstream_tests.sh``: a real
``flash_attn`` must not be shadowed elsewhere.
"""

from .flash_attn_interface import (  # noqa: F401  (as flash-attn's own package does)
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

__version__ = "2.8.3+hf_flash.shim"

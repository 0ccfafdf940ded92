"""``flash_attn.flash_attn_interface`` for flash-attn's tests: the public functions, and
``_get_block_size_n``, the private helper the tests use to undo the per-block scaling of the
dropout-encoded probabilities (``return_attn_probs=True``)."""

from hf_flash import (  # noqa: F401
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

# flash-attn's S_dmask holds exp(s - m) with m the running row maximum of its CUDA kernel's
# key blocks; hf_flash returns the softmax probabilities themselves (flash-attn's docstring:
# "possibly with different scaling"). No block size makes the tests' re-normalisation of the
# former apply to the latter, so the cases that need it are skipped by the upstream plugin
# (tests/upstream/hf_flash_upstream.py) and this is never reached by a test that runs.
def _get_block_size_n(device, head_dim, is_dropout, is_causal):
    raise NotImplementedError(
        "flash-attn's kernel block size is a CUDA-kernel internal; hf_flash returns "
        "normalised probabilities with return_attn_probs=True"
    )

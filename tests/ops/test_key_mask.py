"""The padding-mask kernel (hf_flash.kernels.key_mask) against torch ops on the same masks.

The reference spells out the definitions: the bool mask padded with False to ``width``, and per
row the first valid index (``width`` if none), one past the last (at least the first) and the
count. Runs through Triton's interpreter without a GPU; the ``gpu`` variants on the device.
"""

from __future__ import annotations

import pytest
import torch

from hf_flash.integration.masks import mask_rows_torch
from hf_flash.kernels.key_mask import key_mask_rows

# None: the session's device fixture (CUDA on a GPU machine, else the CPU interpreter)
WHERE = [pytest.param(None, id="here"),
         pytest.param("cuda", id="gpu", marks=pytest.mark.gpu)]  # fmt: skip


def _reference(mask: torch.Tensor, width: int):
    out = torch.zeros(mask.shape[0], width, dtype=torch.bool)
    out[:, : mask.shape[1]] = mask.cpu() != 0
    stats = []
    for row in out:
        idx = row.nonzero().flatten().tolist()
        first = idx[0] if idx else width
        last = max(idx[-1] + 1, first) if idx else width
        stats.append((first, last, len(idx)))
    return out, torch.tensor(stats, dtype=torch.int32).T


def _masks(device):
    """Left and right padding, holes, empty and full rows; int64 (generate's), bool, float,
    and a non-contiguous slice (a cache's trailing keys)."""
    g = torch.Generator().manual_seed(3)
    m = torch.ones(5, 1500, dtype=torch.int64)
    m[0, :700] = 0  # left padding crossing a 1024 block
    m[1, 1100:] = 0  # right padding
    m[2, 10:20] = 0  # a hole
    m[3] = 0  # nothing valid
    yield m.to(device)
    yield (m != 0).to(device)
    yield m.to(device=device, dtype=torch.float32)
    yield m.to(device)[:, 300:]  # strided rows
    yield (torch.rand(3, 37, generator=g) > 0.5).to(device)
    yield torch.ones(2, 1, dtype=torch.int64, device=device)


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("extra", [0, 1, 1100])
def test_key_mask_rows_matches_reference(where, extra, device):
    for mask in _masks(where or device):
        width = mask.shape[1] + extra
        out, stats = key_mask_rows(mask, width)
        want_out, want_stats = _reference(mask, width)
        assert out.dtype == torch.bool and out.shape == (mask.shape[0], width)
        assert torch.equal(out.cpu(), want_out)
        assert stats.dtype == torch.int32 and torch.equal(stats.cpu(), want_stats), (stats, want_stats)


@pytest.mark.parametrize("extra", [0, 1, 1100])
def test_torch_version_matches_reference(extra):
    """The integration's fallback where Triton cannot run (a CPU without its interpreter)."""
    for mask in _masks("cpu"):
        width = mask.shape[1] + extra
        out, stats = mask_rows_torch(mask, width)
        want_out, want_stats = _reference(mask, width)
        assert torch.equal(out, want_out) and stats.dtype == torch.int32
        assert torch.equal(stats, want_stats), (stats, want_stats)


def test_key_mask_rows_rejects_bad_input(device):
    with pytest.raises(ValueError, match="2-D"):
        key_mask_rows(torch.ones(2, 3, 4, device=device), 4)
    with pytest.raises(ValueError, match="narrower"):
        key_mask_rows(torch.ones(2, 8, device=device), 4)
    out, stats = key_mask_rows(torch.ones(0, 8, device=device), 8)
    assert out.shape == (0, 8) and stats.shape == (3, 0)

"""The attention kernels' Hopper builds keep their occupancy (CPU: compiled for sm_90a with the
ptxas that ships with Triton; no GPU needed). See benchmarks/diagnostics/kernel_registers.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = "benchmarks/diagnostics/kernel_registers.py"  # run from REPO


def test_head_dim_64_forward_runs_two_programs_per_sm_dense_and_packed(tmp_path):
    # the packed forward once took 143 registers per thread: one 8-warp program per SM and 1.3x
    # the dense forward's time at S = 32K on an H100
    out = tmp_path / "registers.json"
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(REPO))
    subprocess.run([sys.executable, SCRIPT, "--head-dims", "64", "--json", str(out)],
                   cwd=REPO, env=env, check=True, capture_output=True, text=True, timeout=600)
    rows = {(r["kernel"], r["varlen"]): r for r in json.loads(out.read_text())}
    assert len(rows) == 6
    for varlen in (False, True):
        fwd = rows[("fwd", varlen)]
        assert fwd["programs_per_sm_by_registers"] >= 2 and fwd["spill_bytes"] == 0, fwd
        assert fwd["programs_per_sm_by_shared"] >= 2, fwd

"""No file outside docs/ cites DESIGN.md: the design lives in docs/ (architecture.md, design.md)
and code points there."""

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_nothing_outside_docs_cites_design_md():
    listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True)
    if listed.returncode:
        pytest.skip("not a git checkout (an unpacked sdist)")
    files = listed.stdout.split()
    citing = [f for f in files
              if not f.startswith("docs/") and f != Path(__file__).relative_to(REPO).as_posix()
              and (REPO / f).is_file() and "DESIGN.md" in (REPO / f).read_text(errors="ignore")]
    assert citing == [], f"cite docs/design.md or docs/architecture.md instead: {citing}"

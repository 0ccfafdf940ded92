"""benchmarks/plots.py draws every README figure from the committed results."""

from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from benchmarks import plots  # noqa: E402


def test_every_figure_is_drawn_from_committed_results(tmp_path):
    assert plots.main(["--out", str(tmp_path)]) == 0
    for name in ("attention", "e2e_train", "decode", "generate"):
        png = tmp_path / f"{name}.png"
        assert png.is_file(), f"{name}.png not drawn (its results file is missing or unreadable)"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert png.stat().st_size > 10_000


def test_readme_shows_the_figures():
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    for name in ("attention", "e2e_train", "decode", "generate"):
        assert f"docs/img/{name}.png" in readme
        assert (Path(__file__).parents[2] / "docs" / "img" / f"{name}.png").is_file()

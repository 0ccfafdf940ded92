"""tests/upstream/layout.py's stand-in packages: every name raises when used, and the real
package, where one is installed further along sys.path, is loaded in the stand-in's place."""

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "upstream"))
import layout  # noqa: E402


def _run(site: Path, code: str, extra_path: Path = None) -> subprocess.CompletedProcess:
    path = [str(site)] + ([str(extra_path)] if extra_path else [])
    return subprocess.run([sys.executable, "-c", f"import sys; sys.path[:0] = {path!r}\n{code}"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def test_stand_in_names_raise_when_used(tmp_path):
    layout.write_stand_in(tmp_path, "hf_flash_absent_pkg", "a test")
    proc = _run(tmp_path, "from hf_flash_absent_pkg import Audio, load_dataset\n"
                          "print(Audio.__name__, load_dataset.__name__)\n"
                          "load_dataset('x')")  # fmt: skip
    assert proc.stdout.split() == ["Audio", "load_dataset"]
    assert "ModuleNotFoundError" in proc.stderr and "not installed here" in proc.stderr


def test_real_package_further_along_the_path_wins(tmp_path):
    name = "hf_flash_real_pkg"
    site, real = tmp_path / "site", tmp_path / "real"
    layout.write_stand_in(site, name, "a test")
    (real / name).mkdir(parents=True)
    (real / name / "__init__.py").write_text("REAL = True\n")
    proc = _run(site, f"import {name}; print({name}.REAL, {name}.__file__)", extra_path=real)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[0] == "True" and str(real) in proc.stdout

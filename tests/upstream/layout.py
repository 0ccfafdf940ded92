"""Lay out upstream test sources (flash-attn's and transformers') in an ignored folder.

Nothing here is committed upstream code: this reads a flash-attn git mirror, a transformers git
mirror and transformers' release sdists (PyPI) and writes the files the upstream runs need under
``.upstream/`` (git-ignored), with one rewrite in transformers' files: the quoted attention name
``"flash_attention_2"`` becomes ``"hf_flash"`` (test names and assertions are untouched).
``scripts/upstream_tests.sh layout ...`` calls it; tests/README.md ("Upstream tests") says how.

transformers' files come from two places, best first: the release sdist (its top-level
``tests/test_*.py``, the exact release's ``test_modeling_common.py`` with the FlashAttention
tests) and a git tree at ``--transformers-ref`` (everything else the import closure of the
chosen model test files needs). A module of the closure found in neither is written as a stub
(listed in PROVENANCE.json): its ``...Mixin`` names empty classes, any other name a function that
raises when called. Modules under ``tests/pipelines/`` (pipeline tests, which need ``datasets``) are
always written that way.
"""

from __future__ import annotations

import argparse
import ast
import json
import posixpath
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Dict, Iterable, List, Optional

FLASH_ATTN_FILES = ("tests/test_flash_attn.py",)
FA2_NAME = re.compile(r"""(["'])flash_attention_2\1""")
DEFAULT_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "phi3")


def git_show(git_dir: Path, ref: str, path: str) -> Optional[bytes]:
    proc = subprocess.run(["git", "--git-dir", str(git_dir), "show", f"{ref}:{path}"],
                          capture_output=True)  # fmt: skip
    return proc.stdout if proc.returncode == 0 else None


def git_ls(git_dir: Path, ref: str, prefix: str) -> List[str]:
    proc = subprocess.run(["git", "--git-dir", str(git_dir), "ls-tree", "-r", "--name-only", ref,
                           prefix], capture_output=True, text=True, check=True)  # fmt: skip
    return proc.stdout.split()


def git_commit(git_dir: Path, ref: str) -> str:
    return subprocess.run(["git", "--git-dir", str(git_dir), "rev-parse", f"{ref}^{{commit}}"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip


def layout_flash_attn(git_dir: Path, ref: str, out: Path) -> dict:
    dest = out / "flash-attn"
    for path in FLASH_ATTN_FILES:
        data = git_show(git_dir, ref, path)
        if data is None:
            raise SystemExit(f"{path} not found at {ref} in {git_dir}")
        (dest / path).parent.mkdir(parents=True, exist_ok=True)
        (dest / path).write_bytes(data)
    info = {"source": "Dao-AILab/flash-attention", "ref": ref, "commit": git_commit(git_dir, ref),
            "files": list(FLASH_ATTN_FILES), "modified": []}  # fmt: skip
    (dest / "PROVENANCE.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


class TransformersTree:
    """Reads ``tests/...`` files: the sdist's first, then the git tree's."""

    def __init__(self, sdist: Path, git_dir: Optional[Path], ref: Optional[str]):
        self.sdist: Dict[str, bytes] = {}
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                parts = member.name.split("/", 1)
                if member.isfile() and len(parts) == 2 and parts[1].startswith("tests/"):
                    self.sdist[parts[1]] = tar.extractfile(member).read()
        match = re.search(r"transformers-(\d[^/]*?)\.tar\.gz$", sdist.name)
        if not match:
            raise SystemExit(f"cannot read a version from {sdist.name}")
        self.version = match.group(1)
        self.git_dir, self.ref = git_dir, ref
        self.origin: Dict[str, str] = {}

    def read(self, path: str) -> Optional[bytes]:
        if path in self.sdist:
            self.origin[path] = "sdist"
            return self.sdist[path]
        if self.git_dir is not None:
            data = git_show(self.git_dir, self.ref, path)
            if data is not None:
                self.origin[path] = "git"
                return data
        return None


def _relative_imports(source: bytes, path: str) -> Iterable[tuple]:
    """(module path without .py, imported names) for every relative import in ``source``."""
    package = posixpath.dirname(path)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            base = package
            for _ in range(node.level - 1):
                base = posixpath.dirname(base)
            mod = posixpath.join(base, *node.module.split(".")) if node.module else base
            yield mod, [alias.name for alias in node.names]


def _stub(path: str, names: List[str]) -> bytes:
    """A module missing from the sources: its mixins empty (they add no FlashAttention test),
    anything else raising when called, so a selected test that needs it fails, never passes."""
    body = []
    for name in sorted(set(names)):
        if name.endswith(("Mixin", "Tests")):
            body.append(f"\n\nclass {name}:\n    pass\n")
        else:
            body.append(f"\n\ndef {name}(*args, **kwargs):\n    raise NotImplementedError("
                        f"\"{path} is missing from the upstream sources laid out\")\n")
    return ("# Written by hf_flash's tests/upstream/layout.py: this module is missing from the\n"
            "# transformers sources given (see PROVENANCE.json).\n" + "".join(body)).encode()


def layout_transformers(tree: TransformersTree, families: List[str], out: Path) -> dict:
    dest = out / f"transformers-{tree.version}"
    # utils/test_module: tests/utils/test_configuration_utils.py puts utils/ on sys.path for it;
    # utils/fetch_hub_objects_for_ci.py: tests/test_processing_common.py does the same (gemma4)
    # tests/utils/tiny_model_summary.json: read by test_pipeline_mixin.py at import
    wanted: List[str] = ["tests/__init__.py", "tests/models/__init__.py",
                         "tests/utils/tiny_model_summary.json",
                         "utils/fetch_hub_objects_for_ci.py"] + [
        p for p in git_ls(tree.git_dir, tree.ref, "utils/test_module/") if p.endswith(".py")]
    missing_families = []
    for fam in families:
        files = [p for p in git_ls(tree.git_dir, tree.ref, f"tests/models/{fam}/")
                 if re.fullmatch(rf"tests/models/{fam}/(__init__|test_modeling_(?!tf_|flax_)\w+)\.py", p)]  # fmt: skip
        if not any("test_modeling_" in p for p in files):
            missing_families.append(fam)
            continue
        wanted += files
    files: Dict[str, bytes] = {}
    stubs: Dict[str, List[str]] = {}
    queue = list(wanted)
    needed_names: Dict[str, List[str]] = {}
    while queue:
        path = queue.pop()
        if path in files or path in stubs:
            continue
        # pipeline tests only feed PipelineTesterMixin's own tests (never selected) and import
        # `datasets`, which the GPU image lacks: stubbed like a missing module
        data = None if path.startswith("tests/pipelines/") else tree.read(path)
        if data is None:
            names = needed_names.get(path, [])
            stubs[path] = names
            continue
        files[path] = data
        if not path.endswith(".py"):
            continue
        for mod, names in _relative_imports(data, path):
            candidates = [mod + ".py", mod + "/__init__.py"]
            target = next((c for c in candidates if tree.read(c) is not None), candidates[0])
            needed_names.setdefault(target, []).extend(names)
            queue.append(target)
            pkg = posixpath.dirname(target)
            while pkg.startswith("tests/"):
                queue.append(pkg + "/__init__.py")
                pkg = posixpath.dirname(pkg)
    rewrites = {}
    for path, data in files.items():
        text, n = FA2_NAME.subn(r'\1hf_flash\1', data.decode())
        if n:
            rewrites[path] = n
        (dest / path).parent.mkdir(parents=True, exist_ok=True)
        (dest / path).write_text(text)
    for path, names in stubs.items():
        (dest / path).parent.mkdir(parents=True, exist_ok=True)
        (dest / path).write_bytes(_stub(path, names))
    info = {
        "version": tree.version,
        "git_ref": tree.ref,
        "git_commit": git_commit(tree.git_dir, tree.ref) if tree.git_dir else None,
        "families": [f for f in families if f not in missing_families],
        "families_without_tests": missing_families,
        "files": {p: tree.origin.get(p) for p in sorted(files)},
        "stubs": {p: sorted(set(n)) for p, n in stubs.items()},
        "rewrites": rewrites,
    }
    (dest / "PROVENANCE.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


STAND_IN = '''"""Stand-in for `{name}`, written by tests/upstream/layout.py: the upstream test modules import
it at the top ({why}) and the FlashAttention tests never use it. Every name is a class whose use
raises, so a test that does need it fails loudly instead of passing. Where the real package is
installed further along sys.path, it is loaded in this module's place."""

import importlib.machinery
import importlib.util
import os
import sys

_site = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.machinery.PathFinder.find_spec(
    __name__, [p for p in sys.path if os.path.abspath(p or ".") != _site])
if _spec is not None:
    _real = importlib.util.module_from_spec(_spec)
    sys.modules[__name__] = _real
    _spec.loader.exec_module(_real)


def __getattr__(attr):
    if attr.startswith("__"):
        raise AttributeError(attr)

    class Missing:
        def __init__(self, *args, **kwargs):
            raise ModuleNotFoundError(f"{name}.{{attr}}: {name} is not installed here (upstream layout stand-in)")

        def __class_getitem__(cls, item):
            return cls

    Missing.__name__ = Missing.__qualname__ = attr
    return Missing
'''


def write_stand_in(site: Path, name: str, why: str) -> None:
    """``site/NAME/__init__.py``: a module whose every attribute raises when used (for a
    top-of-file import of a package the GPU image lacks that the selected tests never call)."""
    (site / name).mkdir(parents=True, exist_ok=True)
    (site / name / "__init__.py").write_text(STAND_IN.format(name=name, why=why))


def matrix_families(results: Path) -> List[str]:
    """Test folder names of the model types a model-matrix result lists as working."""
    rows = json.loads(results.read_text())["rows"]
    folders = []
    for row in rows:
        if row.get("result") == "works":
            name = row["model_type"].replace("-", "_")
            name = re.sub(r"_text$", "", name)
            if name not in folders:
                folders.append(name)
    return folders


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(".upstream"))
    parser.add_argument("--flash-attn-git", type=Path, help="flash-attention git dir (a mirror)")
    parser.add_argument("--flash-attn-ref", default="v2.8.3")
    parser.add_argument("--transformers-git", type=Path, help="transformers git dir (a mirror)")
    parser.add_argument("--transformers-ref", default="HEAD")
    parser.add_argument("--transformers-sdist", type=Path, nargs="*", default=[],
                        help="transformers-X.Y.Z.tar.gz, one tree laid out per release")
    parser.add_argument("--families", default=",".join(DEFAULT_FAMILIES),
                        help="comma-separated tests/models folders, or a model_matrix-*.json "
                        "result (its working model types)")  # fmt: skip
    parser.add_argument("--wheel", type=Path, nargs="*", default=[],
                        help="pure-Python wheels the tests import (parameterized), unpacked "
                        "into OUT/site for a machine without a package registry")  # fmt: skip
    parser.add_argument("--stand-in", nargs="*", default=[], metavar="NAME=WHY",
                        help="packages imported at the top of test modules but unused by the "
                        "FlashAttention tests, written as modules whose every name raises when "
                        "used (e.g. datasets='moshi: an integration test')")  # fmt: skip
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {}
    for spec in args.stand_in:
        name, _, why = spec.partition("=")
        write_stand_in(args.out / "site", name, why or "unused by the selected tests")
        summary.setdefault("stand_ins", []).append(name)
    for wheel in args.wheel:
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(args.out / "site")
        summary.setdefault("site", []).append(wheel.name)
    if args.flash_attn_git:
        summary["flash-attn"] = layout_flash_attn(args.flash_attn_git, args.flash_attn_ref, args.out)
    if args.transformers_sdist:
        if args.transformers_git is None:
            raise SystemExit("--transformers-sdist needs --transformers-git (the sdist has no tests/models)")
        fams = (matrix_families(Path(args.families)) if args.families.endswith(".json")
                else [f for f in args.families.split(",") if f])  # fmt: skip
        for sdist in args.transformers_sdist:
            tree = TransformersTree(sdist, args.transformers_git, args.transformers_ref)
            info = layout_transformers(tree, fams, args.out)
            summary[f"transformers-{tree.version}"] = {
                "files": len(info["files"]), "families": len(info["families"]),
                "families_without_tests": info["families_without_tests"],
                "stubs": list(info["stubs"]), "rewrites": sum(info["rewrites"].values())}
    json.dump(summary, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()

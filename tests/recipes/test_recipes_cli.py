"""The hf-flash-finetune command line: --help documents every option, the embedded default, and
bad inputs stopped with one line (exit status 2) before any work: unknown options, malformed
JSONL, a seq_len beyond what RoPE scaling allows, warmup longer than training, a missing
[recipes] extra; Ctrl-C leaves no partial output and prints how to resume."""

import dataclasses
import json
from pathlib import Path

import pytest

from hf_flash.recipes import lora_long_context as recipe
from hf_flash.recipes.config import (
    EMBEDDED_DEFAULT, ConfigError, RecipeConfig, build_parser, configs_dir, field_docs, load_config,
    resolve_config_path, uses_embedded_default,
)

REPO = Path(__file__).resolve().parents[2]


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def test_help_documents_every_option_with_its_default():
    text = " ".join(build_parser().format_help().split())
    docs = field_docs()
    defaults = RecipeConfig().to_dict()
    for f in dataclasses.fields(RecipeConfig):
        assert docs[f.name], f"option {f.name} has no docstring in RecipeConfig"
        assert f"--{f.name}" in text
        assert f"default {defaults[f.name]!r}" in text
        assert " ".join(docs[f.name].split())[:40] in text


def test_embedded_default_applies_without_config_or_model():
    assert uses_embedded_default([]) and uses_embedded_default(["--max_steps", "2"])
    assert not uses_embedded_default(["--config", "tiny"]) and not uses_embedded_default(["--model=/m"])
    cfg = load_config(["--max_steps", "2"], base=EMBEDDED_DEFAULT)
    assert cfg.max_steps == 2 and cfg.seq_len == EMBEDDED_DEFAULT["seq_len"] and cfg.dtype == "float32"


def test_shipped_configs_by_name():
    assert configs_dir() == REPO / "recipes" / "configs"  # a checkout (the wheel: package data)
    assert resolve_config_path(Path("tiny")) == configs_dir() / "tiny.yaml"
    assert resolve_config_path(Path("llama-32k.yaml")) == configs_dir() / "llama-32k.yaml"
    with pytest.raises(ConfigError, match="shipped configs"):
        resolve_config_path(Path("no-such-config"))


def test_unknown_option_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        recipe.main(["--config", "tiny", "--max_stepz", "3"])
    assert e.value.code == 2
    assert "unrecognized arguments: --max_stepz" in _one_line_error(capsys)


def test_warmup_longer_than_training_is_one_line(capsys, tmp_path):
    assert recipe.main(["--warmup_steps", "10", "--max_steps", "4", "--output_dir", str(tmp_path)]) == 2
    assert "warmup_steps=10 is longer than the whole run" in capsys.readouterr().err


def test_huge_seq_len_fails_before_the_data_is_built(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(recipe, "build_rows", lambda *a, **k: pytest.fail("data built"))
    assert recipe.main(["--seq_len", "10000000", "--output_dir", str(tmp_path), "--progress", "false"]) == 2
    err = capsys.readouterr().err
    assert "beyond the 64x the recipe's RoPE scaling accepts; use seq_len <= 2048" in err, err


def test_malformed_jsonl_names_file_and_line(capsys, tmp_path):
    data = tmp_path / "docs.jsonl"
    data.write_text(json.dumps({"text": "fine"}) + "\n" + '{"text": "broken\n')
    assert recipe.main(["--data", str(data), "--output_dir", str(tmp_path / "run"), "--progress", "false"]) == 2
    err = capsys.readouterr().err
    assert f"{data}:2: not valid JSON" in err, err


def test_missing_recipes_extra_is_one_line(capsys, monkeypatch):
    monkeypatch.setattr(recipe, "missing_recipe_packages", lambda: ["accelerate", "peft"])
    assert recipe.main([]) == 2
    err = _one_line_error(capsys)
    assert "missing: accelerate, peft" in err and "pip install 'hf-flash[recipes]'" in err


def test_ctrl_c_cleans_partial_output_and_prints_resume(capsys, tmp_path, monkeypatch):
    out = tmp_path / "run"
    ckpts = out / "checkpoints"
    (ckpts / "step-000002").mkdir(parents=True)
    (ckpts / "step-000002" / "trainer_state.json").write_text("{}")
    (ckpts / "latest").write_text("step-000002")
    (ckpts / ".tmp-step-000004").mkdir()
    (out / ".tmp-adapter").mkdir()

    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(recipe, "train", interrupted)
    argv = ["--output_dir", str(out), "--max_steps", "6"]
    assert recipe.main(argv) == 130
    err = capsys.readouterr().err
    assert "nothing half-written" in err and str(ckpts / "step-000002") in err
    assert f"--output_dir {out} --max_steps 6 --resume" in err
    assert not (ckpts / ".tmp-step-000004").exists() and not (out / ".tmp-adapter").exists()

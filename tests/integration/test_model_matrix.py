"""The model matrix's machinery (benchmarks/model_matrix.py) on a few representative model types.

The whole matrix is run by the script, not here: these tests check that the selection rule,
the tiny configs, the checks and the report give real outcomes (a model that works, one refused
at load, a wrong output caught) in well under a minute on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks import model_matrix as mm

DTYPE = torch.float32


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return tmp_path_factory.mktemp("model_matrix")


def test_selection_rule():
    """Decoder-only causal LMs on the attention interface run; the others are listed with why."""
    by_type = {c.model_type: c for c in mm.candidates()}
    for name in ("llama", "mistral", "gpt2", "qwen3", "gemma2", "gpt_oss", "deepseek_v3"):
        assert by_type[name].included, by_type[name]
    reasons = {  # one of each exclusion
        "bloom": "attention not on the interface",
        "bart": "decoder half of an encoder-decoder",
        "bert": "masked-LM encoder",
        "gemma3": "multimodal wrapper of `gemma3_text`",
    }
    for name, reason in reasons.items():
        assert not by_type[name].included and by_type[name].reason.startswith(reason), by_type[name]


def test_tiny_config_keeps_one_layer_of_each_type():
    config = mm.tiny_config("gemma2")
    assert config.hidden_size == 64 and config.vocab_size == mm.VOCAB
    assert sorted(config.layer_types) == ["full_attention", "sliding_attention"]
    assert config.sliding_window == mm.WINDOW
    hybrid = mm.tiny_config("qwen3_next")  # linear-attention layers first in its default
    assert "full_attention" in hybrid.layer_types
    assert hybrid.num_hidden_layers == len(hybrid.layer_types)


def test_llama_works_on_every_check(tmp_root, device):
    row = mm.run_model("llama", tmp_root, DTYPE, device)
    assert row["result"] == "works", row
    assert {n: c["status"] for n, c in row["cells"].items()} == dict.fromkeys(mm.CHECKS, "pass")


def test_packing_without_position_ids_in_the_layers(tmp_root, device):
    """CTRL builds its mask from position_ids but does not pass them to its attention layers:
    its packed rows keep their sequences apart on "hf_flash" too (the mask carries them)."""
    row = mm.run_model("ctrl", tmp_root, DTYPE, device, checks=("packed",))
    assert row["cells"]["packed"]["status"] == "pass", row


def test_model_without_flash_support_is_refused_at_load(tmp_root, device):
    """AXK2 declares no FlashAttention support: the load raises hf_flash's error and no check
    runs (the row says why)."""
    row = mm.run_model("axk2", tmp_root, DTYPE, device)
    assert row["result"] == "refused" and not row["cells"], row
    assert "_supports_flash_attn is False" in row["reason"] and "eager" in row["reason"]


def test_wrong_output_is_caught(tmp_root, device, monkeypatch):
    """A mask function that drops the padding (every key valid) fails the padded check and the
    training step, while the checks without padding still pass."""
    from transformers.masking_utils import AttentionMaskInterface

    monkeypatch.setitem(AttentionMaskInterface._global_mapping, "hf_flash", lambda *a, **k: None)
    row = mm.run_model("gpt2", tmp_root, DTYPE, device, checks=("forward", "padded", "train"))
    cells = {n: c["status"] for n, c in row["cells"].items()}
    assert cells == {"forward": "pass", "padded": "fail", "train": "fail"}, row
    assert row["result"] == "fail" and "padded logits: max err" in row["cells"]["padded"]["detail"]


def test_markdown_and_readme_section(tmp_path):
    rows = [
        {"model_type": "a", "result": "works", "reason": "",
         "cells": {n: {"status": "pass", "detail": ""} for n in mm.CHECKS}},
        {"model_type": "b", "result": "refused", "reason": "ValueError: no flash", "cells": {}},
    ]  # fmt: skip
    excluded = [{"model_type": "c", "class": "C", "reason": "attention not on the interface"}]
    payload = {"env": {"gpu": None, "transformers": "5.x"}, "meta": {"dtype": "float32"},
               "rows": rows, "excluded": excluded}  # fmt: skip
    text = mm.markdown([payload])
    assert "1 work, 1 refused at load, 0 fail" in text
    assert "| `b` | refused | ValueError: no flash |" in text
    assert "attention not on the interface: `c`" in text
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{mm.MARK_START}\nold\n{mm.MARK_END}\nafter\n")
    mm.write_readme([payload], readme)
    new = readme.read_text()
    assert new.startswith("intro\n") and new.endswith(f"{mm.MARK_END}\nafter\n") and "old" not in new
    assert "| `a` | works ✓✓✓✓✓✓✓ |" in new

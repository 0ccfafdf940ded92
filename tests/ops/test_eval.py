"""Evaluation tools: the passkey grid and perplexity vs length, checked with models whose answers
are known exactly (a perfect copier, a copier that only sees a recent window, a uniform model),
then with a real tiny Llama and the command line."""

import json
import math
import string

import pytest
import torch
import torch.nn as nn

from hf_flash.eval import (
    build_passkey_prompt,
    format_grid,
    passkey_drill,
    passkey_grid,
    perplexity_of_tokens,
    perplexity_vs_length,
    save_heatmap,
)

CHARS = string.printable


class CharTokenizer:
    """One token per character; BOS is id len(CHARS)."""

    bos_token_id = len(CHARS)
    vocab_size = len(CHARS) + 1

    def encode(self, text, add_special_tokens=False):
        return [CHARS.index(c) for c in text]

    def decode(self, ids):
        return "".join(CHARS[i] for i in ids if i < len(CHARS))


class _Out:
    def __init__(self, logits):
        self.logits = logits


class CopyModel(nn.Module):
    """Ideal induction head: predicts the token that followed the longest earlier match of the
    current suffix, looking back at most ``window`` tokens (None = everything)."""

    def __init__(self, vocab, window=None):
        super().__init__()
        self.vocab, self.window = vocab, window
        self.dummy = nn.Parameter(torch.zeros(()))

    def forward(self, input_ids):
        seq = input_ids[0].tolist()
        logits = torch.zeros(1, len(seq), self.vocab)
        for t in range(len(seq)):
            lo = 0 if self.window is None else max(0, t - self.window)
            best, nxt = 0, None
            for j in range(t - 1, lo - 1, -1):  # candidate: seq[j] matches seq[t], predict seq[j+1]
                k = 0
                while k <= j - lo and seq[j - k] == seq[t - k] and k < 24:
                    k += 1
                if k > best:
                    best, nxt = k, seq[j + 1]
            if nxt is not None:
                logits[0, t, nxt] = 10.0
        return _Out(logits)


class UniformModel(nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.vocab = vocab
        self.dummy = nn.Parameter(torch.zeros(()))

    def forward(self, input_ids):
        return _Out(torch.zeros(*input_ids.shape, self.vocab))


def test_prompt_is_exact_length_and_holds_the_key():
    tok = CharTokenizer()
    for depth in (0.0, 0.3, 1.0):
        prompt, answer = build_passkey_prompt(tok, 400, depth, "51234")
        assert len(prompt) == 400 and prompt[0] == tok.bos_token_id
        text = tok.decode(prompt)
        assert "The pass key is 51234." in text and text.endswith("The pass key is")
        assert tok.decode(answer) == " 51234"
    shallow = tok.decode(build_passkey_prompt(tok, 400, 0.0, "51234")[0]).index("51234")
    deep = tok.decode(build_passkey_prompt(tok, 400, 1.0, "51234")[0]).index("51234")
    assert shallow < 100 < 250 < deep
    with pytest.raises(ValueError, match="fixed parts"):
        build_passkey_prompt(tok, 50, 0.5, "51234")
    with pytest.raises(ValueError, match="depth"):
        build_passkey_prompt(tok, 400, 1.5, "51234")


def test_drill_is_the_prompt_without_filler():
    tok = CharTokenizer()
    one = passkey_drill(tok, ["51234"])
    fixed = next(n for n in range(1, 400) if len(one) - 6 == n)  # prompt = drill minus " 51234"
    for depth in (0.0, 1.0):
        prompt, answer = build_passkey_prompt(tok, fixed, depth, "51234")
        assert one == prompt + answer
    with pytest.raises(ValueError, match="fixed parts"):
        build_passkey_prompt(tok, fixed - 1, 0.5, "51234")
    three = tok.decode(passkey_drill(tok, ["11111", "22222", "33333"]))
    assert three.count("What is the pass key?") == 3 and three.endswith("The pass key is 33333")
    # every question is answered with the key stated just before it
    parts = three.split("What is the pass key? The pass key is ")[1:]
    assert [p[:6] for p in parts] == ["11111 ", "22222 ", "33333"]


def test_grid_separates_models_that_can_and_cannot_see_the_key(tmp_path):
    tok = CharTokenizer()
    lengths, depths = [200, 400], [0.0, 0.5, 1.0]
    perfect = passkey_grid(CopyModel(tok.vocab_size), tok, lengths, depths, trials=2)
    assert perfect.accuracy == [[1.0] * 3, [1.0] * 3]
    blind = passkey_grid(UniformModel(tok.vocab_size), tok, lengths, depths, trials=2)
    assert blind.accuracy == [[0.0] * 3, [0.0] * 3]
    # A 150-token window: at length 200 every key is in view; at length 800 only a key at
    # depth 1 (about 80 tokens before the end) is, those at depth 0 (token ~80) and 0.5
    # (token ~480) are not.
    near = passkey_grid(CopyModel(tok.vocab_size, window=150), tok, [200, 800], depths, trials=1)
    assert near.accuracy == [[1.0, 1.0, 1.0], [0.0, 0.0, 1.0]]
    text = format_grid(near)
    assert text.splitlines()[2].split()[0] == "800" and "100%" in text
    png = save_heatmap(near, tmp_path / "grid.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(near.details) == 6 and {d["retrieved"] for d in near.details} == {True, False}


def test_perplexity_known_values(tmp_path):
    tok = CharTokenizer()
    path = tmp_path / "text.txt"
    path.write_text("abcdefghij" * 60)
    res = perplexity_vs_length(UniformModel(tok.vocab_size), tok, path, [32, 128], max_windows=3)
    assert res.perplexity == pytest.approx([tok.vocab_size] * 2, rel=1e-6)
    assert res.windows == [3, 3] and res.tokens_scored == [3 * 31, 3 * 127]
    # the copier knows the period-10 text after one period: with score_last it is ~certain
    res = perplexity_vs_length(CopyModel(tok.vocab_size), tok, path, [64], max_windows=2, score_last=20)
    p_right = math.exp(10) / (math.exp(10) + tok.vocab_size - 1)
    assert res.perplexity[0] == pytest.approx(1 / p_right, rel=1e-5)
    with pytest.raises(ValueError, match="fewer than one window"):
        perplexity_vs_length(UniformModel(tok.vocab_size), tok, path, [10_000])


def test_perplexity_of_a_real_model_matches_its_loss():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, vocab_size=101,
                                   max_position_embeddings=128)  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg)
    tokens = torch.randint(0, 101, (300,))
    res = perplexity_of_tokens(model, tokens, [50, 100], max_windows=2)
    with torch.no_grad():
        for n, ppl in zip([50, 100], res.perplexity):
            windows = tokens[: 2 * n].view(2, n)
            loss = model(windows, labels=windows).loss  # mean over 2 * (n - 1) predictions
            assert ppl == pytest.approx(math.exp(loss.item()), rel=1e-5)
    assert model.training  # mode restored


def test_command_line(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    from hf_flash.eval.__main__ import main

    vocab = {c: i for i, c in enumerate(CHARS)}
    vocab["<s>"] = len(vocab)
    vocab["<unk>"] = len(vocab)
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Split("", behavior="isolated")
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", unk_token="<unk>")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, vocab_size=len(vocab),
                                   max_position_embeddings=128)  # fmt: skip
    model_dir = tmp_path / "model"
    transformers.LlamaForCausalLM(cfg).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    text = tmp_path / "t.txt"
    text.write_text("hello world, " * 40)
    common = ["--model", str(model_dir), "--attn", "eager", "--dtype", "float32", "--device", "cpu"]
    assert main(["ppl", *common, "--lengths", "64,128", "--text", str(text), "--out", str(tmp_path / "o")]) == 0
    data = json.loads((tmp_path / "o" / "perplexity.json").read_text())
    assert data["lengths"] == [64, 128] and all(p > 1 for p in data["perplexity"])
    assert main(["passkey", *common, "--lengths", "200", "--depths", "0,1", "--trials", "1",
                 "--extend", "256", "--out", str(tmp_path / "o")]) == 0  # fmt: skip
    grid = json.loads((tmp_path / "o" / "passkey.json").read_text())
    assert grid["lengths"] == [200] and len(grid["accuracy"][0]) == 2
    assert (tmp_path / "o" / "passkey.png").exists()
    assert "length" in capsys.readouterr().out


def test_command_line_on_the_recipe_tiny_model(tmp_path, capsys):
    """The recipe's tiny model (byte tokenizer) on the CPU with hf_flash attention: device and
    dtype chosen by themselves, the packaged corpus by name; a missing model is one line."""
    pytest.importorskip("transformers")
    from hf_flash.eval.__main__ import main
    from hf_flash.recipes.data import ByteTokenizer
    from hf_flash.recipes.model import build_tiny_model

    if torch.cuda.is_available():
        pytest.skip("checks the CPU defaults")
    model_dir = build_tiny_model(tmp_path / "tiny", "llama", ByteTokenizer.vocab_size, seed=0)
    out = tmp_path / "o"
    assert main(["ppl", "--model", str(model_dir), "--lengths", "32", "--max-windows", "1",
                 "--text", "persuasion", "--out", str(out)]) == 0  # fmt: skip
    assert json.loads((out / "perplexity.json").read_text())["lengths"] == [32]
    capsys.readouterr()
    assert main(["ppl", "--model", str(tmp_path / "nope"), "--lengths", "32"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "does not exist" in err

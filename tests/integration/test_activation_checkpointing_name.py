"""hf_flash.enable_activation_checkpointing calls transformers' current name
(activation_checkpointing_enable, 5.23+) and falls back to gradient_checkpointing_enable (5.17),
without the deprecation warning on either."""

import warnings

import pytest

transformers = pytest.importorskip("transformers")


def test_enable_activation_checkpointing_without_deprecation_warning():
    import hf_flash

    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=64)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        hf_flash.enable_activation_checkpointing(model, {"use_reentrant": False})
    assert model.model.gradient_checkpointing

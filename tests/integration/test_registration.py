"""Registration of "hf_flash" with transformers: import hook, idempotence, version gate, the flash
loader patch, load-time rejections and the model-family patch hook point.

Import-order behaviour runs in fresh interpreters (subprocesses), since this test process has
long imported both packages.
"""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import hf_flash
from hf_flash.integration import registration

REPO = Path(__file__).resolve().parents[2]

hf_flash.register()


def _run(code: str) -> dict:
    """Run ``code`` in a fresh interpreter (repo on the path); it prints one JSON line last.
    The child inherits this process's environment: conftest turns Triton's interpreter on only
    where there is no GPU (a GPU machine's numpy may be too new for the interpreter)."""
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


_STATE = """
import json, sys
def state():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers import modeling_flash_attention_utils as fa
    return {
        "attn": "hf_flash" in ALL_ATTENTION_FUNCTIONS.valid_keys(),
        "mask": "hf_flash" in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping,
        "loader": hasattr(fa._lazy_imports, "__hf_flash_original__"),
    }
"""

_REGISTERED = {"attn": True, "mask": True, "loader": True}


def test_hook_waits_for_transformers_then_registers():
    """hf_flash alone never imports transformers; the hook registers once transformers loads."""
    got = _run(
        _STATE + "import hf_flash, hf_flash.integration as integ\n"
        "integ.install_transformers_hook()\n"
        "early = 'transformers' in sys.modules\n"
        "import transformers\n"
        "hooks = [f for f in sys.meta_path if type(f).__name__ == '_AfterTransformersImport']\n"
        "print(json.dumps({**state(), 'early': early, 'hook_left': len(hooks)}))"
    )
    assert got == {**_REGISTERED, "early": False, "hook_left": 0}


def test_hook_survives_a_find_spec_probe():
    """Libraries probe with importlib.util.find_spec("transformers") before importing it (TRL
    does on import); the probe must not use the hook up."""
    got = _run(
        _STATE + "import importlib.util, hf_flash\n"
        "assert importlib.util.find_spec('transformers') is not None\n"
        "early = 'transformers' in sys.modules\n"
        "import transformers\n"
        "hooks = [f for f in sys.meta_path if type(f).__name__ == '_AfterTransformersImport']\n"
        "print(json.dumps({**state(), 'early': early, 'hook_left': len(hooks)}))"
    )
    assert got == {**_REGISTERED, "early": False, "hook_left": 0}


def test_hook_registers_at_once_when_transformers_came_first():
    got = _run(
        _STATE + "import transformers\nimport hf_flash.integration as integ\n"
        "integ.install_transformers_hook()\nprint(json.dumps(state()))"
    )
    assert got == _REGISTERED


def test_import_hf_flash_registers():
    """``import hf_flash`` itself installs the hook (hf_flash/__init__.py)."""
    got = _run(_STATE + "import hf_flash\nimport transformers\nprint(json.dumps(state()))")
    assert got == _REGISTERED


def test_kernels_package_probe_unchanged():
    """hf_flash must not shadow or hide Hugging Face's own ``kernels`` package."""
    code = (
        "import json, importlib.util\n"
        "from transformers.utils import is_kernels_available\n"
        "before = [importlib.util.find_spec('kernels') is not None, is_kernels_available()]\n"
        "import hf_flash\nhf_flash.register()\n"
        "after = [importlib.util.find_spec('kernels') is not None, is_kernels_available()]\n"
        "print(json.dumps({'before': before, 'after': after}))"
    )
    got = _run(code)
    assert got["before"] == got["after"]


def test_register_is_idempotent():
    from transformers import modeling_flash_attention_utils as fa
    from transformers.modeling_utils import PreTrainedModel

    loader, post_init = fa._lazy_imports, PreTrainedModel.post_init
    hf_flash.register()
    hf_flash.register()
    assert fa._lazy_imports is loader and PreTrainedModel.post_init is post_init
    assert not hasattr(loader.__hf_flash_original__, "__hf_flash_original__")


def test_flash_loader_resolves_only_hf_flash():
    from transformers import modeling_flash_attention_utils as fa

    fns = fa._lazy_imports("hf_flash")
    assert fns[0] is hf_flash.flash_attn_func and fns[1] is hf_flash.flash_attn_varlen_func
    (fn, varlen, *_), _ = fa.lazy_import_flash_attention("hf_flash")
    assert fn is hf_flash.flash_attn_func and varlen is hf_flash.flash_attn_varlen_func
    # every other name still reaches transformers' own loader (and its own error here)
    with pytest.raises(Exception) as info:
        fa._lazy_imports("kernels-community/not-a-real-kernel")
    assert "hf_flash" not in str(info.value)
    # continuous batching in transformers 5.17 - 5.19 loads the name with its "paged|" prefix
    assert fa._lazy_imports("paged|hf_flash") == fns


@pytest.mark.parametrize("version", ["5.16.0", "6.0.0", "4.57.1"])
def test_version_gate(monkeypatch, version):
    import transformers

    monkeypatch.setattr(transformers, "__version__", version)
    with pytest.raises(ImportError, match=r"pip install 'transformers>=5.17,<6'"):
        registration.check_transformers_version()


def test_loader_shape_gate():
    fake = types.SimpleNamespace(_lazy_imports=lambda implementation: None)
    with pytest.raises(ImportError, match="cannot plug into its flash loader"):
        registration._check_flash_loader_shape(fake)


def test_sink_models_of_unchecked_types_are_rejected_at_load():
    """A model with a fixed flash-kernel list that is not a sink model hf_flash runs (gpt-oss,
    tests/integration/test_gpt_oss.py) is refused before it is built."""

    class Listed:
        _supports_flash_attn = True
        _compatible_flash_implementations = ["flash_attention_4"]
        config_class = types.SimpleNamespace(model_type="some_new_sink_model")

    with pytest.raises(ValueError, match="flash kernels it lists"):
        registration.check_model_supported(Listed)


def test_sinks_check_on_the_hook_point():
    class WithSinks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.sinks = torch.nn.Parameter(torch.zeros(4))

    with pytest.raises(ValueError, match="sinks"):
        registration.reject_unsupported(torch.nn.Sequential(WithSinks()))


def test_heads_wider_than_the_kernels_are_rejected_at_load():
    """Gemma 4's global layers have heads of ``global_head_dim`` (512 by default): 512 loads on
    "hf_flash"; wider heads are refused when the model is built, not at the first forward."""
    import copy

    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    def config(global_head_dim):
        return Gemma4TextConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                vocab_size=128, vocab_size_per_layer_input=128,
                                hidden_size_per_layer_input=16,
                                layer_types=["sliding_attention", "full_attention"],
                                global_head_dim=global_head_dim)  # fmt: skip

    model = Gemma4ForCausalLM._from_config(config(512), attn_implementation="hf_flash")
    assert model.model.layers[1].self_attn.head_dim == 512
    wide = config(576)
    with pytest.raises(ValueError, match="heads of 576.*up to 512"):
        Gemma4ForCausalLM._from_config(copy.deepcopy(wide), attn_implementation="hf_flash")
    Gemma4ForCausalLM._from_config(wide, attn_implementation="eager")  # the config is fine


def test_models_without_flash_support_are_rejected():
    class NoFlash:
        _supports_flash_attn = False

    with pytest.raises(ValueError, match="_supports_flash_attn"):
        registration.check_model_supported(NoFlash)


# ------------------------------------------------------------------------------------------
# family patch hook point
# ------------------------------------------------------------------------------------------


@pytest.fixture
def fake_patches(monkeypatch):
    """Point every switch at recording fake modules."""
    calls = []
    for switch in ("fused_rope", "fused_decode", "unpad"):
        name = f"_hf_flash_test_fake_{switch}"
        mod = types.ModuleType(name)
        mod.patch_model = lambda model, s=switch: calls.append(("patch", s, type(model).__name__))
        mod.revert_model = lambda model, s=switch: calls.append(("revert", s, type(model).__name__))
        monkeypatch.setitem(registration.PATCH_MODULES, switch, mod)
    monkeypatch.setattr(registration, "_switches", dict(registration._switches))
    return calls


def _tiny_llama(attn):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=64,
    )  # fmt: skip
    config._attn_implementation = attn
    return LlamaForCausalLM(config)


def test_family_patches_follow_the_attention_implementation(fake_patches):
    hf_flash.register(fused_rope=True, fused_decode=False)
    try:
        model = _tiny_llama("hf_flash")
        assert ("patch", "fused_rope", "LlamaForCausalLM") in fake_patches
        assert not any(c[1] == "fused_decode" for c in fake_patches)
        fake_patches.clear()
        model.set_attn_implementation("sdpa")
        assert ("revert", "fused_rope", "LlamaForCausalLM") in fake_patches
        fake_patches.clear()
        model.set_attn_implementation("hf_flash")
        assert ("patch", "fused_rope", "LlamaForCausalLM") in fake_patches
        fake_patches.clear()
        _tiny_llama("sdpa")
        assert fake_patches == []
    finally:
        hf_flash.register()


def test_installed_family_patches_are_applied_and_reverted():
    """The real fused-RoPE, fused-decode and unpad patches follow the model's attention
    implementation."""
    rope_patch = pytest.importorskip("hf_flash.integration.rope_patch")
    decode_patch = pytest.importorskip("hf_flash.integration.decode_patch")
    unpad_patch = pytest.importorskip("hf_flash.integration.unpad_patch")
    model = _tiny_llama("hf_flash")
    attn = model.model.layers[0].self_attn
    assert rope_patch.is_patched(attn) and decode_patch.is_patched(attn)
    assert unpad_patch.is_patched(model.model)
    model.set_attn_implementation("sdpa")
    assert not rope_patch.is_patched(attn) and not decode_patch.is_patched(attn)
    assert not unpad_patch.is_patched(model.model)
    model.set_attn_implementation("hf_flash")
    assert rope_patch.is_patched(attn) and decode_patch.is_patched(attn)
    assert unpad_patch.is_patched(model.model)


def test_switches_survive_the_import_hook():
    """register(fused_rope=False) before transformers is imported: the hook, which fires inside
    that call, must not switch fused RoPE back on."""
    got = _run(
        "import json\nimport hf_flash.integration as integ\n"
        "integ.install_transformers_hook()\n"
        "integ.register(fused_rope=False)\n"
        "from hf_flash.integration import registration\n"
        "print(json.dumps(registration._switches))"
    )
    assert got == {"fused_rope": False, "fused_decode": True, "unpad": True}

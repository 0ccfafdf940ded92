"""The error rule (docs/design.md, "Numerics") applied to test_flash_attn_2_equivalence.

That test compares hf_flash's last hidden state with eager's, both in bf16, at atol = rtol =
3e-2. Where it fails this says whose error it is: each implementation's max error against eager
in float32 on the same model and input (the test's own: ``set_seed(42)``, the family's tester),
so hf_flash's error can be set beside eager-bf16's and sdpa-bf16's. Run from the laid-out tree
(scripts/upstream_tests.sh sets the paths) on a GPU:

    python tests/upstream/equivalence_errors.py OUT.json TestModule:TestClass ...
"""

from __future__ import annotations

import importlib
import json
import sys
import tempfile

import torch

import hf_flash  # noqa: F401  (registers "hf_flash")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def errors(module_name: str, class_name: str) -> list:
    from transformers import set_seed

    test_cls = getattr(importlib.import_module(module_name), class_name)
    case = test_cls("test_flash_attn_2_equivalence")
    case.setUp()
    rows = []
    for model_class in case.all_model_classes:
        set_seed(42)
        config, inputs = case.model_tester.prepare_config_and_inputs_for_common()
        model = model_class(config)
        ids = inputs[model_class.main_input_name].to(DEVICE)
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)
            hidden = {}
            for name, attn, dtype in (("eager-fp32", "eager", torch.float32),
                                      ("eager-bf16", "eager", torch.bfloat16),
                                      ("sdpa-bf16", "sdpa", torch.bfloat16),
                                      ("hf_flash-bf16", "hf_flash", torch.bfloat16)):  # fmt: skip
                m = model_class.from_pretrained(tmp, dtype=dtype, attn_implementation=attn)
                m = m.to(DEVICE)
                with torch.no_grad():
                    hidden[name] = m(ids, output_hidden_states=True).hidden_states[-1].float()
        ref = hidden.pop("eager-fp32")
        row = {"test": f"{class_name}", "model": model_class.__name__}
        for name, h in hidden.items():
            diff = (h - ref).abs()
            beyond = int((diff > 3e-2 + 3e-2 * ref.abs()).sum())
            row[name] = {"max_err": float(diff.max()), "beyond_test_tol": beyond}
        fa, lp = hidden["hf_flash-bf16"], hidden["eager-bf16"]
        d = (fa - lp).abs()
        row["hf_flash_vs_eager_bf16"] = {"max_diff": float(d.max()),
                                         "beyond_test_tol": int((d > 3e-2 + 3e-2 * lp.abs()).sum()),
                                         "elements": d.numel()}  # fmt: skip
        lp_err = max(row["eager-bf16"]["max_err"], 1e-12)
        row["ratio_to_eager_bf16"] = row["hf_flash-bf16"]["max_err"] / lp_err
        rows.append(row)
    return rows


def _link_sources() -> None:
    """tests/test_pipeline_mixin.py reads transformers' sources from the tree's src/ at import:
    point it at the installed package, as scripts/upstream_tests.sh does."""
    import os

    import transformers

    os.makedirs("src", exist_ok=True)
    link = os.path.join("src", "transformers")
    if os.path.islink(link) and not os.path.exists(link):
        os.remove(link)
    if not os.path.exists(link):
        os.symlink(os.path.dirname(transformers.__file__), link)


def main(argv: list) -> None:
    out, specs = argv[0], argv[1:]
    _link_sources()
    results = []
    for spec in specs:
        module_name, class_name = spec.split(":")
        try:
            results.extend(errors(module_name, class_name))
        except Exception as e:  # one family's failure must not hide the others' numbers
            results.append({"test": class_name, "error": f"{type(e).__name__}: {e}"[:500]})
        print(json.dumps(results[-1]), flush=True)
    with open(out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])

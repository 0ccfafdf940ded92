"""Long-context LoRA fine-tuning recipes for hf_flash (accelerate + peft; the ``[recipes]``
extra).

Entry points: ``hf-flash-finetune`` (:mod:`hf_flash.recipes.lora_long_context`; ``--help`` lists
every option, ``--config NAME`` takes a shipped config from :func:`~hf_flash.recipes.config.configs_dir`)
and ``hf-flash-study`` (:mod:`hf_flash.recipes.long_context_study`). The configs, README and
results live in the repository's top-level ``recipes/`` folder; the configs install here as
package data (``hf_flash/recipes/configs``).
"""

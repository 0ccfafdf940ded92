"""Long-context LoRA fine-tuning recipes for hf_flash (accelerate + peft).

Entry point: ``python -m recipes.lora_long_context --config recipes/configs/<name>.yaml``.
See recipes/README.md.
"""

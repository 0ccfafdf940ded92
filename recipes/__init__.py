"""Checkout-only shim: ``python -m recipes.lora_long_context`` and
``python -m recipes.long_context_study`` keep working from a clone of the repository.

The recipe code lives in :mod:`hf_flash.recipes` (installed with the package; console commands
``hf-flash-finetune`` and ``hf-flash-study``). This folder holds the configs (``configs/``, also
installed as package data of ``hf_flash.recipes``), the README and the results; it is not part
of the wheel, because a top-level ``recipes`` package collides with other libraries' (torchtune).
"""

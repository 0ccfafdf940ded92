"""Checkout shim for ``python -m recipes.lora_long_context``: runs :mod:`hf_flash.recipes.lora_long_context`
(installed as the ``hf-flash-finetune`` command)."""

import sys

from hf_flash.recipes.lora_long_context import main

if __name__ == "__main__":
    sys.exit(main())

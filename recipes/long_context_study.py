"""Checkout shim for ``python -m recipes.long_context_study``: runs :mod:`hf_flash.recipes.long_context_study`
(installed as the ``hf-flash-study`` command)."""

import sys

from hf_flash.recipes.long_context_study import main

if __name__ == "__main__":
    sys.exit(main())

"""Hopper (sm_90a) attention kernels written in Gluon (``triton.experimental.gluon``).

Import the kernels from :mod:`.attention_fwd`; :mod:`.compile_check` builds every variant for
sm_90a without a GPU and reports registers and spills.
"""

from .attention_fwd import DEFAULT, VARIANTS, hopper_attention_forward, supports

__all__ = ["DEFAULT", "VARIANTS", "hopper_attention_forward", "supports"]

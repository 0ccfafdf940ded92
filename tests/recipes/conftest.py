"""Fixtures of the recipe tests."""

import pytest


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Each recipe run builds its own ``Accelerator`` (a process of its own in real use), but
    accelerate keeps one process-wide state and refuses a second ``Accelerator`` with other
    settings (e.g. the recipe's bf16 after a Trainer test's default in the same pytest process).
    Forget that state before each test so the recipe sees a fresh process."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield

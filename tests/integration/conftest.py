"""Fixtures shared by the integration tests."""

import pytest


@pytest.fixture(scope="module")
def root(request, tmp_path_factory):
    """Directory a test module saves its models in (``tiny_models.load`` saves each family there
    on first use); one per module, so no module reuses weights another one saved."""
    return tmp_path_factory.mktemp(f"models_{request.module.__name__}")

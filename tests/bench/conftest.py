import pytest


@pytest.fixture(autouse=True)
def _one_torch_thread(one_torch_thread):
    """Every test here runs its tiny pipelines on one torch thread (see tests/conftest.py)."""

"""Tiny real diffusers pipelines (random weights, built in-process) shared by the adapter tests."""

import pytest

pytest.importorskip("diffusers", reason="the diffusers adapter tests need diffusers 0.42")
pytest.importorskip("transformers", reason="the tiny pipelines need transformers")

from offload_core import KVStore  # noqa: E402
from offload_core.bench import models  # noqa: E402
from offload_core.diffusers import disable_kv_offload  # noqa: E402



@pytest.fixture(scope="session")
def qwen_pipe():
    return models.qwen21_pipeline()


@pytest.fixture(scope="session")
def flux_pipe():
    return models.flux2_klein_kv_pipeline()


@pytest.fixture(scope="session")
def images():
    return models.condition_images(2)


@pytest.fixture(autouse=True)
def _always_disable(request):
    """Leave every shared pipeline as it was, whatever a test did to it."""
    yield
    for name in ("qwen_pipe", "flux_pipe"):
        if name in request.fixturenames:
            disable_kv_offload(request.getfixturevalue(name))


class StoreLog:
    """Every KVStore the adapter opens, so tests can check what is still alive and where its files are."""

    def __init__(self):
        self.stores = []

    @property
    def live(self):
        return [s for s in self.stores if not s.closed]


@pytest.fixture
def store_log(monkeypatch):
    log = StoreLog()

    class RecordingStore(KVStore):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            log.stores.append(self)

    monkeypatch.setattr("offload_core.diffusers.session.KVStore", RecordingStore)
    return log


@pytest.fixture(autouse=True)
def _one_torch_thread(one_torch_thread):
    """Every test here runs its tiny pipelines on one torch thread (see tests/conftest.py)."""

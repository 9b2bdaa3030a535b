"""What reuse keeps past a request — host and file copies within the budget, nothing on the device — and that
eviction, a failed request, `disable_kv_offload` and a second `enable_kv_offload` leave nothing behind."""

import os

import pytest

from offload_core.bench import models
from offload_core.diffusers import disable_kv_offload, enable_kv_offload

from lifetime_helpers import Boom, raise_at_step, resident_prefix_tensors

STEPS, RES = 2, 64


def _files(path):
    return [f for _, _, fs in os.walk(path) for f in fs]


def _on_device(store_log):
    return [s for s in store_log.live if s.stats()["device_bytes"]]


@pytest.mark.parametrize("mode", ["ram_async", "file_async"])
def test_kept_stores_hold_nothing_on_the_device_while_vae_decodes(qwen_pipe, images, store_log, monkeypatch,
                                                                  tmp_path, mode):
    fields = {"file_dir": str(tmp_path)} if mode.startswith("file") else {}
    seen = []
    original = type(qwen_pipe.vae).decode

    def decode(vae, *args, **kwargs):
        seen.append((len(store_log.live), len(_on_device(store_log)), len(resident_prefix_tensors())))
        return original(vae, *args, **kwargs)

    monkeypatch.setattr(type(qwen_pipe.vae), "decode", decode)
    session = enable_kv_offload(qwen_pipe, mode, **fields, reuse="always")
    models.run_pipeline(qwen_pipe, images[:1], steps=STEPS, resolution=RES, cfg=True)
    models.run_pipeline(qwen_pipe, images[:1], steps=STEPS, resolution=RES, cfg=True, seed=1)
    assert seen == [(2, 0, 0), (2, 0, 0)]  # cond + uncond kept, sealed, their device rings freed
    assert session.reuse.stats()["hits"] == 2 and len(store_log.stores) == 2
    if fields:
        assert _files(tmp_path)
    disable_kv_offload(qwen_pipe)
    assert store_log.live == [] and _files(tmp_path) == []


def test_gpu_mode_on_a_cpu_is_kept_as_host_memory(qwen_pipe, images, store_log):
    """Without an accelerator the "device" is RAM: the gpu tier's cache is kept within the host budget."""
    session = enable_kv_offload(qwen_pipe, "gpu", reuse="always")
    models.run_pipeline(qwen_pipe, images[:1], steps=STEPS, resolution=RES)
    assert [s["reuse"] for s in session.last_stats] == ["kept"]
    stats = session.reuse.stats()
    assert stats["bytes"]["device"] == 0 and stats["bytes"]["host"] == session.last_stats[0]["bytes"]["device"]


def test_a_budget_too_small_keeps_nothing(qwen_pipe, images, store_log):
    session = enable_kv_offload(qwen_pipe, "ram_sync", reuse_budget={"host": 1024}, reuse="always")
    models.run_pipeline(qwen_pipe, images[:1], steps=STEPS, resolution=RES)
    models.run_pipeline(qwen_pipe, images[:1], steps=STEPS, resolution=RES)
    assert store_log.live == [] and session.reuse.stats()["hits"] == 0
    assert session.reuse.stats()["rejected"] == 2


def test_eviction_closes_the_oldest_prefix_and_deletes_its_files(qwen_pipe, images, store_log, tmp_path):
    first = enable_kv_offload(qwen_pipe, "file_sync", file_dir=str(tmp_path), reuse="always")
    models.run_pipeline(qwen_pipe, images[:1], steps=STEPS, resolution=RES)
    one = first.reuse.stats()["bytes"]["file"]
    files_one = len(_files(tmp_path))
    session = enable_kv_offload(qwen_pipe, "file_sync", file_dir=str(tmp_path), reuse_budget={"file": one}, reuse="always")
    assert store_log.stores[0].closed and _files(tmp_path) == []  # enabling again dropped what was kept
    models.run_pipeline(qwen_pipe, images[:1], steps=STEPS, resolution=RES)
    models.run_pipeline(qwen_pipe, images[1:2], steps=STEPS, resolution=RES)
    stats = session.reuse.stats()
    assert stats["entries"] == 1 and stats["evictions"] == 1 and stats["bytes"]["file"] <= one
    assert store_log.stores[1].closed and not store_log.stores[2].closed
    assert len(_files(tmp_path)) == files_one


def test_a_request_failing_on_a_hit_evicts_what_it_read(qwen_pipe, images, store_log, tmp_path):
    session = enable_kv_offload(qwen_pipe, "file_async", file_dir=str(tmp_path), reuse="always")
    models.run_pipeline(qwen_pipe, images[:1], steps=STEPS, resolution=RES, cfg=True)
    args = models.call_kwargs(qwen_pipe, images[:1], steps=STEPS, resolution=RES, cfg=True)
    with pytest.raises(Boom):
        qwen_pipe(**args, callback_on_step_end=raise_at_step(0))
    stats = session.reuse.stats()
    assert stats["hits"] == 2 and stats["entries"] == 0
    assert store_log.live == [] and _files(tmp_path) == [] and resident_prefix_tensors() == []


def test_a_request_failing_while_extracting_keeps_nothing(flux_pipe, images, store_log):
    session = enable_kv_offload(flux_pipe, "ram_sync", reuse="always")
    args = models.call_kwargs(flux_pipe, images[:1], steps=STEPS, resolution=RES)
    with pytest.raises(Boom):
        flux_pipe(**args, callback_on_step_end=raise_at_step(0))
    assert session.reuse.stats()["entries"] == 0 and store_log.live == []

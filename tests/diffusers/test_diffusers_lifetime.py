"""Cache lifetime: no store (and no cached tensor) survives into VAE decoding, exceptions or interrupts.

With reuse off; what reuse keeps past a request (host and file copies, nothing on the device) is tested in
test_reuse_lifetime.py.
"""

import os

import pytest

from offload_core.bench import models
from offload_core.diffusers import enable_kv_offload

from lifetime_helpers import Boom, DecodeProbe, raise_at_step, resident_prefix_tensors

LOSSLESS_MODES = ["gpu", "ram_sync", "ram_async", "file_sync", "file_async", "auto"]

STEPS, RES = 3, 64


@pytest.mark.parametrize("mode", LOSSLESS_MODES)
def test_qwen21_no_store_alive_while_vae_decodes(qwen_pipe, images, store_log, monkeypatch, mode):
    probe = DecodeProbe(monkeypatch, qwen_pipe.vae, store_log)
    enable_kv_offload(qwen_pipe, mode, reuse=False)
    models.run_pipeline(qwen_pipe, images[:1], steps=STEPS, resolution=RES, cfg=True)
    assert len(store_log.stores) == 2  # cond + uncond were really offloaded...
    assert probe.calls == [(0, 0)]  # ...and both were closed before decode, with nothing left resident


@pytest.mark.parametrize("mode", ["gpu", "ram_async"])
def test_flux2_no_store_alive_while_vae_decodes(flux_pipe, images, store_log, monkeypatch, mode):
    probe = DecodeProbe(monkeypatch, flux_pipe.vae, store_log)
    enable_kv_offload(flux_pipe, mode, reuse=False)
    models.run_pipeline(flux_pipe, images[:1], steps=STEPS, resolution=RES)
    assert len(store_log.stores) == 1
    assert probe.calls == [(0, 0)]


def test_upstream_qwen21_keeps_its_cache_through_decode(qwen_pipe, images, store_log, monkeypatch):
    """The probe sees the upstream lifetime this adapter fixes: without it the prefix K/V reach decode."""
    probe = DecodeProbe(monkeypatch, qwen_pipe.vae, store_log)
    models.run_pipeline(qwen_pipe, images[:1], steps=STEPS, resolution=RES)
    assert probe.calls[0][1] == len(qwen_pipe.transformer.transformer_blocks)


def test_modular_qwen21_no_store_alive_while_vae_decodes(images, store_log, monkeypatch):
    pipe = models.qwen21_modular_pipeline(guidance_scale=4.0)
    pipe.set_progress_bar_config(disable=True)
    probe = DecodeProbe(monkeypatch, pipe.vae, store_log)
    enable_kv_offload(pipe, "ram_sync", reuse=False)
    models.run_pipeline(pipe, images[:1], steps=STEPS, resolution=RES, cfg=True)
    assert len(store_log.stores) == 2 and probe.calls == [(0, 0)]


@pytest.mark.parametrize("mode", ["file_sync", "file_async", "ram_async", "gpu"])
def test_exception_in_loop_leaves_no_store_and_no_files(qwen_pipe, images, store_log, tmp_path, mode):
    fields = {"file_dir": str(tmp_path)} if mode.startswith("file") else {}
    enable_kv_offload(qwen_pipe, mode, **fields)
    args = models.call_kwargs(qwen_pipe, images[:1], steps=STEPS, resolution=RES, cfg=True)
    with pytest.raises(Boom):
        qwen_pipe(**args, callback_on_step_end=raise_at_step(1))
    assert len(store_log.stores) == 2 and store_log.live == []
    assert os.listdir(tmp_path) == []
    assert resident_prefix_tensors() == []


def test_flux2_exception_in_loop_leaves_no_store_and_no_files(flux_pipe, images, store_log, tmp_path):
    enable_kv_offload(flux_pipe, "file_async", file_dir=str(tmp_path))
    args = models.call_kwargs(flux_pipe, images[:1], steps=STEPS, resolution=RES)
    with pytest.raises(Boom):
        flux_pipe(**args, callback_on_step_end=raise_at_step(1))
    assert len(store_log.stores) == 1 and store_log.live == []
    assert os.listdir(tmp_path) == []


def test_interrupt_closes_stores_before_decode(qwen_pipe, images, store_log, monkeypatch):
    probe = DecodeProbe(monkeypatch, qwen_pipe.vae, store_log)

    def interrupt(pipe, i, t, kwargs):
        pipe._interrupt = True
        return kwargs

    enable_kv_offload(qwen_pipe, "ram_sync", reuse=False)
    args = models.call_kwargs(qwen_pipe, images[:1], steps=STEPS, resolution=RES)
    qwen_pipe(**args, callback_on_step_end=interrupt)
    assert len(store_log.stores) == 1 and probe.calls == [(0, 0)]


def test_latent_output_closes_stores_at_return(qwen_pipe, images, store_log):
    enable_kv_offload(qwen_pipe, "ram_sync", reuse=False)
    models.run_pipeline(qwen_pipe, images[:1], steps=STEPS, resolution=RES, output_type="latent")
    assert len(store_log.stores) == 1 and store_log.live == []


def test_failed_close_does_not_hide_the_pipelines_exception(qwen_pipe, images, store_log, monkeypatch):
    def broken_close(self):
        raise OSError("disk went away")

    enable_kv_offload(qwen_pipe, "ram_sync")
    args = models.call_kwargs(qwen_pipe, images[:1], steps=STEPS, resolution=RES)
    from offload_core import KVStore

    real_close = KVStore.close
    monkeypatch.setattr(KVStore, "close", broken_close)
    with pytest.raises(Boom):
        qwen_pipe(**args, callback_on_step_end=raise_at_step(1))
    monkeypatch.setattr(KVStore, "close", real_close)
    for store in store_log.stores:
        store.close()


def test_preview_decode_inside_the_loop_keeps_the_caches(qwen_pipe, images, store_log):
    """A step callback that decodes a preview must not close the stores the next steps read."""
    reference = models.run_pipeline(qwen_pipe, images[:1], steps=STEPS, resolution=RES)
    live_at_preview = []

    def preview(pipe, i, t, kwargs):
        live_at_preview.append(len(store_log.live))
        latents = pipe._unpack_latents(kwargs["latents"], RES, RES, pipe.vae_scale_factor)
        pipe.vae.decode(latents.to(pipe.vae.dtype), return_dict=False)
        return kwargs

    enable_kv_offload(qwen_pipe, "ram_async", reuse=False)
    args = models.call_kwargs(qwen_pipe, images[:1], steps=STEPS, resolution=RES)
    out = qwen_pipe(**args, callback_on_step_end=preview).images
    assert live_at_preview == [1] * STEPS and store_log.live == []
    assert (out == reference).all()

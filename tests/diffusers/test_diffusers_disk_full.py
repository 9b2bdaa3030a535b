"""A disk that fills up during the extract step: the generation finishes, falls back visibly, leaves no file.

Qwen-Image 2.1 recomputes the prefix on the later steps (as mode 'off'; no memory needed); FLUX.2 Klein keeps
its reference cache on the device as upstream does (its pipeline no longer passes the reference tokens after
step 0, so they cannot be recomputed). Real tiny pipelines, a real tmpfs that is too small for the cache.
"""

import os

import numpy as np
import pytest

from offload_core.bench import models
from offload_core.diffusers import disable_kv_offload, enable_kv_offload

STEPS, RES = 3, 64


def layer_file_bytes(pipe, images, tmp_path, **kwargs):
    session = enable_kv_offload(pipe, "file_sync", file_dir=str(tmp_path))
    try:
        models.run_pipeline(pipe, images, steps=STEPS, resolution=RES, **kwargs)
    finally:
        disable_kv_offload(pipe)
    stats = session.last_stats[0]
    return stats["bytes"]["file"] // stats["layers"]


def too_small_for_the_cache(mount_tmpfs, layer_bytes):
    return mount_tmpfs(f"{4 + layer_bytes * 5 // 2 // 1024}k")  # the lock file and two layers


def files_under(path):
    return [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]


@pytest.mark.parametrize("mode", ["file_sync", "file_async"])
def test_qwen21_full_disk_recomputes_the_prefix(qwen_pipe, images, mode, mount_tmpfs, tmp_path, caplog):
    reference = models.run_pipeline(qwen_pipe, images[:1], steps=STEPS, resolution=RES, cfg=True)
    where = too_small_for_the_cache(mount_tmpfs, layer_file_bytes(qwen_pipe, images[:1], tmp_path, cfg=True))
    session = enable_kv_offload(qwen_pipe, mode, file_dir=where)
    with caplog.at_level("WARNING", logger="offload_core.diffusers.session"):
        out = models.run_pipeline(qwen_pipe, images[:1], steps=STEPS, resolution=RES, cfg=True)
    fallbacks = [s["fallback"] for s in session.last_stats if s["fallback"]]
    assert fallbacks and all("is full" in f and "recomputing the prefix" in f for f in fallbacks)
    assert "recomputing the prefix" in caplog.text and where in caplog.text
    # Cached and recomputed prefixes agree up to float rounding (the bit-exact test of 'off' is elsewhere).
    assert np.abs(np.asarray(out, dtype=np.float32) - np.asarray(reference, dtype=np.float32)).max() < 2e-2
    assert files_under(where) == []
    disable_kv_offload(qwen_pipe)


@pytest.mark.parametrize("mode", ["file_sync", "file_async"])
def test_flux2_full_disk_keeps_the_cache_on_the_device(flux_pipe, images, mode, mount_tmpfs, tmp_path, caplog):
    reference = models.run_pipeline(flux_pipe, images[:1], steps=STEPS, resolution=RES)
    where = too_small_for_the_cache(mount_tmpfs, layer_file_bytes(flux_pipe, images[:1], tmp_path))
    session = enable_kv_offload(flux_pipe, mode, file_dir=where)
    with caplog.at_level("WARNING", logger="offload_core.diffusers.session"):
        out = models.run_pipeline(flux_pipe, images[:1], steps=STEPS, resolution=RES)
    assert np.array_equal(out, reference)  # the upstream cache on the device, bit for bit
    (stats,) = session.last_stats
    assert "is full" in stats["fallback"] and "mode 'gpu'" in stats["fallback"]
    assert "stays on the device" in caplog.text
    assert files_under(where) == []
    disable_kv_offload(flux_pipe)


@pytest.mark.parametrize("mode", ["file_sync", "file_async"])
def test_qwen21_io_error_writing_the_last_layer_in_the_background_recomputes(mode, qwen_pipe, images, tmp_path,
                                                                            caplog, failing_writes):
    # The file modes write in the background, so an I/O error on the last layer surfaces after its put; the
    # store is flushed when the extract forward ends, and the later steps recompute the prefix instead of failing.
    reference = models.run_pipeline(qwen_pipe, images[:1], steps=STEPS, resolution=RES, cfg=True)
    session = enable_kv_offload(qwen_pipe, mode, file_dir=str(tmp_path))
    heal = failing_writes(f"layer-{len(qwen_pipe.transformer.transformer_blocks) - 1:05d}")
    with caplog.at_level("WARNING", logger="offload_core.diffusers.session"):
        out = models.run_pipeline(qwen_pipe, images[:1], steps=STEPS, resolution=RES, cfg=True)
    heal()
    fallbacks = [s["fallback"] for s in session.last_stats if s["fallback"]]
    assert fallbacks and all("EIO" in f and "recomputing the prefix" in f for f in fallbacks)
    assert np.abs(np.asarray(out, dtype=np.float32) - np.asarray(reference, dtype=np.float32)).max() < 2e-2
    assert files_under(tmp_path) == []
    disable_kv_offload(qwen_pipe)


@pytest.mark.parametrize("which", ["qwen", "flux"])
def test_a_cache_folder_turned_read_only_between_requests_falls_back_and_names_it(which, qwen_pipe, flux_pipe, images,
                                                                                tmp_path, monkeypatch, caplog):
    """An ext4 remounted read-only after an error (or `chattr +i`) between two requests: the run directory's
    `mkdir` raised a bare OSError from inside the pipeline call. Now the request falls back as on a full disk,
    names the folder, and the next request, the folder writable again, is exact."""
    import errno

    from offload_core.tiers.file import fileowner

    pipe = qwen_pipe if which == "qwen" else flux_pipe
    kwargs = {"cfg": True} if which == "qwen" else {}
    reference = models.run_pipeline(pipe, images[1:], steps=STEPS, resolution=RES, **kwargs)
    session = enable_kv_offload(pipe, "file_sync", file_dir=str(tmp_path))
    first = models.run_pipeline(pipe, images[:1], steps=STEPS, resolution=RES, **kwargs)  # kept for reuse

    def read_only(parent, prefix, names):
        raise OSError(errno.EROFS, "Read-only file system", parent)

    monkeypatch.setattr(fileowner, "_make_dir", read_only)
    with caplog.at_level("WARNING", logger="offload_core.diffusers.session"):
        out = models.run_pipeline(pipe, images[1:], steps=STEPS, resolution=RES, **kwargs)  # a new prefix
    fallbacks = [s.get("fallback") for s in session.last_stats if s.get("fallback")]
    assert fallbacks and all("EROFS" in f and str(tmp_path) in f for f in fallbacks), session.last_stats
    if which == "flux":
        assert np.array_equal(out, reference)  # the upstream cache on the device, bit for bit
    else:  # recomputed: equal up to float rounding
        assert np.abs(np.asarray(out, dtype=np.float32) - np.asarray(reference, dtype=np.float32)).max() < 2e-2
    monkeypatch.undo()
    assert np.array_equal(models.run_pipeline(pipe, images[:1], steps=STEPS, resolution=RES, **kwargs), first)
    assert np.array_equal(models.run_pipeline(pipe, images[1:], steps=STEPS, resolution=RES, **kwargs), reference)
    disable_kv_offload(pipe)
    assert files_under(tmp_path) == []

"""When the cache steps aside for a run: parallel forwards, a sequence changed by another patch, errors.

Real tensors and real engine stores, driven the way ComfyUI drives the patches, without ComfyUI.
"""

import logging

import pytest
import torch

from kv_offload_pack.nodes.apply import apply_offload
from kv_offload_pack.nodes.inputs import config_from_inputs
from kv_offload_pack.offload_core import HostServices, KVStore

from nodes_tiny import FakePatcher, TinyDiT, sample
from patch_helpers import Recorder, inputs, no_files, patched_tiny, run_mode


def warnings_of(caplog, text):
    return [r for r in caplog.records if r.levelno == logging.WARNING and text in r.getMessage()]


# --- sequence changed by another patch ----------------------------------------------------------------------------

def _append_tokens(inputs_):
    img = inputs_["img"]
    inputs_["img"] = torch.cat([img, torch.ones_like(img[:, :2])], dim=1)
    return inputs_


def test_tokens_appended_after_ours_make_the_run_stand_down(tmp_path, caplog):
    dm, ours = patched_tiny("ram_sync", tmp_path)
    ours.set_model_post_input_patch(_append_tokens)  # another pack, after KV Offload in the chain
    dm_off, off = patched_tiny("off", tmp_path)
    off.set_model_post_input_patch(_append_tokens)
    noise, refs, txts = inputs(0)
    with caplog.at_level(logging.WARNING):
        out = sample(dm, ours.options(), noise, refs, txts)
    assert torch.equal(out, sample(dm_off, off.options(), noise, refs, txts))  # never the wrong tokens
    assert len(warnings_of(caplog, "another patch changed the sequence")) == 1
    assert no_files(tmp_path) == []


def test_a_sequence_changed_on_a_cached_step_is_refused(tmp_path):
    calls = {"n": 0}

    def grow_later(q, k, v, extra_options, **kwargs):  # upstream patch: adds a key from the second forward on
        calls["n"] += 1
        if calls["n"] <= 4:  # the 4 blocks of the first (capture) forward
            return {}
        return {"k": torch.cat([k, k[:, :, :1]], dim=2), "v": torch.cat([v, v[:, :, :1]], dim=2)}

    dm = TinyDiT()
    upstream = FakePatcher(dm)
    upstream.set_model_attn1_patch(grow_later)
    rec = Recorder()
    ours, _ = apply_offload(upstream, config_from_inputs("file_sync"),
                            host=lambda p: HostServices(temp_dir=lambda: str(tmp_path)), store_factory=KVStore,
                            telemetry=rec)
    noise, refs, txts = inputs(0)
    with pytest.raises(RuntimeError, match="another patch changed the sequence"):
        sample(dm, ours.options(), noise, refs, txts)
    assert rec.stores and all(s.closed for s in rec.stores) and no_files(tmp_path) == []


# --- errors at the end of a run ---------------------------------------------------------------------------------

class FailingClose(KVStore):
    def close(self):
        super().close()
        raise RuntimeError("close failed")


def test_a_close_error_does_not_replace_an_interrupt(tmp_path, caplog):
    dm, patched = patched_tiny("ram_sync", tmp_path, store_factory=FailingClose)
    noise, refs, txts = inputs(0)
    with caplog.at_level(logging.WARNING), pytest.raises(KeyboardInterrupt):
        sample(dm, patched.options(), noise, refs, txts, fail_at=(2, "cond-uuid"))
    assert warnings_of(caplog, "closing the cache after a failed run also failed")
    with pytest.raises(RuntimeError, match="close failed"):  # without an exception in flight it is raised
        sample(dm, patched.options(), noise, refs, txts)


# --- a disk that fills up during the capture ------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["file_sync", "file_async"])
@pytest.mark.parametrize("cfg", [None, 3.0])
def test_a_full_disk_during_capture_falls_back_to_recompute(mode, cfg, mount_tmpfs, tmp_path, caplog):
    where = mount_tmpfs("24k")  # the lock file and one 12 KiB layer file fit, the second layer does not
    dm, patched = patched_tiny(mode, where)
    noise, refs, txts = inputs(0, cfg=cfg is not None)
    with caplog.at_level(logging.WARNING):
        out = sample(dm, patched.options(), noise, refs, txts, cfg=cfg)
    # The generation finishes, identical to recomputing the reference every step, and says why once.
    assert torch.equal(out, run_mode("off", tmp_path, cfg=cfg))
    found = warnings_of(caplog, "the cache files could not be written")
    assert len(found) == 1 and "is full" in found[0].getMessage() and "recomputed every step" in found[0].getMessage()
    assert no_files(where) == []


@pytest.mark.parametrize("mode,cfg", [("file_async", None), ("file_async", 3.0), ("file_sync", None)])
def test_an_io_error_writing_the_last_layer_in_the_background_falls_back_to_recompute(mode, cfg, tmp_path, caplog,
                                                                                      failing_writes):
    # The file modes write in the background: an I/O error (a failing disk, not a full one, which `put` sees
    # at once) surfaces only after the last put. The capture is checked when its forward ends, so the run falls
    # back there instead of failing on a cached step.
    dm, patched = patched_tiny(mode, tmp_path)
    noise, refs, txts = inputs(0, cfg=cfg is not None)
    heal = failing_writes("layer-00003")  # TinyDiT: 2 double + 2 single blocks, one layer file each per cond
    with caplog.at_level(logging.WARNING):
        out = sample(dm, patched.options(), noise, refs, txts, cfg=cfg)
    heal()
    assert torch.equal(out, run_mode("off", tmp_path, cfg=cfg))
    found = warnings_of(caplog, "the cache files could not be written")
    assert len(found) == 1 and "EIO" in found[0].getMessage() and "recomputed every step" in found[0].getMessage()
    assert no_files(tmp_path) == []

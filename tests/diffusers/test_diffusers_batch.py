"""A batch from one prompt: every lossless mode with identical rows kept once gives `gpu`'s image without it, bit
for bit, keeping and moving a B-th of the bytes."""

import numpy as np
import pytest

from offload_core.bench import models
from offload_core.diffusers import disable_kv_offload, enable_kv_offload
from offload_core.layout import ALIGN

LOSSLESS_MODES = ["gpu", "ram_sync", "ram_async", "file_sync", "file_async", "auto"]
MEASURED = ["gpu", "ram_async", "file_async"]  # also run without dedup, for the bytes it keeps and moves
STEPS, RES = 3, 64
CASES = {"qwen": ("qwen_pipe", False), "qwen_cfg": ("qwen_pipe", True), "flux": ("flux_pipe", False)}


def _run(pipe, images, batch, cfg, mode, dedup):
    session = enable_kv_offload(pipe, mode, dedup=dedup)
    try:
        args = models.call_kwargs(pipe, images, steps=STEPS, resolution=RES, cfg=cfg)
        out = pipe(**args, num_images_per_prompt=batch).images
    finally:
        disable_kv_offload(pipe)
    return np.asarray(out), session.last_stats


def _kept(stats):
    return sum(sum(s["stored_bytes"].values()) for s in stats)


def _moved(stats):
    return sum(s["transfers"]["bytes"] for s in stats)


@pytest.mark.slow
@pytest.mark.parametrize("batch", [2, 4])
@pytest.mark.parametrize("case", CASES)
def test_identical_rows_kept_once_are_bit_exact_with_a_bth_of_the_bytes(request, images, case, batch):
    fixture, cfg = CASES[case]
    pipe = request.getfixturevalue(fixture)
    imgs = images[:1]
    reference, _ = _run(pipe, imgs, batch, cfg, "gpu", dedup=False)
    assert reference.shape[0] == batch
    for mode in LOSSLESS_MODES:
        out, stats = _run(pipe, imgs, batch, cfg, mode, dedup=None)
        assert np.array_equal(out, reference), f"mode {mode} with dedup differs from gpu without"
        assert [s["name"] for s in stats] == (["cond", "uncond"] if cfg else ["cond"])
        for s in stats:  # one prompt, one reference: every layer of every branch has identical rows
            assert s["dedup"]["layers"] == s["layers"] and s["dedup"]["rows_kept"] == s["layers"]
            assert s["dedup"]["rows_put"] == batch * s["layers"] and s["dedup"]["check_s"] > 0
        if mode in MEASURED:
            _, whole = _run(pipe, imgs, batch, cfg, mode, dedup=False)
            # The tiny layers are a few KiB, so fixed costs show: K and V may each gain up to one 4 KiB
            # alignment unit, a file its 4 KiB header, a file store its write staging (two units).
            slack = sum(3 * ALIGN * s["layers"] + 2 * ALIGN for s in stats)
            assert _kept(stats) <= _kept(whole) * (1 / batch + 0.01) + slack, mode
            assert _moved(stats) <= _moved(whole) * (1 / batch + 0.01) + 2 * ALIGN * STEPS * sum(
                s["layers"] for s in stats), mode
            if mode != "gpu":
                assert _moved(stats) > 0


def test_mixed_prompts_in_one_batch_keep_every_row(qwen_pipe, images):
    """Two prompts in one call: their rows differ, so every layer is kept whole, and the image is still exact."""
    outs = {}
    for mode, dedup in (("gpu", False), ("ram_async", None)):
        args = models.call_kwargs(qwen_pipe, images[:1], steps=STEPS, resolution=RES)  # a fresh generator
        args["prompt"] = ["a red cat on a blue sky", "a green owl in a dark wood"]
        session = enable_kv_offload(qwen_pipe, mode, dedup=dedup)
        try:
            outs[mode] = np.asarray(qwen_pipe(**args).images)
        finally:
            disable_kv_offload(qwen_pipe)
    assert np.array_equal(outs["ram_async"], outs["gpu"])
    (stats,) = session.last_stats
    assert stats["dedup"]["layers"] == 0 and stats["dedup"]["rows_kept"] == stats["dedup"]["rows_put"]

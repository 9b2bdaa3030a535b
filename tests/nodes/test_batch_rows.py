"""A batch of 2 and 4 latents through the ComfyUI patches, in-process: which layers have identical rows, and every
lossless mode with them kept once still matches `gpu` without dedup, bit for bit.

Measured here: on the FLUX.2 path the reference tokens sit in the joint sequence and attend to the noisy
target, so from the second block on their K/V differ per latent and are kept whole; only the first block's
(computed from the inputs alone, before any attention) are identical. On the Qwen-Image 2.1 path the prefix
attends only to itself: every layer's rows are identical and kept once.
"""

import dataclasses

import pytest
import torch

from kv_offload_pack.nodes.apply import apply_offload
from kv_offload_pack.nodes.inputs import config_from_inputs
from kv_offload_pack.offload_core import HostServices

from nodes_tiny import FakePatcher, TinyDiT, sample
from patch_helpers import Spy, inputs
from qwen21_tiny import Tiny21

LOSSLESS = ["gpu", "ram_sync", "ram_async", "file_sync", "file_async", "auto"]


def run(model, mode, tmp_path, batch, cfg, dedup=None):
    """The patched sampler's output and the `dedup` stats of every store it opened (cond first)."""
    dm = Tiny21() if model == "qwen21" else TinyDiT()
    config = dataclasses.replace(config_from_inputs(mode), dedup=dedup)
    patched, _ = apply_offload(FakePatcher(dm), config, store_factory=Spy,
                               host=lambda p: HostServices(temp_dir=lambda: str(tmp_path)))
    for name, obj in patched.object_patches.items():  # what ModelPatcher does while the model is patched
        setattr(dm, name.split(".", 1)[1], obj)
    Spy.made.clear()
    if model == "qwen21":
        dm.reset_prefix_cache(True)
    try:
        out = sample(dm, patched.options(), *inputs(cfg=cfg, batch=batch), cfg=cfg, batched=model != "qwen21")
    finally:
        if model == "qwen21":
            dm.reset_prefix_cache(False)
    assert Spy.made and all(s.closed for s in Spy.made)
    return out, [s.stats()["dedup"] for s in Spy.made]


@pytest.mark.parametrize("cfg", [None, 3.0], ids=["no_cfg", "cfg"])
@pytest.mark.parametrize("batch", [2, 4])
@pytest.mark.parametrize("model", ["flux2", "qwen21"])
def test_every_lossless_mode_with_dedup_matches_gpu_without(tmp_path, model, batch, cfg):
    reference, whole = run(model, "gpu", tmp_path, batch, cfg, dedup=False)
    assert all(d["layers"] == 0 for d in whole)
    layers = 3 if model == "qwen21" else 4
    for mode in LOSSLESS:
        out, dedup = run(model, mode, tmp_path, batch, cfg)
        assert torch.equal(out, reference), mode
        assert len(dedup) == (2 if cfg else 1)
        for d in dedup:
            assert d["rows_put"] == batch * layers
            # FLUX.2: the first double block only; Qwen-Image 2.1: every layer
            assert d["layers"] == (layers if model == "qwen21" else 1), (mode, d)
            assert d["rows_kept"] == d["layers"] + batch * (layers - d["layers"])

"""Autoregressive video: ComfyUI's AR sampler's KV cache served by a growing store, bit for bit.

The tiny causal model and the sampler loop (`ar_tiny.py`) follow ComfyUI v0.33's call sequence; every lossless mode
must give the video the same graph gives without the node, text-to-video and image-to-video, one and three frames
per block, with the cache's device bytes bounded by the resident layers and the ring's slots, and no file left
after a run, an interrupt or an error.
"""

import pytest
import torch

from kv_offload_pack.nodes.families import arvideo
from kv_offload_pack.nodes.run import host as host_mod
from kv_offload_pack.nodes.apply import apply_offload
from kv_offload_pack.nodes.inputs import config_from_inputs
from kv_offload_pack.offload_core import HostServices, OffloadConfig
from kv_offload_pack.offload_core.growing import GrowingKVStore

from ar_tiny import TinyCausalWan, sample_ar
from malloc_graph import SimMallocGraph
from nodes_tiny import FakePatcher
from patch_helpers import Recorder, no_files

MODES = ["gpu", "ram_sync", "ram_async", "file_sync", "file_async", "auto"]
SIGMAS = torch.tensor([1.0, 0.75, 0.5, 0.0])
FRAMES = 7  # latent frames: blocks of 3 leave a block of 1 at the end


class Made(GrowingKVStore):
    made = []

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        Made.made.append(self)


@pytest.fixture(autouse=True)
def _spy(monkeypatch):
    Made.made.clear()
    monkeypatch.setattr(arvideo, "GrowingKVStore", Made)


def latent(seed=0, frames=FRAMES):
    return torch.randn(1, 4, frames, 4, 6, generator=torch.Generator().manual_seed(seed))  # 6 tokens a frame


def initial(seed=5):
    return torch.randn(1, 4, 1, 4, 6, generator=torch.Generator().manual_seed(seed))


def video(tmp_path, config=None, nfpb=1, i2v=False, dm=None, seed=0, telemetry=None, host=None):
    """The video of the tiny graph; config None: without the node."""
    dm = dm or TinyCausalWan()
    options, patches = {"transformer_options": {}}, {}
    if config is not None:
        config = config_from_inputs(config) if isinstance(config, str) else config
        host = host or HostServices(temp_dir=lambda: str(tmp_path), pause_graph=host_mod.pause_graph())
        m, _ = apply_offload(FakePatcher(dm), config, host=lambda p: host, telemetry=telemetry or Recorder())
        options, patches = m.options(), m.object_patches
    return sample_ar(dm, options, latent(seed), SIGMAS, nfpb, initial() if i2v else None, patches, seed=seed)


@pytest.mark.parametrize("i2v", [False, True], ids=["t2v", "i2v"])
@pytest.mark.parametrize("nfpb", [1, 3])
@pytest.mark.parametrize("mode", MODES)
def test_every_lossless_mode_gives_the_video_without_the_node(tmp_path, mode, nfpb, i2v, one_torch_thread):
    theirs = video(tmp_path, None, nfpb, i2v)
    ours = video(tmp_path, mode, nfpb, i2v)
    assert torch.equal(ours, theirs)
    (store,) = Made.made
    stats = store.stats()
    tokens = FRAMES * 6
    assert store.closed and stats["growing"]["tokens"] == tokens  # the pack's store held the whole video
    assert stats["growing"]["appended"]["bytes"] == store.shape.bytes(tokens) * 3  # each block committed once
    resident = stats["plan"]["device"]
    slots = min(3 - resident, store.depth + 1)
    assert stats["peak_device_bytes"] <= store.shape.bytes(store.shape.capacity) * (resident + slots)
    assert no_files(tmp_path) == []


def test_streamed_and_resident_layers_mix_and_ram_spills_to_files(tmp_path, one_torch_thread):
    dm = TinyCausalWan()
    theirs = video(tmp_path, None, 3, dm=dm)
    layer = 2 * FRAMES * 6 * 16 * 4  # K and V of a whole layer, fp32
    for config in (OffloadConfig(mode="ram_async", device_budget=layer),
                   OffloadConfig(mode="ram_sync", host_budget=layer, file_dir=str(tmp_path))):
        Made.made.clear()
        assert torch.equal(video(tmp_path, config, 3, dm=dm), theirs)
        stats = Made.made[0].stats()
        assert stats["plan"]["device"] == (1 if config.device_budget else 0)
        if config.host_budget:
            assert stats["plan"]["file"] >= 1 and stats["growing"]["moves"]
    assert no_files(tmp_path) == []


@pytest.mark.parametrize("mode", ["ram_async", "file_async", "file_sync"])
@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_an_interrupt_or_error_frees_the_cache_and_the_next_run_is_exact(tmp_path, mode, error, one_torch_thread):
    dm = TinyCausalWan()
    theirs = video(tmp_path, None, 3, dm=dm, seed=1)
    dm.calls, dm.fail_at = 0, (9, 1)  # the third block's first step (4 calls a block), layer 1
    if error is RuntimeError:
        real = dm._attention

        def failing(i, *a):
            if (dm.calls, i) == dm.fail_at:
                raise RuntimeError("a sampling error")
            return real(i, *a)

        dm._attention = failing
    with pytest.raises(error):
        video(tmp_path, mode, 3, dm=dm)
    assert Made.made[0].closed and no_files(tmp_path) == []
    dm.fail_at = None
    dm.__dict__.pop("_attention", None)
    assert torch.equal(video(tmp_path, mode, 3, dm=dm, seed=1), theirs)
    assert no_files(tmp_path) == []


@pytest.mark.parametrize("mode", [None, *MODES])
def test_the_cache_stays_out_of_the_compilers_graphs(monkeypatch, tmp_path, mode, one_torch_thread):
    theirs = video(tmp_path, None, 3)
    sim = SimMallocGraph().install(monkeypatch)
    with sim.recording():
        ours = video(tmp_path, mode, 3)
    totals = sim.totals()
    assert totals["failures"] == 0 and totals["rogues"] == 0, totals
    assert torch.equal(ours, theirs)


def test_a_sampler_that_commits_otherwise_is_refused_not_served_wrong(tmp_path):
    dm = TinyCausalWan()
    m, _ = apply_offload(FakePatcher(dm), config_from_inputs("ram_sync"), host=lambda p: HostServices(),
                         telemetry=Recorder())
    options = m.options()
    with pytest.raises(RuntimeError, match="commits the clean pass"):  # its clean pass is not at sigma 0
        sample_ar(dm, options, latent(), SIGMAS, 3, None, m.object_patches, clean_sigma=0.01)
    assert Made.made[0].closed


def test_without_a_run_the_model_makes_its_own_caches():
    dm = TinyCausalWan()
    m, msg = apply_offload(FakePatcher(dm), config_from_inputs("ram_async"), host=lambda p: HostServices())
    assert "ar_video" in msg
    caches = m.object_patches[arvideo.INIT](1, 12, "cpu", torch.float32)
    assert type(caches[0]) is dict and caches[0]["k"].shape == (1, 12, 2, 8)


@pytest.mark.parametrize("storage", ["int8", "fp8"])
def test_compact_storage_is_opt_in_with_its_error_reported(tmp_path, storage, one_torch_thread):
    theirs = video(tmp_path, None, 3)
    config = OffloadConfig(mode="ram_async", storage=storage)
    m, msg = apply_offload(FakePatcher(TinyCausalWan()), config, host=lambda p: HostServices())
    assert f"as {storage} (lossy" in msg
    ours = video(tmp_path, config, 3)
    error = ((ours - theirs).norm() / theirs.norm()).item()
    assert 0 < error < 0.05
    kv_error = Made.made[-1].stats()["kv_error"]
    assert 0 < kv_error["relative"] < 0.05


def test_mode_off_leaves_comfys_own_cache(tmp_path):
    m, msg = apply_offload(FakePatcher(TinyCausalWan()), config_from_inputs("off"), host=lambda p: HostServices())
    assert arvideo.INIT not in m.object_patches and "own AR video cache" in msg
    assert torch.equal(video(tmp_path, "off", 3), video(tmp_path, None, 3)) and Made.made == []


def test_the_readout_shows_the_video_cache_growing_and_its_last_figures(tmp_path):
    from kv_offload_pack.nodes.readout.telemetry import TelemetryHub

    pushed = []
    hub = TelemetryHub(send=lambda event, payload: pushed.append(payload), min_interval_s=0.0)
    video(tmp_path, "ram_sync", 3, telemetry=hub)
    final = pushed[-1]
    (store,) = [s for s in final["stores"] if s["name"] == "video"]
    assert store["growing"]["tokens"] == FRAMES * 6 and store["growing"]["step_bytes"] > 0
    assert final["ar_video"]["tokens"] == FRAMES * 6 and final["ar_video"]["bytes"]["host_pageable"] == 0  # closed
    assert any(p.get("ar_video", {}).get("tokens", 0) < FRAMES * 6 for p in pushed[:-1])  # it grew during the run

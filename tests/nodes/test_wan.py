"""Wan Animate 2: the pose cache served by our stores, against ComfyUI's own cpu/default cache."""

import logging
import os

import pytest
import torch

from kv_offload_pack.nodes.apply import apply_offload
from kv_offload_pack.nodes.inputs import config_from_inputs
from kv_offload_pack.nodes.readout.telemetry import TelemetryHub
from kv_offload_pack.nodes.families.wan import CACHE_KEY
from kv_offload_pack.offload_core import HostServices, KVStore, OffloadConfig
from kv_offload_pack.offload_core.places import MiB

from nodes_tiny import FakePatcher
from patch_helpers import Spy
from wan_tiny import ComfyPoseCache, TinyWanAnimate2, sample, windows_of

MODES = ["gpu", "ram_sync", "ram_async", "file_sync", "file_async", "auto"]
WINDOWS = windows_of(6, 4, 2)  # 6 latent frames, windows of 4 overlapping by 2: [0..3], [2..5]
LAYER_BYTES = 2 * 4096  # one block of a window here: 8 pose tokens of 32 fp32 per half, each 4 KiB aligned


def inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(1, 24, 32, generator=g), torch.randn(1, 24, 32, generator=g),
            [torch.randn(1, 3, 32, generator=g) for _ in range(2)])


def drive(tmp_path, config=None, cfg=None, windows=None, batched=True, theirs=None, host=None, hub=None, dm=None,
          after=None):
    """Sample the tiny model; config None: ComfyUI's cache `theirs` (or none) alone. `after`: a ComfyUI cache
    set on the MODEL after our node. Returns the latents."""
    Spy.made.clear()
    dm = dm or TinyWanAnimate2()
    options = {"transformer_options": {} if theirs is None else {CACHE_KEY: theirs}}
    if config is not None:
        config = config_from_inputs(config) if isinstance(config, str) else config
        host = host or HostServices(temp_dir=lambda: str(tmp_path))
        patched, _ = apply_offload(FakePatcher(dm, options), config, host=lambda p: host, store_factory=Spy,
                                   telemetry=hub)
        options = patched.options()
    if after is not None:
        options["transformer_options"][CACHE_KEY] = after
    noise, pose, txts = inputs()
    return sample(dm, options, noise, pose, txts, cfg=cfg, windows=windows, batched=batched)


def files_in(path):
    return [f for _, _, fs in os.walk(path) for f in fs]


@pytest.mark.parametrize("windows", [None, WINDOWS], ids=["whole", "windows"])
@pytest.mark.parametrize("cfg, batched", [(None, True), (3.0, True), (3.0, False)], ids=["nocfg", "cfg", "cfg-split"])
@pytest.mark.parametrize("mode", MODES)
def test_every_lossless_mode_matches_comfys_cpu_cache(tmp_path, mode, cfg, batched, windows):
    comfy = drive(tmp_path, None, cfg, windows, batched, theirs=ComfyPoseCache())
    ours = drive(tmp_path, mode, cfg, windows, batched)
    assert torch.equal(ours, comfy)
    assert len(Spy.made) == len(windows or [None])  # one store per pose sequence, cond and uncond share it
    assert all(s.stats()["gets"] > 0 and s.closed for s in Spy.made)
    assert files_in(tmp_path) == []


def test_comfys_cache_is_bit_identical_to_no_cache_here(tmp_path):
    # measured: reprojecting K/V from the cached block input repeats the uncached pass's own operations
    for windows in (None, WINDOWS):
        assert torch.equal(drive(tmp_path, None, 3.0, windows, theirs=ComfyPoseCache()),
                           drive(tmp_path, None, 3.0, windows))


def test_windows_are_kept_and_reused_across_steps(tmp_path):
    pushed = []
    hub = TelemetryHub(send=lambda event, payload: pushed.append(payload), min_interval_s=0.0)
    drive(tmp_path, "ram_sync", 3.0, WINDOWS, batched=False, hub=hub)
    summary = pushed[-1][CACHE_KEY]
    forwards = 3 * 2  # steps x (cond, uncond) per window
    assert (summary["fills"], summary["evictions"], summary["windows"]) == (2, 0, 2)
    assert summary["hits"] == 2 * (forwards - 1)
    assert all(s.stats()["gets"] == 3 * forwards for s in Spy.made)  # a fill pass reads back too (prepass)
    line = summary["per_window"]["pose 2"]
    assert line.startswith("pose 2: device 0.0 MiB, RAM 0.0") and "5 hits" in line and "prefetch wait" in line
    assert [s["name"] for s in pushed[-1]["stores"]] == ["pose 1", "pose 2"]


def test_a_ram_budget_below_the_cache_spills_to_files_without_eviction(tmp_path):
    short = HostServices(temp_dir=lambda: str(tmp_path), free_host_memory=lambda: 1)  # RAM "full"
    budget = OffloadConfig(mode="ram_sync", host_budget=4 * LAYER_BYTES)  # 4 of the 6 blocks of 2 windows
    pushed = []
    hub = TelemetryHub(send=lambda event, payload: pushed.append(payload), min_interval_s=0.0)
    ours = drive(tmp_path, budget, 3.0, WINDOWS, host=short, hub=hub)
    plans = [s.stats()["plan"] for s in Spy.made]
    assert torch.equal(ours, drive(tmp_path, None, 3.0, WINDOWS, theirs=ComfyPoseCache()))
    assert [(p["host_pageable"], p["file"]) for p in plans] == [(3, 0), (1, 2)]
    assert pushed[-1][CACHE_KEY]["evictions"] == 0
    assert files_in(tmp_path) == []


def test_without_room_windows_are_evicted_lru_and_counted_like_comfy(tmp_path):
    short = HostServices(temp_dir=lambda: str(tmp_path), free_host_memory=lambda: 1)
    pushed = []
    hub = TelemetryHub(send=lambda event, payload: pushed.append(payload), min_interval_s=0.0)
    ours = drive(tmp_path, "ram_sync", None, WINDOWS, host=short, hub=hub)
    assert all(s.closed for s in Spy.made) and files_in(tmp_path) == []
    theirs = ComfyPoseCache(free_memory=lambda: 1)
    assert torch.equal(ours, drive(tmp_path, None, None, WINDOWS, theirs=theirs))
    summary = pushed[-1][CACHE_KEY]
    assert summary["evictions"] == theirs.evictions == 3 * 2 - 1  # every window change, after the first fill
    assert summary["fills"] == 3 * 2 and summary["hits"] == 0 and summary["windows"] == 1


@pytest.mark.parametrize("failure", [KeyboardInterrupt, RuntimeError])
@pytest.mark.parametrize("windows", [None, WINDOWS], ids=["whole", "windows"])
def test_stores_are_freed_on_interrupt_and_error(tmp_path, failure, windows):
    dm = TinyWanAnimate2()
    dm.fail_at = (3, 1)  # a cached (or, with windows, a second-window fill) forward, at block 1

    def boom(*a):
        raise failure("stopped mid-forward")

    if failure is RuntimeError:
        dm.fail_at = None
        dm.forward_gen, real = (lambda i, *a: boom() if dm.forwards == 3 and i == 1 else real(i, *a)), dm.forward_gen
    with pytest.raises(failure):
        drive(tmp_path, "file_async", None, windows, dm=dm)
    assert Spy.made and all(s.closed for s in Spy.made)
    assert files_in(tmp_path) == []


def test_an_interrupted_fill_is_never_served(tmp_path):
    from kv_offload_pack.nodes.run.state import RunState
    from kv_offload_pack.nodes.families.wan import PoseStoreCache

    run = RunState(OffloadConfig(mode="ram_sync"), HostServices(), 3, KVStore)
    cache = PoseStoreCache(run, 3)
    pose, x = torch.randn(2, 8, 32), torch.randn(2, 8, 32)
    cache.select(pose)
    cache.put(0, x)  # the forward stops here
    first = cache.window.store
    cache.select(pose)
    assert not cache.filled(3) and first.closed and len(cache.windows) == 1
    for i in range(3):
        cache.put(i, x * (i + 1))
    cache.select(pose.clone())
    assert cache.filled(3) and cache.hits == 1
    assert torch.equal(cache.take(2, x.device, x.dtype, 2), (x[:1] * 3).expand(2, -1, -1))  # row 0, repeated
    run.close()
    cache.free()
    assert cache.window is None and cache.windows == [] and cache.summary()["fills"] == 1


@pytest.mark.parametrize("where", ["upstream", "downstream"])
@pytest.mark.parametrize("dtype, storage", [("int8", "int8"), ("int4", "int8"), ("default", "exact")])
def test_comfys_cache_node_is_taken_over_and_its_dtype_honoured(tmp_path, caplog, where, dtype, storage):
    theirs = ComfyPoseCache()
    theirs.dtype = dtype
    with caplog.at_level(logging.WARNING):
        drive(tmp_path, "ram_async", 3.0, WINDOWS, **({"theirs": theirs} if where == "upstream" else {"after": theirs}))
    assert theirs.slots == [] and Spy.made and all(s.config.storage == storage for s in Spy.made)
    assert "WanAnimate2Cache" in caplog.text and (dtype == "default" or f"'{dtype}'" in caplog.text)


def test_the_node_says_it_takes_over_comfys_pose_cache(tmp_path):
    options = {"transformer_options": {CACHE_KEY: ComfyPoseCache()}}
    patched, msg = apply_offload(FakePatcher(TinyWanAnimate2(), options), config_from_inputs("file_sync"),
                                 host=lambda p: None, store_factory=KVStore)
    assert "wan_animate2" in msg and "WanAnimate2Cache found upstream" in msg
    assert CACHE_KEY not in patched.model_options["transformer_options"]  # ours is made per run
    assert "patches" not in patched.model_options["transformer_options"]  # no attention hook


def test_off_drops_comfys_cache_and_recomputes(tmp_path):
    theirs = ComfyPoseCache()
    off = drive(tmp_path, "off", 3.0, WINDOWS, theirs=theirs)
    assert Spy.made == [] and theirs.slots == []
    assert torch.equal(off, drive(tmp_path, None, 3.0, WINDOWS))


@pytest.mark.parametrize("storage", ["fp8", "int8"])
def test_lossy_storage_error_is_measured_and_shown(tmp_path, storage):
    exact = drive(tmp_path, None, 3.0, WINDOWS, theirs=ComfyPoseCache())
    pushed = []
    hub = TelemetryHub(send=lambda event, payload: pushed.append(payload), min_interval_s=0.0)
    lossy = drive(tmp_path, OffloadConfig(mode="ram_sync", storage=storage), 3.0, WINDOWS, hub=hub)
    latent_error = ((lossy - exact).norm() / exact.norm()).item()
    cache_error = [s["kv_error"]["relative"] for s in pushed[-1]["stores"]]
    assert 0 < latent_error < 0.05 and all(0 < e < 0.05 for e in cache_error)


def test_the_least_recently_used_window_is_the_one_evicted():
    from kv_offload_pack.nodes.run.state import RunState
    from kv_offload_pack.nodes.families.wan import PoseStoreCache

    cache = None
    room_for_two = HostServices(free_host_memory=lambda: 0 if len(cache.windows) >= 2 else 1 << 40)
    run = RunState(OffloadConfig(mode="ram_sync"), room_for_two, 2, KVStore)
    cache = PoseStoreCache(run, 2)
    a, b, c = (torch.full((1, 4, 32), float(n)) for n in range(3))

    def fill(key):
        cache.select(key)
        if not cache.filled(2):
            for i in range(2):
                cache.put(i, key)

    fill(a), fill(b), fill(a), fill(c)  # a was used after b: b is the least recently used
    assert [w.name for w in cache.windows] == ["pose 1", "pose 3"] and cache.evictions == 1
    cache.select(a)
    assert cache.filled(2) and cache.hits == 2
    run.close()


def test_the_ram_budget_input_reaches_the_ram_modes_only():
    from kv_offload_pack.nodes.inputs import validation_message

    assert config_from_inputs("ram_async", ram_budget_mb=64).host_budget == 64 * MiB
    assert config_from_inputs("auto", ram_budget_mb=64).host_budget == 64 * MiB
    assert config_from_inputs("file_sync", ram_budget_mb=64).host_budget is None  # nothing kept in RAM
    assert config_from_inputs("ram_sync", ram_budget_mb=0).host_budget is None  # 0: no cap of its own
    assert "`ram_budget_mb` must be a whole number of MiB >= 0; got -1" in validation_message(mode="auto",
                                                                                             ram_budget_mb=-1)


def test_a_full_disk_while_filling_falls_back_to_recompute(mount_tmpfs, tmp_path, caplog):
    where = mount_tmpfs("12k")  # the lock file and one block file fit, the next does not
    with caplog.at_level(logging.WARNING):
        ours = drive(where, "file_sync", 3.0)
    assert Spy.made and all(s.closed for s in Spy.made) and files_in(where) == []
    assert "the cache files could not be written" in caplog.text
    assert torch.equal(ours, drive(tmp_path, None, 3.0))


def test_a_full_disk_in_a_window_prepass_stops_with_the_fix(mount_tmpfs, tmp_path):
    where = mount_tmpfs("28k")  # the prepass has put blocks the store can no longer serve
    with pytest.raises(RuntimeError, match="Free disk space or pick a RAM mode"):
        drive(where, "file_sync", 3.0, WINDOWS)
    assert Spy.made and all(s.closed for s in Spy.made) and files_in(where) == []

"""ComfyUI's multi-GPU sampling for the families with their own cache seam: Qwen-Image 2.1's prefix cache and Wan
Animate 2's pose cache. Each device's thread gets its own cache and stores (a store serves one thread), the
latents are those of the same conds on one device, the RAM budget covers every device's windows, and an
interrupt in one device's thread closes every store."""

import logging
import threading

import pytest
import torch

from kv_offload_pack.nodes.apply import apply_offload
from kv_offload_pack.nodes.inputs import config_from_inputs
from kv_offload_pack.nodes.keys import RUN_KEY
from kv_offload_pack.nodes.families.qwen21 import PREFIX_ENTRIES
from kv_offload_pack.nodes.run.state import RunState
from kv_offload_pack.nodes.readout.telemetry import TelemetryHub
from kv_offload_pack.nodes.families.wan import CACHE_KEY
from kv_offload_pack.offload_core import HostServices, KVStore, OffloadConfig
from kv_offload_pack.offload_core.places import HOST_PLACES

from nodes_tiny import FakePatcher
from nodes_tiny import sample as sample_dit
from patch_helpers import Spy, inputs, no_files
from qwen21_tiny import Tiny21
from wan_tiny import TinyWanAnimate2, windows_of
from wan_tiny import sample as sample_wan

LOSSLESS = ["gpu", "ram_sync", "ram_async", "file_sync", "file_async", "auto"]
WINDOWS = windows_of(6, 4, 2)


def _one_thread_each(stores):
    """Every store did its puts and gets on one thread, the devices' stores on different threads; all closed."""
    for s in stores:
        assert len(s.threads["put"]) == 1 and s.threads["get"] <= s.threads["put"] and s.closed, s.name
        assert s.stats()["gets"] > 0, s.name
    assert len({next(iter(s.threads["put"])) for s in stores}) == 2


# --- Qwen-Image 2.1 --------------------------------------------------------------------------------------------

def qwen21(mode, tmp_path, multigpu=False, model_options=None, attend=None):
    """The tiny 2.1 model behind the node in `mode` (None: its own cache), cond and uncond in separate forwards."""
    Spy.made.clear()
    dm = Tiny21()
    options = model_options or {"transformer_options": {}}
    if mode is not None:
        patched, _ = apply_offload(FakePatcher(dm, options), config_from_inputs(mode),
                                   host=lambda p: HostServices(temp_dir=lambda: str(tmp_path)), store_factory=Spy)
        options = patched.options()
        for name, obj in patched.object_patches.items():  # what ModelPatcher does while the model is patched
            setattr(dm, name.split(".", 1)[1], obj)
    if attend is not None:
        dm._attend = attend(dm._attend)
    noise, refs, txts = inputs(0, True)
    dm.reset_prefix_cache(True)
    try:
        return sample_dit(dm, options, noise, refs, txts, cfg=3.0, batched=False, multigpu=multigpu)
    finally:
        dm.reset_prefix_cache(False)


@pytest.mark.parametrize("mode", LOSSLESS)
def test_qwen21_each_device_keeps_its_own_prefix_cache_and_the_latents_of_one_device(mode, tmp_path, caplog):
    one_device = qwen21("gpu", tmp_path)
    with caplog.at_level(logging.WARNING):
        out = qwen21(mode, tmp_path, multigpu=True)
    assert torch.equal(out, one_device)
    assert not [r for r in caplog.records if "stands down" in r.message or "multi-GPU" in r.message]
    assert sorted(s.name for s in Spy.made) == ["cond on cpu:0", "cond on cpu:1"]
    assert sorted(str(s.device) for s in Spy.made) == ["cpu:0", "cpu:1"]  # the readout names each device
    _one_thread_each(Spy.made)
    assert no_files(tmp_path) == []


def test_qwen21_a_copy_of_the_model_per_device_matches_the_models_own_cache(tmp_path):
    own = qwen21(None, tmp_path)
    for mode in LOSSLESS:
        assert torch.equal(qwen21(mode, tmp_path, multigpu=[torch.device("cpu", 0), torch.device("cpu", 1)]), own), mode
        _one_thread_each(Spy.made)
    assert no_files(tmp_path) == []


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (scripts/gpu_check.sh runs it)")
def test_qwen21_two_cuda_devices_each_keep_their_own_prefix_cache(tmp_path):
    cuda = [torch.device("cuda", 0), torch.device("cuda", 1)]
    reference = qwen21("gpu", tmp_path, multigpu=cuda)  # computed on the GPUs too: the CPU's differs in its bits
    for mode in LOSSLESS:
        assert torch.equal(qwen21(mode, tmp_path, multigpu=cuda), reference), mode
        assert sorted(str(s.device) for s in Spy.made) == ["cuda:0", "cuda:1"], mode
        _one_thread_each(Spy.made)
    assert no_files(tmp_path) == []


def test_qwen21_a_device_s_cache_reads_the_model_its_thread_runs():
    """Each device runs a copy of the model: its cache keys prefixes by that copy (the reuse key names the model),
    not by the one the node patched."""
    patched_dm, other = Tiny21(), Tiny21()
    patched, _ = apply_offload(FakePatcher(patched_dm), config_from_inputs("ram_sync"), host=lambda p: None,
                               store_factory=KVStore)
    select = patched.object_patches["diffusion_model.select_prefix_cache"]
    run = RunState(config_from_inputs("ram_sync"), None, 3, KVStore, devices=True)
    other.select_prefix_cache = select
    run.bind_thread(torch.device("cpu", 1), other)
    select(torch.ones(1, 4), 0, torch.device("cpu"), {RUN_KEY: run})
    assert run.extension((PREFIX_ENTRIES, "cpu:1")).dm is other and run.extension(PREFIX_ENTRIES) is None
    run.close()


def test_qwen21_an_interrupt_in_one_device_s_thread_closes_every_store_and_the_next_run_is_exact(tmp_path):
    seen = []

    def on_device_1_at_step_2(attend):
        def interrupting(i, *a):
            if threading.current_thread() is not threading.main_thread():
                seen.append(threading.get_ident())
                if len(set(seen)) == 2 and seen.count(seen[-1]) > 9:  # both threads ran; a later forward
                    raise KeyboardInterrupt("interrupted mid-forward")
            return attend(i, *a)
        return interrupting

    with pytest.raises(KeyboardInterrupt):
        qwen21("file_async", tmp_path, multigpu=True, attend=on_device_1_at_step_2)
    assert len(Spy.made) == 2 and all(s.closed for s in Spy.made)
    assert no_files(tmp_path) == []
    assert torch.equal(qwen21("file_async", tmp_path, multigpu=True), qwen21("gpu", tmp_path))
    assert no_files(tmp_path) == []


# --- Wan Animate 2 -----------------------------------------------------------------------------------------------

def wan(config, tmp_path, windows=None, multigpu=False, hub=None, dm=None):
    """The tiny Wan Animate 2 behind the node (`config`: a mode or an `OffloadConfig`), CFG, conds apart."""
    Spy.made.clear()
    dm = dm or TinyWanAnimate2()
    config = config_from_inputs(config) if isinstance(config, str) else config
    host = HostServices(temp_dir=lambda: str(tmp_path))
    patched, _ = apply_offload(FakePatcher(dm, {"transformer_options": {}}), config, host=lambda p: host,
                               store_factory=Spy, telemetry=hub)
    g = torch.Generator().manual_seed(0)
    noise, pose = torch.randn(1, 24, 32, generator=g), torch.randn(1, 24, 32, generator=g)
    txts = [torch.randn(1, 3, 32, generator=g) for _ in range(2)]
    return sample_wan(dm, patched.options(), noise, pose, txts, cfg=3.0, windows=windows, batched=False,
                      multigpu=multigpu)


@pytest.mark.parametrize("windows", [None, WINDOWS], ids=["whole", "windows"])
@pytest.mark.parametrize("mode", LOSSLESS)
def test_wan_each_device_keeps_its_own_pose_windows_and_the_latents_of_one_device(mode, windows, tmp_path, caplog):
    one_device = wan("gpu", tmp_path, windows)
    pushed = []
    hub = TelemetryHub(send=lambda event, payload: pushed.append(payload), min_interval_s=0.0)
    with caplog.at_level(logging.WARNING):
        out = wan(mode, tmp_path, windows, multigpu=True, hub=hub)
    assert torch.equal(out, one_device)
    assert not [r for r in caplog.records if "stands down" in r.message or "multi-GPU" in r.message]
    n = len(windows or [None])
    assert sorted(s.name for s in Spy.made) == sorted(f"pose {i} on cpu:{d}" for i in range(1, n + 1) for d in (0, 1))
    for d in ("cpu:0", "cpu:1"):
        mine = [s for s in Spy.made if s.name.endswith(d)]
        assert {str(s.device) for s in mine} == {d} and len({t for s in mine for t in s.threads["put"]}) == 1
    _one_thread_each([s for s in Spy.made if s.name.startswith("pose 1 ")])
    summary = pushed[-1][CACHE_KEY]  # the readout's pose cache: both devices' windows
    assert (summary["windows"], summary["fills"], summary["evictions"]) == (2 * n, 2 * n, 0)
    assert sorted(summary["per_window"]) == sorted(s.name for s in Spy.made)
    assert no_files(tmp_path) == []


def _ram_held(config, tmp_path):
    """RAM each window's store held while open, by store name, in a multi-GPU run with windows."""
    pushed = []
    hub = TelemetryHub(send=lambda event, payload: pushed.append(payload), min_interval_s=0.0)
    wan(config, tmp_path, WINDOWS, multigpu=True, hub=hub)
    return {s["name"]: sum(s["bytes_while_open"].get(p) or 0 for p in HOST_PLACES) for s in pushed[-1]["stores"]}


def test_wan_the_ram_budget_covers_every_device_s_windows(tmp_path):
    alone = _ram_held(OffloadConfig(mode="ram_sync"), tmp_path)
    assert len(alone) == 4 and min(alone.values()) > 0
    budget = int(1.5 * max(alone.values()))  # room in RAM for one window and a half, whichever device's
    _ram_held(OffloadConfig(mode="ram_sync", host_budget=budget), tmp_path)
    # What each window's store was allowed to keep in RAM, against what it needs: together within the budget,
    # though both devices open their first window at the same moment (each on its own budget: 2 x 24 KiB).
    booked = {s.name: min(s.config.host_budget, alone[s.name]) for s in Spy.made}
    assert sum(booked.values()) <= budget and max(booked.values()) > 0
    assert no_files(tmp_path) == []


def test_wan_an_interrupt_in_one_device_s_thread_closes_every_store_and_the_next_run_is_exact(tmp_path):
    dm = TinyWanAnimate2()
    real, calls = dm.forward_gen, []

    def interrupting(i, *a):
        if threading.current_thread() is not threading.main_thread():
            calls.append(threading.get_ident())
            if len(set(calls)) == 2 and calls.count(calls[-1]) > 8:
                raise KeyboardInterrupt("interrupted mid-forward")
        return real(i, *a)

    dm.forward_gen = interrupting
    with pytest.raises(KeyboardInterrupt):
        wan("file_async", tmp_path, WINDOWS, multigpu=True, dm=dm)
    assert Spy.made and all(s.closed for s in Spy.made)
    assert no_files(tmp_path) == []
    assert torch.equal(wan("file_async", tmp_path, WINDOWS, multigpu=True), wan("gpu", tmp_path, WINDOWS))
    assert no_files(tmp_path) == []

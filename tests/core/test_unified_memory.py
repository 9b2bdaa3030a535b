"""The RAM modes are disabled where host RAM and device memory are one pool (Apple MPS, integrated NVIDIA GPUs)."""

import logging
from types import SimpleNamespace

import torch

from offload_core import KVStore, Mode, OffloadConfig
from offload_core.host.devices import unified_memory_reason
from offload_core.places import FILE, HOST_PLACES, GiB
from offload_core.store.plan import Figures, make_plan, resolve


def fake_cuda_properties(integrated):
    """Stand-in for torch.cuda.get_device_properties on a machine without that GPU."""
    return lambda index: SimpleNamespace(name="NVIDIA GB10" if integrated else "NVIDIA H100", is_integrated=integrated)


def test_detection():
    assert "integrated GPU" in unified_memory_reason(torch.device("cuda", 0), fake_cuda_properties(True))
    assert unified_memory_reason(torch.device("cuda", 0), fake_cuda_properties(False)) is None
    assert "Apple MPS" in unified_memory_reason(torch.device("mps"))
    assert unified_memory_reason(torch.device("cpu")) is None


def test_explicit_ram_tier_falls_back_to_gpu_with_one_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="offload_core"):
        store = KVStore(OffloadConfig(mode="ram_async"), "mps", name="cond")
    assert store.mode is Mode.GPU
    stats = store.stats()
    assert stats["requested"] == "ram_async" and stats["tier"] == "gpu"
    assert "ram_async -> gpu: RAM modes disabled, unified memory" in stats["reason"]
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    store.close()


def test_file_tiers_stay_available_on_unified_memory():
    store = KVStore(OffloadConfig(mode="file_async"), "mps")
    assert store.mode is Mode.FILE_ASYNC and store.reason == "requested"
    store.close()


def test_auto_never_picks_ram_on_unified_memory():
    reason = unified_memory_reason(torch.device("cuda", 0), fake_cuda_properties(True))

    def plan(free_device, unified):
        return make_plan(Mode.AUTO, Figures(layers=32, layer_bytes=GiB // 8, slot_bytes=GiB // 8, slots=2,
                                            free_device=free_device, free_host=64 * GiB, unified=unified))
    tight = plan(1 * GiB, reason)
    assert tight.mode is Mode.FILE_ASYNC and "unified memory" in tight.reason
    assert FILE in tight.places and not set(HOST_PLACES) & set(tight.places)
    assert plan(1 * GiB, None).mode is Mode.RAM_ASYNC
    assert plan(40 * GiB, reason).mode is Mode.GPU
    assert resolve(Mode.RAM_SYNC, reason)[0] is Mode.GPU
    assert resolve(Mode.RAM_SYNC, None) == (Mode.RAM_SYNC, "requested")

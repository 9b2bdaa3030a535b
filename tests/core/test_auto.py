"""`auto` decides at the first put from the host's free-memory callables, and says why."""

import pytest
import torch

from offload_core import HostServices, KVStore, OffloadConfig
from offload_core.places import GiB
from offload_core.store.plan import ASSUMED_LAYERS, RESERVE_BYTES


def run_auto(host, expected_bytes=None):
    k = torch.ones(1, 2, 16, 8)
    store = KVStore(OffloadConfig(mode="auto"), "cpu", host=host, expected_bytes=expected_bytes)
    assert store.mode is None  # nothing decided, nothing allocated before the first put
    store.put(0, k, k)
    got = store.get(0)[0]
    stats = store.stats()
    store.close()
    assert torch.equal(got, k)
    return stats


def test_auto_keeps_the_cache_on_the_device_when_it_fits():
    stats = run_auto(HostServices(free_device_memory=lambda d: 64 * GiB, free_host_memory=lambda: 64 * GiB),
                     expected_bytes=2 * GiB)
    assert stats["requested"] == "auto" and stats["tier"] == "gpu"
    assert "fit in free device memory" in stats["reason"] and stats["plan"]["device"] == 1


def test_auto_goes_to_files_when_memory_is_short():
    stats = run_auto(HostServices(free_device_memory=lambda d: 1 * GiB, free_host_memory=lambda: 1 * GiB),
                     expected_bytes=2 * GiB)
    assert stats["tier"] == "file_async" and stats["reason"].startswith("auto:")


def test_auto_estimates_the_cache_from_the_first_layer_when_not_told():
    need = 8192 * ASSUMED_LAYERS  # one layer is 8 KiB once K and V are 4 KiB-aligned
    enough = need + need // 2 + RESERVE_BYTES
    fits = run_auto(HostServices(free_device_memory=lambda d: enough, free_host_memory=lambda: 0))
    short = run_auto(HostServices(free_device_memory=lambda d: enough - 1, free_host_memory=lambda: 0))
    assert fits["tier"] == "gpu" and short["tier"] == "file_async"


BAD_FIGURES = [float("nan"), float("inf"), -1, "8 GiB", True, [1]]


@pytest.mark.parametrize("value", BAD_FIGURES, ids=repr)
@pytest.mark.parametrize("field", ["free_device_memory", "free_host_memory"])
def test_a_bad_free_memory_figure_is_refused_at_the_first_put(field, value, monkeypatch):
    # A NaN compared False against every budget and planned every layer on the device; a string failed later.
    calls = {"device": lambda d: 64 * GiB, "host": lambda: 64 * GiB}
    calls["device" if field == "free_device_memory" else "host"] = (lambda d=None: value)
    host = HostServices(free_device_memory=calls["device"], free_host_memory=calls["host"])
    store = KVStore(OffloadConfig(mode="auto", storage="int8"), "cpu", host=host)
    encoded = []
    monkeypatch.setattr(store._codec, "encode", lambda x: encoded.append(x))  # the first allocation of a put
    with pytest.raises(ValueError, match=rf"HostServices: `{field}` returned .*must return a byte count >= 0.*"
                                         "Fix that callable"):
        store.put(0, torch.ones(1, 2, 16, 8), torch.ones(1, 2, 16, 8))
    assert encoded == [] and store.plan is None and store.stats()["layers"] == 0
    store.close()


@pytest.mark.parametrize("value, expected", [(None, None), (0, 0), (3.9, 3), (2 * GiB, 2 * GiB)])
def test_free_memory_figures_accept_byte_counts(value, expected):
    from offload_core.store.hostfacts import free_host_memory

    assert free_host_memory(HostServices(free_host_memory=lambda: value)) == expected


def test_a_temp_dir_that_is_no_directory_is_refused_before_the_file_place_opens(tmp_path):
    host = HostServices(free_device_memory=lambda d: 0, free_host_memory=lambda: 0,
                        temp_dir=lambda: str(tmp_path / "missing"))
    with KVStore(OffloadConfig(mode="auto"), "cpu", host=host) as store:
        with pytest.raises(ValueError, match=r"HostServices: `temp_dir` returned .*missing.*existing directory"):
            store.put(0, torch.ones(1, 2, 16, 8), torch.ones(1, 2, 16, 8))
    assert list(tmp_path.iterdir()) == []


def test_stats_name_the_mode_in_effect_and_keep_tier_as_its_alias():
    stats = run_auto(HostServices(free_device_memory=lambda d: 64 * GiB, free_host_memory=lambda: 64 * GiB),
                     expected_bytes=2 * GiB)
    assert stats["mode"] == "gpu"
    assert stats["tier"] == stats["mode"]  # deprecated alias, kept for one release

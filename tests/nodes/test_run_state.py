"""`RunState` on real engine stores: when a capture counts, how `auto` sizes cond and uncond, readout names."""

import logging

import pytest
import torch

from kv_offload_pack.nodes.families.flux import RefKVAttention
from kv_offload_pack.nodes.run.state import CACHED, CAPTURE as EXTRACT, RUN_KEY, RunState
from kv_offload_pack.offload_core import HostServices, KVStore, OffloadConfig
from kv_offload_pack.offload_core.places import GiB


# --- auto with CFG ------------------------------------------------------------------------------------------------

def test_auto_does_not_book_the_same_free_memory_for_cond_and_uncond(tmp_path):
    k = torch.zeros(1, 2, 1024, 64)
    n_layers = 4000
    per_branch = 2 * k.numel() * k.element_size() * n_layers
    free = int(1.6 * per_branch) + GiB  # room for one branch's cache, not for two
    host = HostServices(free_device_memory=lambda device: free, free_host_memory=lambda: 64 * GiB,
                        temp_dir=lambda: str(tmp_path))
    run = RunState(OffloadConfig(mode="auto"), host, n_layers=n_layers, store_factory=KVStore)
    run.begin_forward(["c", "u"], ref_tokens=1024, batch=2)
    qkv = torch.zeros(2, 2, 1024 + 8, 64)
    RefKVAttention()(qkv, qkv, qkv, extra_options={RUN_KEY: run, "block_type": "double", "block_index": 0,
                                                   "cond_or_uncond": [0, 1]})
    tiers = [b.store.mode.value for b in run.branches.values()]
    run.close()
    assert len(tiers) == 2 and tiers.count("gpu") < 2, tiers


# --- capture completeness -----------------------------------------------------------------------------------------

def test_a_capture_missing_a_layer_is_recaptured_not_served():
    run = RunState(OffloadConfig(mode="ram_sync"), HostServices(), n_layers=2, store_factory=KVStore)
    k = torch.randn(1, 2, 4, 8)
    assert run.begin_forward(["c"], ref_tokens=4, batch=1).phase == EXTRACT
    run.put("c", ("double", 0), k, k)  # the forward ends without layer ("double", 1)
    run.end_forward(ok=True)
    assert run.begin_forward(["c"], ref_tokens=4, batch=1).phase == EXTRACT
    run.put("c", ("double", 0), k, k)
    run.put("c", ("double", 1), k, k)
    run.end_forward(ok=True)
    assert run.begin_forward(["c"], ref_tokens=4, batch=1).phase == CACHED
    run.close()


# --- readout ------------------------------------------------------------------------------------------------------

def test_readout_names_are_unique_within_a_run():
    names = []
    hub = type("Hub", (), {"track": lambda self, name, store: names.append(name)})()
    run = RunState(OffloadConfig(mode="ram_sync"), HostServices(), n_layers=1, store_factory=KVStore, telemetry=hub)
    k = torch.randn(1, 2, 4, 8)
    run.begin_forward(["abcd-1", "abcd-2", "ffff-3"], ref_tokens=4, batch=3)
    run.put("abcd-1", 0, k, k, label="cond")
    run.put("abcd-2", 0, k, k, label="cond")
    run.put("ffff-3", 0, k, k, label="uncond")
    run.close()
    assert names == ["cond", "cond 2", "uncond"]


# --- cleanup ------------------------------------------------------------------------------------------------------

def test_an_interrupt_while_closing_one_store_still_closes_the_others(tmp_path):
    run = RunState(OffloadConfig(mode="ram_sync"), HostServices(), n_layers=1, store_factory=KVStore)
    k = torch.randn(1, 2, 4, 8)
    run.begin_forward(["c", "u"], ref_tokens=4, batch=2)
    run.put("c", 0, k, k)
    run.put("u", 0, k, k)
    first, second = (b.store for b in run.branches.values())

    def interrupted_close():
        KVStore.close(first)
        raise KeyboardInterrupt  # Ctrl-C pressed while the first branch closes

    first.close = interrupted_close
    with pytest.raises(KeyboardInterrupt):
        run.close()
    assert first.closed and second.closed and run.branches == {}


def _two_stores():
    run = RunState(OffloadConfig(mode="ram_sync"), HostServices(), n_layers=1, store_factory=KVStore)
    k = torch.randn(1, 2, 4, 8)
    run.begin_forward(["c", "u"], ref_tokens=4, batch=2)
    run.put("c", 0, k, k)
    run.put("u", 0, k, k)
    run.end_forward(ok=True)
    return run, [b.store for b in run.branches.values()]


def _failing_close(store, exc):
    def close():
        KVStore.close(store)
        raise exc

    store.close = close


def test_a_store_that_fails_to_close_on_a_stand_down_is_said_once_and_the_run_goes_on(caplog):
    run, (first, second) = _two_stores()
    _failing_close(first, RuntimeError("device lost"))
    with caplog.at_level(logging.WARNING, logger="kv_offload_pack.nodes.run.state"):
        run.stand_down("the disk filled up")  # returns: the run samples on without the cache
    assert first.closed and second.closed and run.branches == {}
    said = [r for r in caplog.records if "failed while the cache stood down" in r.getMessage()]
    assert len(said) == 1 and "RuntimeError: device lost" in said[0].getMessage()
    run.close()


def test_an_interrupt_while_standing_down_closes_the_other_stores_first():
    run, (first, second) = _two_stores()
    _failing_close(first, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        run.stand_down("the disk filled up")
    assert first.closed and second.closed


def test_a_run_directory_that_cannot_be_removed_is_said_once_at_warning(monkeypatch, caplog):
    from kv_offload_pack.nodes import once

    monkeypatch.setattr(once, "_SAID", set())

    class Stuck:  # the host's per-run directory (`nodes/run/host.py`'s RunDir): called for its path, cleaned up at the end
        def __call__(self):
            return "/nonexistent"

        def cleanup(self):
            raise PermissionError("busy")

    def one_run():
        run = RunState(OffloadConfig(mode="ram_sync"), HostServices(temp_dir=Stuck()), n_layers=1,
                       store_factory=KVStore)
        run.close()  # does not raise: the run is over, a folder left behind is said

    with caplog.at_level(logging.DEBUG, logger="kv_offload_pack.nodes.run.state"):
        one_run()
        one_run()
    said = [r for r in caplog.records if "could not remove the run's cache directory" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.WARNING, logging.DEBUG]
    assert "PermissionError: busy" in said[0].getMessage()

"""A store refuses misuse with a clear error instead of serving wrong data: two threads, in-place writes into
what `get` returned, bad host services and devices, and exceptions that belonged to a background job."""

import sys
import threading
from concurrent.futures import Future

import pytest
import torch

from offload_core import HostServices, KVStore, OffloadConfig
from offload_core.tiers import Pending
from offload_core.tiers.file import fileread as file_tier

from store_helpers import TIERS, config_for, make_layers, put_all, tiers


def run_in_thread(fn):
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            box["error"] = exc

    thread = threading.Thread(target=target, name="second-consumer")
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive()
    return box


@pytest.mark.parametrize("mode", TIERS)
def test_a_second_thread_gets_a_clear_error_never_another_layers_data(mode, tmp_path):
    layers = make_layers(range(4), torch.float32, seed=20)
    with KVStore(config_for(mode, tmp_path), "cpu", name="cond") as store:
        put_all(store, layers)
        assert torch.equal(store.get(0)[0], layers[0][0])
        for call in (lambda: store.get(1), lambda: store.put(9, *layers[0])):
            box = run_in_thread(call)
            assert isinstance(box.get("error"), RuntimeError) and "value" not in box
            assert "serves one consumer" in str(box["error"]) and "second-consumer" in str(box["error"])
        for key in (1, 2, 3, 0):  # the consumer's own gets are unaffected
            assert torch.equal(store.get(key)[1], layers[key][1])
        assert "error" not in run_in_thread(store.stats)


def test_close_from_another_thread_ends_the_store_for_its_consumer(tmp_path):
    layers = make_layers(range(3), torch.float32, seed=21)
    store = KVStore(config_for("ram_async", tmp_path), "cpu")
    put_all(store, layers)
    store.get(0)
    assert "error" not in run_in_thread(store.close)
    with pytest.raises(RuntimeError, match="closed"):
        store.get(1)
    assert store._res.allocator.pageable_bytes == 0


def test_close_from_another_thread_waits_for_the_get_in_progress():
    layers = make_layers(range(3), torch.float32, seed=26)
    store = KVStore(OffloadConfig(mode="ram_sync"), "cpu")
    put_all(store, layers)
    inside, go_on = threading.Event(), threading.Event()
    tier = tiers(store)["host_pageable"]  # ram_sync keeps every layer in pageable RAM
    load = tier.load

    def slow_load(*args):  # the consumer is in the middle of a get
        inside.set()
        assert go_on.wait(60)
        return load(*args)

    tier.load = slow_load
    closer = threading.Thread(target=store.close, name="closer")

    def close_meanwhile():
        assert inside.wait(60)
        closer.start()
        closer.join(timeout=0.5)  # long enough for an unguarded close to free what the get is about to read
        go_on.set()

    helper = threading.Thread(target=close_meanwhile)
    helper.start()
    k, v = store.get(1)  # served whole: close waits for it
    assert torch.equal(k, layers[1][0]) and torch.equal(v, layers[1][1])
    helper.join(timeout=60)
    closer.join(timeout=60)
    assert store.closed and store._res.allocator.pageable_bytes == 0


@pytest.mark.parametrize("mode", TIERS)
def test_stats_from_a_monitoring_thread_during_puts_and_gets(mode, tmp_path):
    layers = make_layers(range(60), torch.float16, seed=22, shape=(1, 1, 4, 8))
    errors, done = [], threading.Event()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can: races show up at once

    def monitor():
        while not done.is_set():
            try:
                store.stats()
            except Exception as exc:  # noqa: BLE001 - the assertion below reports it
                errors.append(exc)
                return

    store = KVStore(config_for(mode, tmp_path), "cpu")
    thread = threading.Thread(target=monitor)
    thread.start()
    try:
        put_all(store, layers)
        for _ in range(2):
            for key in layers:
                assert torch.equal(store.get(key)[0], layers[key][0])
        store.close()
    finally:
        done.set()
        sys.setswitchinterval(interval)
        thread.join(timeout=60)
    assert errors == []


@pytest.mark.parametrize("next_key", [0, 1])
@pytest.mark.parametrize("mode", TIERS)
def test_an_in_place_write_into_a_get_is_refused_the_same_way_on_every_tier(mode, next_key, tmp_path):
    layers = make_layers(range(3), torch.float32, seed=23)
    with KVStore(config_for(mode, tmp_path), "cpu") as store:
        put_all(store, layers)
        k, v = store.get(0)
        k.add_(1.0)  # a consumer that writes into what the store returned
        with pytest.raises(RuntimeError, match="layer 0 .* modified in place"):
            store.get(next_key)  # the next get refuses, whichever layer it asks for
        for key in layers:  # afterwards never the written bytes: the store is broken until closed
            with pytest.raises(RuntimeError, match="is broken: an earlier get"):
                store.get(key)


def test_gpu_tier_refuses_a_layer_written_after_a_later_get():
    layers = make_layers(range(3), torch.float32, seed=24)
    with KVStore(OffloadConfig(mode="gpu"), "cpu") as store:
        put_all(store, layers)
        _, v0 = store.get(0)
        store.get(1)
        v0.zero_()  # too late for the next get to notice, but the layer itself remembers
        store.get(2)
        with pytest.raises(RuntimeError, match="layer 0 .* modified in place"):
            store.get(0)


@pytest.mark.parametrize("field", ["free_device_memory", "free_host_memory", "stream", "temp_dir", "pause_graph"])
@pytest.mark.parametrize("value", [5, "/tmp"])
def test_host_services_must_be_callables(field, value):
    with pytest.raises(ValueError, match=f"`{field}` must be a callable or None; got {value!r}"):
        HostServices(**{field: value})


def test_host_services_pin_pair_must_be_callables():
    with pytest.raises(ValueError, match="`pin` must be a callable"):
        HostServices(pin=True, unpin=lambda t: None)


@pytest.mark.parametrize("device", ["meta", torch.device("meta"), "ipu"])
def test_devices_the_store_cannot_serve_are_refused(device):
    with pytest.raises(ValueError, match="must be a cpu, cuda, xpu or mps device"):
        KVStore(OffloadConfig(mode="gpu"), device)


@pytest.mark.parametrize("kind", ["cuda", "xpu"])
def test_a_stream_device_is_accepted_where_torch_has_it(kind, monkeypatch):
    from offload_core.store.checks import check_device

    backend = getattr(torch, kind)
    if not backend.is_available():
        with pytest.raises(ValueError, match=f"{kind.upper()} is not available in this torch"):
            KVStore(OffloadConfig(mode="gpu"), kind)
        monkeypatch.setattr(backend, "is_available", lambda: True)
        monkeypatch.setattr(backend, "current_device", lambda: 0)
    assert check_device(kind).type == kind and check_device(kind).index is not None


def test_settle_drops_an_interrupt_that_belonged_to_the_background_job():
    future = Future()
    future.set_exception(KeyboardInterrupt())
    try:
        Pending(future=future).settle()
        Pending(future=future).cancel()
    except KeyboardInterrupt:
        pytest.fail("settle()/cancel() re-raised the KeyboardInterrupt of a background job")
    with pytest.raises(KeyboardInterrupt):  # a get still reports it: the consumer asked for that layer
        Pending(future=future).wait(None)


def test_close_never_raises_a_background_jobs_interrupt(tmp_path, monkeypatch):
    layers = make_layers(range(4), torch.float32, seed=25)
    real = file_tier.open_checked

    def read(path, *args):
        if path.endswith("layer-00002.safetensors"):
            raise KeyboardInterrupt  # e.g. a Ctrl-C delivered to the I/O thread
        return real(path, *args)

    monkeypatch.setattr(file_tier, "open_checked", read)
    store = KVStore(config_for("file_async", tmp_path), "cpu")
    put_all(store, layers)
    store.get(0)
    store.get(1)  # prefetches layer 2, whose read is interrupted in the background
    store._res.ring.holding(2).pending._future.exception(timeout=60)
    try:
        store.close()
    except KeyboardInterrupt:
        pytest.fail("close() re-raised the KeyboardInterrupt of the I/O thread")
    assert store.closed and list(tmp_path.iterdir()) == []


def test_a_session_closes_every_branch_even_when_one_close_is_interrupted():
    pytest.importorskip("diffusers", reason="the diffusers adapter needs diffusers")
    from offload_core.diffusers.session import OffloadSession

    session = OffloadSession(pipe=None, config=OffloadConfig(mode="ram_sync"), host=None)
    cond, uncond = (session.open_store(torch.device("cpu"), None) for _ in range(2))
    for store in (cond, uncond):
        store.put(0, *make_layers([0], torch.float32)[0])

    def interrupted_close():
        KVStore.close(cond)
        raise KeyboardInterrupt  # e.g. Ctrl-C pressed while the first branch closes

    cond.close = interrupted_close
    with pytest.raises(KeyboardInterrupt):
        session.end_request(raise_errors=False)
    assert cond.closed and uncond.closed and session.live_stores == []


@pytest.mark.parametrize("context", ["plain", "no_grad", "inference_mode"])
def test_engine_calls_run_outside_inference_mode_and_autograd_whatever_the_caller_is_in(context):
    # Buffers the engine makes must be ordinary tensors (its I/O threads write them in place) and no graph may be
    # recorded; the caller's own modes are back as they were afterwards.
    import contextlib

    from offload_core.store.checks import engine_mode

    @engine_mode
    def inside():
        return torch.is_inference_mode_enabled(), torch.is_grad_enabled(), torch.empty(1).is_inference()

    enter = {"plain": contextlib.nullcontext, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}
    with enter[context]():
        before = (torch.is_inference_mode_enabled(), torch.is_grad_enabled())
        assert inside() == (False, False, False)
        assert (torch.is_inference_mode_enabled(), torch.is_grad_enabled()) == before


@pytest.mark.parametrize("mode", ["ram_sync", "file_sync"])
def test_pickling_or_copying_an_open_store_is_refused_naming_it(mode, tmp_path):
    """Spawning a process with an open store was refused by "cannot pickle '_thread.lock' object", naming no
    store."""
    import copy
    import pickle

    with KVStore(config_for(mode, tmp_path), torch.device("cpu"), name="cond") as store:
        for attempt in (pickle.dumps, copy.deepcopy, copy.copy):
            with pytest.raises(TypeError, match="KVStore 'cond' cannot be pickled or copied"):
                attempt(store)

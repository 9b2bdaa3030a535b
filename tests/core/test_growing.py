"""The growing-layer contract, once for every tier: blocks appended once, the prefix read back bit for bit.

A consumer like an autoregressive video model: per block several forwards read the committed prefix and write the
current block after it in the working pair; the last forward commits the block. Odd token counts and batch rows
exercise the strided copies; the file tiers append each block once, checksummed.
"""

import contextlib
import os

import pytest
import torch

from offload_core import GrowingKVStore, GrowingShape, HostServices, OffloadConfig
from offload_core.tiers import KVFileError

LAYERS = 4
BLOCKS = [5, 3, 7, 1, 9]  # odd token counts: 25 tokens in all
CAPACITY = sum(BLOCKS) + 2  # room left over, as a cache sized for the whole video before it is written


def shape_of(dtype=torch.bfloat16, batch=2):
    return GrowingShape(batch=batch, capacity=CAPACITY, heads=3, head_dim=8, dtype=dtype)


def layer_bytes(shape):
    return shape.bytes(shape.capacity)


def config_of(name, tmp_path, shape):
    plans = {  # mixed placements, with budgets in whole layers of this shape
        "device+ram": {"mode": "ram_async", "device_budget": 2 * layer_bytes(shape)},
        "device+file": {"mode": "file_async", "device_budget": 2 * layer_bytes(shape)},
        "ram+file": {"mode": "ram_sync", "host_budget": shape.bytes(sum(BLOCKS)) * 2},
    }
    fields = dict(plans.get(name, {"mode": name}))
    if "file" in fields["mode"] or "host_budget" in fields:
        fields["file_dir"] = str(tmp_path)
    return OffloadConfig(**fields)


MODES = ["gpu", "ram_sync", "ram_async", "file_sync", "file_async", "auto", "device+ram", "device+file", "ram+file"]


def reference(shape, seed=0):
    """Per layer the K/V the consumer writes: what the store must give back, token for token."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape.pair, generator=g).to(shape.dtype), torch.randn(shape.pair, generator=g).to(shape.dtype))
            for _ in range(LAYERS)]


def run_video(store, ref, blocks=BLOCKS, steps=3, check=True):
    """Each block: `steps` forwards over every layer (the last commits); every view's prefix checked."""
    at = 0
    for n in blocks:
        for step in range(steps):
            for layer in range(LAYERS):
                k, v = store.view(layer)
                if check:
                    assert torch.equal(k[:, :at], ref[layer][0][:, :at]) and torch.equal(v[:, :at], ref[layer][1][:, :at])
                k[:, at:at + n] = ref[layer][0][:, at:at + n] * (1 if step == steps - 1 else -1)  # last step: final
                v[:, at:at + n] = ref[layer][1][:, at:at + n] * (1 if step == steps - 1 else -1)
                if step == steps - 1:
                    store.commit(layer, at, at + n)
            store.step()
        at += n
    return at


def files_in(path):
    return [f for _, _, fs in os.walk(path) for f in fs]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("mode", MODES)
def test_every_tier_gives_back_the_committed_prefix_bit_for_bit(mode, batch, dtype, tmp_path):
    shape = shape_of(dtype, batch)
    ref = reference(shape)
    host = HostServices(temp_dir=lambda: str(tmp_path))
    with GrowingKVStore(config_of(mode, tmp_path, shape), "cpu", shape=shape, layers=LAYERS, host=host) as store:
        tokens = run_video(store, ref)
        for layer in range(LAYERS):  # the whole video, read back once more
            k, v = store.view(layer)
            assert torch.equal(k[:, :tokens], ref[layer][0][:, :tokens])
            assert torch.equal(v[:, :tokens], ref[layer][1][:, :tokens])
            assert store.committed(layer) == tokens
        store.flush()
        stats = store.stats()
        grow = stats["growing"]
        assert grow["appended"] == {"count": LAYERS * len(BLOCKS), "bytes": shape.bytes(tokens) * LAYERS}
        assert grow["tokens"] == tokens and grow["committed_bytes"] == shape.bytes(tokens) * LAYERS
        streamed = LAYERS - stats["plan"]["device"]
        assert stats["peak_device_bytes"] <= layer_bytes(shape) * (stats["plan"]["device"] + min(streamed, store.depth + 1))
        if mode.startswith("file"):
            assert stats["bytes"]["file"] >= shape.bytes(tokens) * LAYERS  # every block on disk (4 KiB-aligned)
    assert files_in(tmp_path) == []


def test_a_block_goes_to_its_file_once_and_the_file_holds_the_cache_exactly(tmp_path):
    # 1 row, 2 heads of 64 fp16 = 256 bytes a token; blocks of 16 tokens are 4 KiB: no alignment padding, so the
    # bytes on disk are the cache's bytes, each block written once however many forwards read it
    shape = GrowingShape(batch=1, capacity=64, heads=2, head_dim=64, dtype=torch.float16)
    ref = [(torch.randn(shape.pair).half(), torch.randn(shape.pair).half()) for _ in range(LAYERS)]
    with GrowingKVStore(OffloadConfig(mode="file_async", file_dir=str(tmp_path)), "cpu", shape=shape,
                        layers=LAYERS) as store:
        writes = []
        real = store._res.tier("file")._grow._write.submit
        store._res.tier("file")._grow._write.submit = lambda fn, what, **kw: writes.append(what) or real(fn, what, **kw)
        tokens = run_video(store, ref, blocks=[16, 16, 16, 16], steps=4)
        store.flush()
        assert len(writes) == 4 * LAYERS
        assert store.stats()["bytes"]["file"] == shape.bytes(tokens) * LAYERS == store.stats()["growing"]["appended"]["bytes"]


def test_ram_layers_move_to_files_when_the_host_budget_is_reached(tmp_path):
    shape = shape_of()
    budget = shape.bytes(sum(BLOCKS)) * 2 + shape.bytes(5)  # two whole layers and a block
    ref = reference(shape)
    with GrowingKVStore(OffloadConfig(mode="ram_sync", host_budget=budget, file_dir=str(tmp_path)), "cpu",
                        shape=shape, layers=LAYERS) as store:
        run_video(store, ref)
        stats = store.stats()
        assert stats["plan"]["file"] == 2 and stats["plan"]["host_pageable"] == 2
        assert len(stats["growing"]["moves"]) == 2 and "host_budget" in stats["growing"]["moves"][0]
        assert "in files" in stats["reason"]
    assert files_in(tmp_path) == []


def test_streamed_device_memory_is_the_slots_whatever_the_video_length(tmp_path):
    shape = shape_of(batch=1)
    with GrowingKVStore(OffloadConfig(mode="ram_async"), "cpu", shape=shape, layers=LAYERS) as store:
        run_video(store, reference(shape), check=False)
        stats = store.stats()
        assert stats["peak_device_bytes"] == 2 * layer_bytes(shape)  # prefetch depth 1: two slots, no resident layer
        assert stats["growing"]["step_bytes"] > 0 and stats["exposed_wait_s"] >= 0


def test_a_block_changed_on_disk_is_an_error_not_wrong_kv(tmp_path):
    shape = shape_of(batch=1)
    with GrowingKVStore(OffloadConfig(mode="file_sync", file_dir=str(tmp_path)), "cpu", shape=shape,
                        layers=LAYERS) as store:
        run_video(store, reference(shape), blocks=BLOCKS[:2])
        store.flush()
        path = next(os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs if f.startswith("grow-"))
        with open(path, "r+b") as f:
            f.seek(10)
            f.write(b"\x7f")
        with pytest.raises(KVFileError, match="checksum"):
            for layer in range(LAYERS):
                store.view(layer)


def test_commits_must_continue_the_layer(tmp_path):
    shape = shape_of()
    with GrowingKVStore(OffloadConfig(mode="ram_sync"), "cpu", shape=shape, layers=LAYERS) as store:
        store.view(0)
        with pytest.raises(ValueError, match="do not continue"):
            store.commit(0, 3, 5)
        store.commit(0, 0, 4)
        store.view(1)
        with pytest.raises(RuntimeError, match="not the layer last viewed"):
            store.commit(0, 4, 6)
        with pytest.raises(ValueError, match="capacity|do not continue"):
            store.commit(1, 0, CAPACITY + 1)


@pytest.mark.parametrize("storage, bound", [("int8", 0.02), ("fp8", 0.06)])
@pytest.mark.parametrize("mode", ["ram_async", "file_sync", "device+ram"])
def test_compact_storage_packs_streamed_blocks_and_reports_the_error(mode, storage, bound, tmp_path):
    shape = shape_of(torch.float32, batch=2)
    ref = reference(shape)
    fields = {"ram_async": {"mode": "ram_async"}, "file_sync": {"mode": "file_sync", "file_dir": str(tmp_path)},
              "device+ram": {"mode": "ram_async", "device_budget": 2 * layer_bytes(shape)}}[mode]
    with GrowingKVStore(OffloadConfig(**fields, storage=storage), "cpu", shape=shape, layers=LAYERS) as store:
        tokens = run_video(store, ref, check=False)
        for layer in range(LAYERS):
            k, v = store.view(layer)
            got, want = torch.cat([k[:, :tokens], v[:, :tokens]]), torch.cat([ref[layer][0], ref[layer][1]])[:, :tokens]
            err = ((got - want).norm() / want.norm()).item()
            # resident layers are the working pairs (exact); a slot still holding its layer since the last commit
            # has the values written, not unpacked ones
            assert err == 0 if layer in store._resident else err < bound
        stats = store.stats()
        assert 0 < stats["kv_error"]["relative"] < bound
        packed = 2 * 2 * tokens * 3 * (8 + 4)  # per streamed layer: K and V, 2 rows, 3 heads of 8 bytes + a scale
        held = sum(stats["bytes"][p] for p in ("host_pinned", "host_pageable", "file"))
        assert held >= packed * (LAYERS - stats["plan"]["device"])
    assert files_in(tmp_path) == []


def test_a_block_the_codec_cannot_hold_is_an_error(tmp_path):
    shape = shape_of(torch.float32)
    with GrowingKVStore(OffloadConfig(mode="ram_sync", storage="int8"), "cpu", shape=shape, layers=LAYERS) as store:
        k, v = store.view(0)
        k[:, :2] = float("nan")
        v[:, :2] = 1
        with pytest.raises(ValueError, match="cannot hold"):
            store.commit(0, 0, 2)


@pytest.mark.parametrize("mode", ["ram_async", "file_async", "gpu"])
def test_every_view_and_commit_runs_inside_the_hosts_pause(mode, tmp_path):
    depth = []

    @contextlib.contextmanager
    def pause():
        depth.append(1)
        try:
            yield
        finally:
            depth.pop()

    seen = []
    real_empty = torch.empty

    def empty(*args, **kwargs):
        seen.append(bool(depth))
        return real_empty(*args, **kwargs)

    shape = shape_of(batch=1)
    host = HostServices(pause_graph=pause, temp_dir=lambda: str(tmp_path))
    with GrowingKVStore(OffloadConfig(mode=mode), "cpu", shape=shape, layers=LAYERS, host=host) as store:
        torch.empty = empty
        try:
            run_video(store, reference(shape), check=False)
        finally:
            torch.empty = real_empty
    assert seen and all(seen)


def test_closing_after_an_interrupt_leaves_no_file(tmp_path):
    shape = shape_of()
    store = GrowingKVStore(OffloadConfig(mode="file_async", file_dir=str(tmp_path)), "cpu", shape=shape, layers=LAYERS)
    with pytest.raises(KeyboardInterrupt):
        at = 0
        for n in BLOCKS:
            for layer in range(LAYERS):
                k, v = store.view(layer)
                k[:, at:at + n] = 1
                v[:, at:at + n] = 2
                store.commit(layer, at, at + n)
                if at and layer == 2:
                    raise KeyboardInterrupt
            at += n
    store.close()
    store.close()
    assert files_in(tmp_path) == [] and store.stats()["device_bytes"] == 0


def test_close_wakes_a_prefix_read_waiting_on_appends_it_cancels(tmp_path, monkeypatch, caplog, wait_until):
    # A prefix read waits on the read lane for its layer's appends. Close cancels the appends still queued on the
    # write lane; the read must see that at once, not wait out its bound and leave close reporting stuck I/O.
    import concurrent.futures
    import sys
    import threading

    from offload_core.host.devices import DONE
    from offload_core.tiers.file import iopool

    monkeypatch.setattr(iopool, "IO_TIMEOUT_S", 30.0)
    shape = shape_of()
    store = GrowingKVStore(OffloadConfig(mode="file_async", file_dir=str(tmp_path)), "cpu", shape=shape, layers=LAYERS)
    at = run_video(store, reference(shape), blocks=BLOCKS[:2])
    tier = store._res.tier("file")
    gate = threading.Event()
    tier._lanes["write"].submit(lambda: gate.wait(60), "a held write lane")
    store.view(0)
    store.commit(0, at, at + 1)  # its append queues behind the held lane
    appended = tier._grow._queued[-1]
    prefix = [torch.empty(shape.pair, dtype=shape.dtype)[:, :at + 1] for _ in range(2)]  # its blocks, whole
    pending = tier.load_prefix(0, *prefix, DONE)

    def read_waits() -> bool:
        for thread in threading.enumerate():
            frame = sys._current_frames().get(thread.ident) if thread.name.startswith("kv_offload_read") else None
            while frame is not None and frame.f_code.co_name != "wait_all":
                frame = frame.f_back
            if frame is not None:
                return True
        return False

    wait_until(read_waits)
    opener = threading.Thread(target=lambda: (wait_until(appended.cancelled, 60), gate.set()))
    opener.start()
    with caplog.at_level("WARNING"):
        store.close()
    opener.join(60)
    assert appended.cancelled() and "stuck" not in caplog.text and files_in(tmp_path) == []
    with pytest.raises(KVFileError, match="never written whole") as failed:
        pending.wait(None)
    assert isinstance(failed.value.__cause__, concurrent.futures.CancelledError)  # not its bound running out

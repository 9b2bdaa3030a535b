"""The prefix registry: content keys, full comparison on a hit, budgets, LRU eviction, nothing left behind."""

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from offload_core import KVStore, OffloadConfig
from offload_core.reuse import prefix, budget as reusebudget
from offload_core.reuse.registry import PrefixRegistry
from offload_core.reuse.budget import parse_budget
from filestores import file_tier
from registry_stores import LAYERS, TIERS, files, filled_store, key


@pytest.mark.parametrize("mode", TIERS)
def test_a_hit_serves_the_kept_store_bit_identically(mode, tmp_path):
    registry = PrefixRegistry({"device": 1 << 30, "host": 1 << 30, "file": 1 << 30})
    store, layers = filled_store(mode, tmp_path)
    ref = torch.randn(1, 5, 4)
    assert registry.lookup(key(ref)) is None
    assert registry.admit(key(ref), store, "cond")
    assert store.sealed and not store.closed
    if mode != "gpu":
        assert store.stats()["device_bytes"] == 0  # parked: the ring of device slots is gone
    with pytest.raises(RuntimeError, match="sealed"):
        store.put(LAYERS, *layers[0])
    entry = registry.lookup(key(ref.clone()))
    assert entry is not None and entry.store is store
    for _ in range(2):
        for i in range(LAYERS):
            k, v = store.get(i)
            assert torch.equal(k, layers[i][0]) and torch.equal(v, layers[i][1])
    registry.release(entry)
    stats = registry.stats()
    assert (stats["hits"], stats["misses"], stats["entries"]) == (1, 1, 1)
    registry.close()
    assert store.closed and files(tmp_path) == []


def test_every_key_component_is_compared(tmp_path):
    registry = PrefixRegistry({"host": 1 << 30})
    ref, txt = torch.randn(1, 5, 4), torch.randn(1, 3, 4)
    registry.admit(key(ref, txt), filled_store("ram_sync", tmp_path)[0])
    changed = ref.clone()
    changed[0, 4, 3] += 1e-3
    misses = [key(changed, txt), key(ref, txt, header=("model", 2)), key(ref), key(ref.double(), txt),
              key(ref[:, :4], txt), key(ref, txt.to(torch.bfloat16))]
    assert all(registry.lookup(k) is None for k in misses)
    assert registry.lookup(key(ref.clone(), txt.clone())) is not None


def test_a_digest_collision_is_still_a_miss(tmp_path, monkeypatch):
    """Keys are compared in full on a hit: equal digests with different content never share an entry."""
    monkeypatch.setattr(prefix, "_digest", lambda t: torch.zeros(3))
    registry = PrefixRegistry({"host": 1 << 30})
    a, b = torch.zeros(1, 4), torch.ones(1, 4)
    assert key(a).digest == key(b).digest
    registry.admit(key(a), filled_store("ram_sync", tmp_path)[0])
    assert registry.lookup(key(b)) is None
    assert registry.lookup(key(a)) is not None


def test_budget_evicts_least_recently_used_and_deletes_its_files(tmp_path):
    one, _ = filled_store("file_sync", tmp_path, seed=0)
    size = reusebudget.store_places(one.stats())["file"]
    registry = PrefixRegistry({"file": 2 * size, "host": 1 << 30})
    a, b, c = (torch.full((1, 2), float(i)) for i in range(3))
    registry.admit(key(a), one)
    registry.admit(key(b), filled_store("file_sync", tmp_path, seed=1)[0])
    registry.release(registry.lookup(key(a)))  # a is now the most recently used
    registry.admit(key(c), filled_store("file_sync", tmp_path, seed=2)[0])
    stats = registry.stats()
    assert stats["entries"] == 2 and stats["evictions"] == 1 and stats["bytes"]["file"] == 2 * size
    assert registry.lookup(key(b)) is None and registry.lookup(key(a)) is not None
    layer_files = [f for f in files(tmp_path) if f.endswith(".safetensors")]  # each live store also holds its lock
    assert len(layer_files) == 2 * LAYERS  # the evicted store's files are gone
    registry.close()
    assert files(tmp_path) == []


def test_an_entry_larger_than_the_budget_is_closed_not_kept(tmp_path):
    registry = PrefixRegistry({"host": 10})
    store, _ = filled_store("ram_sync", tmp_path)
    assert not registry.admit(key(torch.zeros(1)), store)
    assert store.closed and registry.stats()["rejected"] == 1
    assert "budget" in registry.stats()["last_rejection"]


def test_by_default_nothing_is_kept_on_the_device(tmp_path, monkeypatch):
    registry = PrefixRegistry()
    store, _ = filled_store("gpu", tmp_path)
    # Without CUDA the gpu tier's "device" is host RAM; report it as an accelerator's to check the device rule.
    stats = store.stats()
    monkeypatch.setattr(store, "stats", lambda: {**stats, "device": "cuda:0"})
    assert not registry.admit(key(torch.zeros(1)), store) and store.closed
    assert "budget there is 0.0 MiB" in registry.stats()["last_rejection"]
    on_cpu, _ = filled_store("gpu", tmp_path)  # a CPU's device memory is host RAM: kept within the host budget
    assert registry.admit(key(torch.ones(1)), on_cpu) and registry.stats()["bytes"]["device"] == 0
    kept, _ = filled_store("ram_sync", tmp_path)
    assert registry.admit(key(torch.full((1,), 2.0)), kept)  # host: a quarter of the free RAM


def test_a_leased_entry_is_not_served_twice_and_a_failed_reader_evicts_it(tmp_path):
    registry = PrefixRegistry({"host": 1 << 30})
    store, _ = filled_store("ram_sync", tmp_path)
    registry.admit(key(torch.zeros(1)), store)
    entry = registry.lookup(key(torch.zeros(1)))
    assert registry.lookup(key(torch.zeros(1))) is None and registry.stats()["busy"] == 1
    registry.release(entry, ok=False)
    assert store.closed and len(registry) == 0


def test_the_same_prefix_is_kept_once(tmp_path):
    registry = PrefixRegistry({"host": 1 << 30})
    first, _ = filled_store("ram_sync", tmp_path)
    second, _ = filled_store("ram_sync", tmp_path)
    assert registry.admit(key(torch.zeros(1)), first)
    assert not registry.admit(key(torch.zeros(1)), second) and second.closed and not first.closed


def test_dropping_the_registry_closes_its_stores(tmp_path):
    registry = PrefixRegistry({"file": 1 << 30, "host": 1 << 30})
    registry.admit(key(torch.zeros(1)), filled_store("file_sync", tmp_path)[0])
    assert files(tmp_path)
    del registry
    import gc

    gc.collect()
    assert files(tmp_path) == []


def test_process_exit_leaves_no_files(tmp_path):
    script = textwrap.dedent(f"""
        import torch
        from offload_core import KVStore, OffloadConfig
        from offload_core.reuse.prefix import PrefixKey
        from offload_core.reuse.registry import PrefixRegistry
        registry = PrefixRegistry({{"file": 1 << 30, "host": 1 << 30}})
        store = KVStore(OffloadConfig(mode="file_sync", file_dir={str(tmp_path)!r}), "cpu")
        store.put(0, torch.ones(1, 4, 2, 8), torch.ones(1, 4, 2, 8))
        assert registry.admit(PrefixKey.build(("m",), [torch.zeros(1)]), store)
        import os; print(len(os.listdir({str(tmp_path)!r})))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1" and files(tmp_path) == []


def test_budget_errors_name_the_option_and_the_fix():
    with pytest.raises(ValueError, match=r"`reuse_budget` has an unknown place 'vram'"):
        parse_budget({"vram": 1})
    with pytest.raises(ValueError, match=r"`reuse_budget\['host'\]` must be a byte count >= 0"):
        parse_budget({"host": -1})
    with pytest.raises(ValueError, match=r"`reuse_budget` must be a byte count >= 0 \(for every place\) or None; got -5"):
        parse_budget(-5)
    with pytest.raises(ValueError, match="must be None, a byte count or a dict"):
        parse_budget("8G")
    assert parse_budget(5) == {"device": 5, "host": 5, "file": 5}


def test_an_entry_evicted_while_read_is_closed_only_when_its_reader_is_done(tmp_path):
    registry = PrefixRegistry({"host": 1 << 30})
    store, layers = filled_store("ram_sync", tmp_path)
    registry.admit(key(torch.zeros(1)), store)
    entry = registry.lookup(key(torch.zeros(1)))
    assert registry.clear("the model was unloaded") == 1
    assert not store.closed and registry.lookup(key(torch.zeros(1))) is None  # gone for new requests...
    assert torch.equal(store.get(0)[0], layers[0][0])  # ...still readable by the request that holds it
    registry.release(entry)
    assert store.closed and len(registry) == 0


def test_an_admission_that_cannot_succeed_evicts_nothing(tmp_path):
    small, _ = filled_store("ram_sync", tmp_path, seed=0)
    big, _ = filled_store("ram_sync", tmp_path, seed=1, tokens=300)
    for store in (small, big):
        store.park()  # as admitted: without the ring's slots, which count as host RAM on a CPU
    sizes = [reusebudget.store_places(s.stats())["host"] for s in (small, big)]
    registry = PrefixRegistry({"host": sum(sizes)})
    assert registry.admit(key(torch.zeros(1)), small) and registry.admit(key(torch.ones(1)), big)
    reading = registry.lookup(key(torch.ones(1)))  # the big entry is in use: evicting the small one frees too little
    other, _ = filled_store("ram_sync", tmp_path, seed=2, tokens=300)
    assert not registry.admit(key(torch.full((1,), 2.0)), other) and other.closed
    stats = registry.stats()
    assert (stats["entries"], stats["evictions"], stats["rejected"]) == (2, 0, 1) and not small.closed
    assert "in use" in stats["last_rejection"] and stats["bytes"]["host"] == sum(sizes)
    registry.release(reading)
    assert registry.lookup(key(torch.zeros(1))) is not None  # still served
    registry.close()


def test_parked_file_store_served_request_after_request_holds_no_more_host_slots(tmp_path):
    # On a CPU the file tier makes the ring's page-aligned slots and keeps them until close (a stuck read may
    # still fill one); a park that dropped them and made new ones per request would grow host RAM per hit.
    store, layers = filled_store("file_async", tmp_path)
    slots = file_tier(store)._host_slots
    made = len(slots)
    for _ in range(3):  # three later requests served from the parked store
        store.park()
        for i in range(LAYERS):
            k, v = store.get(i)
            assert torch.equal(k, layers[i][0]) and torch.equal(v, layers[i][1])
    assert 0 < made == len(slots) <= store.depth + 1
    store.close()


@pytest.mark.parametrize("mode", ["file_sync", "file_async"])
def test_admission_waits_for_the_file_writes_and_counts_what_is_on_disk(mode, tmp_path):
    # The file modes write in the background: an admitted store's files are whole, its entry counts their
    # bytes, and the write staging (host RAM held for the puts) is not charged to the entry because it is gone.
    store = KVStore(OffloadConfig(mode=mode, file_dir=str(tmp_path)), "cpu")
    layer = [(torch.full((1, 16, 2, 8), float(i)), torch.zeros(1, 16, 2, 8)) for i in range(LAYERS)]
    store.put(0, *layer[0])
    store.flush()
    first = store.stats()["bytes"]["file"]
    tier, gate = file_tier(store), threading.Event()
    hold = tier._lanes["write"].submit(lambda: gate.wait(10), "a held write lane")  # no later layer finishes yet
    for i in range(1, LAYERS):
        store.put(i, *layer[i])
    assert store.stats()["bytes"]["file"] == first > 0  # a layer is counted only once it is on disk
    registry = PrefixRegistry({"device": 1 << 30, "host": 1 << 30, "file": 1 << 30})
    gate.set()
    assert registry.admit(key(torch.ones(3)), store, "cond")
    assert hold.done()
    directory = store.stats()["file_dir"]
    on_disk = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory) if f.endswith(".safetensors"))
    (entry,) = registry.stats()["held"]
    assert on_disk > 0 and entry["bytes"]["file"] == on_disk and entry["bytes"]["host"] == 0
    assert tier._writer.staging.buffers() == []
    registry.close()


def test_a_store_whose_file_write_failed_is_not_kept(tmp_path, failing_writes, caplog):
    # The last layer fails, so no later put can see it first: the background write's error surfaces at admit.
    store = KVStore(OffloadConfig(mode="file_sync", file_dir=str(tmp_path)), "cpu")
    heal = failing_writes(f"layer-{LAYERS - 1:05d}")
    for i in range(LAYERS):
        store.put(i, torch.full((1, 16, 2, 8), float(i)), torch.zeros(1, 16, 2, 8))
    registry = PrefixRegistry({"device": 1 << 30, "host": 1 << 30, "file": 1 << 30})
    with caplog.at_level("WARNING", logger="offload_core.reuse.registry"):
        assert not registry.admit(key(torch.ones(3)), store, "cond")
    heal()
    stats = registry.stats()
    assert stats["entries"] == 0 and stats["rejected"] == 1
    assert "could not be written" in stats["last_rejection"] and "EIO" in stats["last_rejection"]
    assert "not kept" in caplog.text
    assert store.closed and files(tmp_path) == []
    registry.close()

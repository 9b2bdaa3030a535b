"""Identical batch rows: kept, moved and written once in every tier, served bit-identical as the whole batch."""

import pytest
import torch

from offload_core import KVStore, Mode, OffloadConfig
from offload_core.store.dedup import identical_rows

from store_helpers import put_all

# One row of K (or V): 256 KiB in fp32, 128 KiB in bf16, so that what a place adds per layer or per store (a
# file's 4 KiB header, the write staging) stays within the 1 % of slack the kept bytes are allowed.
ROW = (1, 1024, 2, 32)
ONE_ROW = 2 * 256 * 1024  # K and V of one fp32 row
PLANS = {
    "device+ram": {"mode": "ram_async", "device_budget": 3 * ONE_ROW},
    "ram+file": {"mode": "ram_sync", "host_budget": 3 * ONE_ROW},
}
TIERS = ["gpu", "ram_sync", "ram_async", "file_sync", "file_async", *PLANS]


def config_for(name, tmp_path, **extra):
    fields = dict(PLANS.get(name, {"mode": name}), **extra)
    if Mode(fields["mode"]).is_file or "host_budget" in fields:
        fields["file_dir"] = str(tmp_path)
    return OffloadConfig(**fields)


def batch(rows, seed, dtype=torch.float32, row=ROW):
    """K and V of `rows` identical rows (a batch from one prompt), each row random."""
    gen = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(row, generator=gen).to(dtype) for _ in range(2))
    return k.expand(rows, *row[1:]).clone(), v.expand(rows, *row[1:]).clone()


def kept_bytes(stats):
    return sum(stats["stored_bytes"].values())


def run(store, layers, passes=3):
    """Puts every layer, gets them `passes` times in order; asserts every get is bit-identical to the put."""
    put_all(store, layers)
    moved = []
    for _ in range(passes):
        before = store.stats()["transfers"]["bytes"]
        for key, (k, v) in layers.items():
            got_k, got_v = store.get(key)
            assert got_k.shape == k.shape and got_v.shape == v.shape and got_k.dtype == k.dtype
            assert torch.equal(got_k.view(torch.uint8), k.view(torch.uint8)), key
            assert torch.equal(got_v.view(torch.uint8), v.view(torch.uint8)), key
        moved.append(store.stats()["transfers"]["bytes"] - before)
    store.flush()  # every background write counted in the bytes kept
    return store.stats(), moved[-1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [2, 4])
@pytest.mark.parametrize("mode", TIERS)
def test_identical_rows_are_kept_and_moved_once_and_served_whole(mode, rows, dtype, tmp_path):
    layers = {i: batch(rows, seed=i, dtype=dtype) for i in range(5)}
    with KVStore(config_for(mode, tmp_path), "cpu") as store:
        stats, moved = run(store, layers)
    with KVStore(config_for(mode, tmp_path, dedup=False), "cpu") as store:
        whole, whole_moved = run(store, layers)
    assert stats["dedup"] | {"check_s": 0} == {"enabled": True, "layers": 5, "rows_put": 5 * rows, "rows_kept": 5,
                                               "saved_bytes": sum(k.nbytes + v.nbytes for k, v in layers.values())
                                               * (rows - 1) // rows, "check_s": 0}
    assert stats["dedup"]["check_s"] > 0 and whole["dedup"]["check_s"] == 0
    assert whole["dedup"]["rows_kept"] == whole["dedup"]["rows_put"] == 5 * rows
    if mode not in PLANS:
        assert stats["plan"] == whole["plan"]  # the same place, B times fewer bytes in it
    assert kept_bytes(stats) <= kept_bytes(whole) * (1 / rows + 0.01)
    assert moved <= whole_moved * (1 / rows + 0.01)
    if mode not in PLANS:  # (with a device budget, more layers fit it: more resident, within the budget)
        # The row is copied into the slot's start and broadcast there: no staging, no more on the device.
        assert stats["peak_device_bytes"] <= whole["peak_device_bytes"]
    if stats["plan"]["device"] < len(layers):
        assert moved > 0  # some layers stream: their one row is what moves


@pytest.mark.parametrize("mode", TIERS)
def test_compact_storage_encodes_the_one_row(mode, tmp_path):
    """Dedup first, then the codec: the tiers keep one encoded row, the consumer gets the batch decoded."""
    layers = {i: batch(4, seed=i, dtype=torch.bfloat16) for i in range(3)}
    stores = {}
    for dedup in (None, False):
        with KVStore(config_for(mode, tmp_path, storage="int8", dedup=dedup), "cpu") as store:
            put_all(store, layers)
            store.flush()  # every background write counted
            stores[dedup] = (store.stats(), [store.get(key) for key in layers][-1][0].clone())
    (deduped, last), (whole, last_whole) = stores[None], stores[False]
    assert torch.equal(last, last_whole)  # each row decodes to what the row decodes to without dedup
    worst, worst_whole = deduped["kv_error"].pop("worst"), whole["kv_error"].pop("worst")
    assert deduped["kv_error"] == whole["kv_error"]
    assert worst["layer"] == worst_whole["layer"] and worst["relative"] == pytest.approx(worst_whole["relative"])
    assert kept_bytes(deduped) <= kept_bytes(whole) * (1 / 4 + 0.01)


def _differs(where):
    """A batch of 4 whose rows are identical but for one element of the last row: +1 (in K or V), -0.0 for 0.0
    (equal as floats), one unit in the last place beside NaNs that every row holds alike."""
    k, v = batch(4, seed=3)
    target = k if where in ("k", "negative zero", "nan") else v
    if where == "negative zero":
        k[:, 0, 0, 0], v[:, 0, 0, 0] = 0.0, 0.0
        target[-1, 0, 0, 0] = -0.0  # equal as floats, not bit for bit
    elif where == "nan":
        k[:, 5, 1, 3] = float("nan")  # the same NaN in every row is identical
        target.view(torch.int32)[-1, 9, 0, 7] += 1  # one unit in the last place
    else:
        target[-1, 63, 1, 31] += 1.0
    return k, v


@pytest.mark.parametrize("where", ["k", "v", "negative zero", "nan"])
@pytest.mark.parametrize("mode", TIERS)
def test_one_element_of_the_last_row_differing_keeps_the_layer_whole(mode, where, tmp_path):
    layers = {0: batch(4, seed=1), 1: _differs(where), 2: batch(4, seed=2)}
    with KVStore(config_for(mode, tmp_path), "cpu") as store:
        stats, _ = run(store, layers)
    assert stats["dedup"]["layers"] == 2 and stats["dedup"]["rows_kept"] == 1 + 4 + 1


def test_the_check_compares_bits_not_float_values():
    k, _ = _differs("negative zero")
    assert torch.equal(k[-1], k[0]) and not identical_rows(k)
    nan = torch.full((3, 4), float("nan"))
    assert identical_rows(nan) and not torch.equal(nan[1], nan[0])
    assert identical_rows(torch.ones(2, 3, dtype=torch.bool)) and not identical_rows(torch.eye(2, dtype=torch.bool))


@pytest.mark.parametrize("mode", ["gpu", "ram_sync", "ram_async", "file_sync", "file_async", "device+ram"])
def test_a_slot_reused_by_layers_of_other_row_counts_serves_each_exactly(mode, tmp_path):
    """One ring slot serves, in turn, layers of 4, 1, 2 and 3 rows, kept as one row or whole, of other sizes and
    dtypes: staging and slot buffers grow and are reused, and nothing of the layer before shows through."""
    layers = {0: batch(4, seed=0), 1: batch(1, seed=1, row=(1, 300, 2, 32)), 2: batch(2, seed=2, dtype=torch.bfloat16),
              3: _differs("v"), 4: batch(3, seed=4, row=(1, 9, 2, 16)), 5: batch(4, seed=5, row=(1, 200, 2, 32))}
    with KVStore(config_for(mode, tmp_path), "cpu") as store:
        stats, _ = run(store, layers, passes=4)
    assert stats["dedup"]["layers"] == 4  # 0, 2, 4, 5; layer 1 has one row, layer 3 differs
    if mode != "gpu":
        assert stats["peak_layers_on_device"] <= stats["prefetch_depth"] + 1 + stats["plan"]["device"]


def test_gpu_mode_keeps_one_row_on_the_device_and_serves_it_through_one_slot():
    layers = {i: batch(4, seed=i) for i in range(8)}
    with KVStore(OffloadConfig(mode="gpu"), "cpu") as store:
        stats, moved = run(store, layers)
    layer = sum(layers[0][0].nbytes + layers[0][1].nbytes for _ in range(1))
    assert moved == 0 and stats["stored_bytes"]["device"] == 8 * layer // 4
    assert stats["peak_device_bytes"] == 8 * layer // 4 + layer  # the rows kept plus the slot they are served in


def test_a_consumer_writing_into_a_broadcast_layer_is_refused(tmp_path):
    layers = {i: batch(2, seed=i) for i in range(3)}
    with KVStore(OffloadConfig(mode="gpu"), "cpu") as store:
        put_all(store, layers)
        store.get(0)[0].add_(1)
        with pytest.raises(RuntimeError, match="modified in place"):
            store.get(1)
        with pytest.raises(RuntimeError, match="is broken"):  # nothing is served after it
            store.get(0)


@pytest.mark.parametrize("mode", ["ram_async", "file_async"])
def test_a_parked_store_serves_its_one_row_layers_again(mode, tmp_path):
    layers = {i: batch(4, seed=i) for i in range(4)}
    with KVStore(config_for(mode, tmp_path), "cpu") as store:
        run(store, layers, passes=1)
        store.park()
        for key, (k, v) in layers.items():
            got_k, got_v = store.get(key)
            assert torch.equal(got_k, k) and torch.equal(got_v, v)


def test_dedup_off_keeps_every_row_and_checks_nothing():
    layers = {i: batch(4, seed=i) for i in range(3)}
    with KVStore(OffloadConfig(mode="ram_sync", dedup=False), "cpu") as store:
        stats, _ = run(store, layers)
    assert stats["dedup"] == {"enabled": False, "layers": 0, "rows_put": 12, "rows_kept": 12, "saved_bytes": 0,
                              "check_s": 0.0}


@pytest.mark.parametrize("value, match", [("yes", "must be True or False"), (1, "must be True or False")])
def test_dedup_must_be_a_bool(value, match):
    with pytest.raises(ValueError, match=f"`dedup` {match}.*got {value!r}"):
        OffloadConfig(mode="ram_sync", dedup=value)


def test_dedup_with_mode_off_is_refused():
    with pytest.raises(ValueError, match="`dedup` only applies where a cache is kept; mode 'off'"):
        OffloadConfig(mode="off", dedup=False)


@pytest.mark.parametrize("mode", ["gpu", "ram_async", "file_async"])
def test_the_broadcast_is_ordered_between_the_copy_and_the_kernels_reading_it(make_sim, mode, tmp_path):
    """On SimCuda's early schedule (side copies as soon as allowed, the consumer's kernels lagging): the broadcast
    queued on the consumer's stream runs after the row's copy, before the kernels that read it, and the next load
    into the slot waits for both."""
    sim = make_sim("early")
    layers = {0: batch(4, seed=0), 1: batch(2, seed=1), 2: _differs("k"), 3: batch(3, seed=3, row=(1, 9, 2, 16))}
    with KVStore(config_for(mode, tmp_path), "cpu") as store:
        put_all(store, layers)
        sim.synchronize()
        seen = []
        for key in list(layers) * 3:
            k, v = store.get(key)
            sim.launch(lambda k, v, key=key: seen.append((key, k.clone(), v.clone())), k, v)
        sim.synchronize()
    for key, k, v in seen:
        assert torch.equal(k, layers[key][0]) and torch.equal(v, layers[key][1]), f"layer {key} came back wrong"


@pytest.mark.parametrize("mode", ["gpu", "ram_async", "file_sync"])
def test_a_row_the_codec_cannot_hold_is_kept_exact_and_still_once(mode, tmp_path):
    """Dedup first, then the codec: a row holding NaN is kept as put (one row), broadcast back bit for bit."""
    k, v = batch(4, seed=8)
    k[:, 3, 1, 2] = float("nan")
    layers = {0: (k, v), 1: batch(4, seed=9)}
    with KVStore(config_for(mode, tmp_path, storage="int8"), "cpu") as store:
        put_all(store, layers)
        got_k, got_v = store.get(0)
        assert torch.equal(got_k.view(torch.int32), layers[0][0].view(torch.int32))
        assert torch.equal(got_v, layers[0][1]) and store.get(1)[0].shape == layers[1][0].shape
        stats = store.stats()
    assert stats["dedup"]["layers"] == 2 and stats["kv_error"]["exact_layers"] == 1

"""Every bad value fails early, naming the option, the value and the fix, before anything is allocated."""

import os

import pytest
import torch

from offload_core import HostServices, KVStore, Mode, OffloadConfig


@pytest.mark.parametrize("kwargs, match", [
    ({"mode": "vram"}, r"`mode` must be one of .*'ram_async'.*got 'vram'"),
    ({"mode": 3}, r"`mode` must be one of .*got 3"),
    ({"mode": "ram_async", "prefetch_depth": 0}, r"`prefetch_depth` must be between 1 and 8 .*got 0"),
    ({"mode": "file_async", "prefetch_depth": 9}, r"`prefetch_depth` must be between 1 and 8 .*got 9"),
    ({"mode": "ram_async", "prefetch_depth": "2"}, r"`prefetch_depth` must be an int; got '2'"),
    ({"mode": "ram_async", "prefetch_depth": True}, r"`prefetch_depth` must be an int"),
    ({"mode": "ram_sync", "prefetch_depth": 2}, r"`prefetch_depth` only applies to the async modes.*'ram_sync'"),
    ({"mode": "gpu", "prefetch_depth": 1}, r"`prefetch_depth` only applies .*Remove it"),
    ({"mode": "ram_async", "file_dir": "."}, r"`file_dir` only applies to the file modes.*'ram_async'"),
    ({"mode": "gpu", "bypass_page_cache": False}, r"`bypass_page_cache` only applies to the file modes"),
    ({"mode": "file_sync", "bypass_page_cache": "yes"}, r"`bypass_page_cache` must be True or False"),
    ({"mode": "ram_async", "pin_budget": -1}, r"`pin_budget` must be a number of bytes >= 0; got -1"),
    ({"mode": "ram_sync", "pin_budget": 1 << 30}, r"`pin_budget` only applies to the async modes"),
    ({"mode": "ram_async", "device_budget": -5}, r"`device_budget` must be a number of bytes >= 0 .*got -5.*2 << 30"),
    ({"mode": "auto", "device_budget": 1.5}, r"`device_budget` must be a number of bytes"),
    ({"mode": "gpu", "device_budget": 1 << 30}, r"`device_budget` only applies to .*'gpu'.*Remove it"),
    ({"mode": "off", "device_budget": 0}, r"`device_budget` only applies to .*mode 'off'"),
    ({"mode": "file_async", "host_budget": 1 << 30}, r"`host_budget` only applies to 'ram_sync'.*'file_async'"),
    ({"mode": "gpu", "host_budget": 1 << 30}, r"`host_budget` only applies to"),
    ({"mode": "ram_sync", "host_budget": True}, r"`host_budget` must be a number of bytes"),
    ({"mode": "ram_async", "storage": "int4"}, r"`storage` must be one of 'exact', 'fp8', 'int8'; got 'int4'"),
    ({"mode": "off", "storage": "fp8"}, r"`storage` 'fp8' only applies where a cache is kept.*'off'"),
    ({"mode": "ram_sync", "file_dir": "."}, r"`file_dir` only applies to the file modes \(and RAM modes with a `host_budget`\)"),
])
def test_bad_options_are_rejected_with_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OffloadConfig(**kwargs)


def test_modes_accept_strings_and_enum_values():
    assert OffloadConfig(mode="RAM_ASYNC").mode is Mode.RAM_ASYNC
    assert OffloadConfig(mode=Mode.FILE_SYNC).mode is Mode.FILE_SYNC
    assert OffloadConfig(mode="ram_async").depth == 1
    assert OffloadConfig(mode="ram_sync").depth == 0


def test_file_dir_that_is_a_file(tmp_path):
    path = tmp_path / "cache.bin"
    path.write_bytes(b"x")
    with pytest.raises(ValueError, match=r"`file_dir` must be an existing directory; got .*cache.bin.*which is a file"):
        OffloadConfig(mode="file_sync", file_dir=str(path))


def test_file_dir_missing(tmp_path):
    with pytest.raises(ValueError, match=r"which is missing.*Create the directory first"):
        OffloadConfig(mode="file_async", file_dir=str(tmp_path / "nope"))


def test_file_dir_not_writable(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    # root bypasses permission bits; /proc/self is a directory no process may create files in.
    candidates = [str(locked), "/proc/self"]
    target = next((c for c in candidates if os.path.isdir(c) and not os.access(c, os.W_OK)), None)
    if target is None:
        pytest.skip("no directory on this machine is unwritable for this user")
    with pytest.raises(ValueError, match=r"`file_dir` must be writable"):
        OffloadConfig(mode="file_sync", file_dir=target)


def test_store_refuses_off_and_bad_devices_before_creating_anything(tmp_path):
    with pytest.raises(ValueError, match="mode 'off' means no KV cache"):
        KVStore(OffloadConfig(mode="off"), "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available in this torch"):
            KVStore(OffloadConfig(mode="file_async", file_dir=str(tmp_path)), "cuda")
    with pytest.raises(ValueError, match="is not a torch device"):
        KVStore(OffloadConfig(mode="file_sync", file_dir=str(tmp_path)), "gpu0")
    with pytest.raises(TypeError, match="must be an OffloadConfig"):
        KVStore({"mode": "gpu"}, "cpu")
    with pytest.raises(ValueError, match="`expected_bytes` must be a byte count"):
        KVStore(OffloadConfig(mode="file_sync", file_dir=str(tmp_path)), "cpu", expected_bytes=-5)
    assert os.listdir(tmp_path) == []


def test_host_services_pin_and_unpin_come_together():
    with pytest.raises(ValueError, match="`pin` and `unpin` come as a pair"):
        HostServices(pin=lambda t: True)


def test_put_and_get_errors(tmp_path):
    k = torch.zeros(2, 3)
    with KVStore(OffloadConfig(mode="file_sync", file_dir=str(tmp_path)), "cpu") as store:
        with pytest.raises(ValueError, match=r"`k` is on meta, but this store serves cpu"):
            store.put(0, torch.zeros(2, 3, device="meta"), k)
        with pytest.raises(TypeError, match="`v` must be a torch.Tensor; got list"):
            store.put(0, k, [1, 2])
        with pytest.raises(TypeError, match="not hashable"):
            store.put([0], k, k)
        with pytest.raises(TypeError, match="key None is reserved"):
            store.put(None, k, k)
        store.put(0, k, k)
        with pytest.raises(ValueError, match="layer 0 was already put"):
            store.put(0, k, k)
        with pytest.raises(KeyError, match="layer 1 was never put"):
            store.get(1)
        assert torch.equal(store.get(0)[0], k)
    assert os.listdir(tmp_path) == []


def test_budget_and_storage_rules_per_mode(tmp_path):
    """Which modes the new options apply to (the same table the node reads)."""
    applies = {m: (m.takes_device_budget, m.takes_host_budget, m.takes_storage) for m in Mode}
    assert applies[Mode.GPU] == (False, False, True) and applies[Mode.OFF] == (False, False, False)
    assert applies[Mode.RAM_SYNC] == applies[Mode.RAM_ASYNC] == applies[Mode.AUTO] == (True, True, True)
    assert applies[Mode.FILE_SYNC] == applies[Mode.FILE_ASYNC] == (True, False, True)
    assert OffloadConfig(mode="gpu", storage="FP8").storage == "fp8"
    assert OffloadConfig().storage == "exact" and OffloadConfig().device_budget is None
    # A RAM mode with a host budget spills to files, so the file options apply to it.
    spill = OffloadConfig(mode="ram_async", host_budget=1 << 20, file_dir=str(tmp_path), bypass_page_cache=False)
    assert spill.file_dir == str(tmp_path)


def test_a_file_mode_without_xxhash_is_refused_up_front(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "xxhash" else real(name, *a))
    for mode in ("file_sync", "file_async"):
        with pytest.raises(ValueError, match=r"xxhash is not installed.*pip install xxhash"):
            OffloadConfig(mode=mode)
    OffloadConfig(mode="ram_async")  # the other modes need no checksums

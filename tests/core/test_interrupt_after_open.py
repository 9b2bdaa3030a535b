"""Ctrl-C right after `os.open` returns (CPython raises it there, before the descriptor is stored): no descriptor,
lock or folder outlives the store, on the main thread where Python raises KeyboardInterrupt."""

import os
import signal

import pytest
import torch

from offload_core import KVStore, OffloadConfig
from offload_core.tiers.file import fileos

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open descriptors in /proc")


def _ctrl_c_after_open(monkeypatch, name_part):
    """`os.open` of a path containing `name_part` is followed, once, by a SIGINT to this process: the handler runs
    as the call returns, as it does after the real builtin."""
    fs = fileos.current()
    real, fired = fs.os.open, []

    def open_then_sigint(path, *args, **kwargs):
        fd = real(path, *args, **kwargs)
        if name_part in os.path.basename(str(path)) and not fired:
            fired.append(path)
            signal.raise_signal(signal.SIGINT)
        return fd

    monkeypatch.setattr(fs.os, "open", open_then_sigint)
    return fired


def _descriptors():
    return sorted(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("name_part", [".owner", "layer-"])
@pytest.mark.parametrize("mode", ["file_sync", "file_async"])
def test_ctrl_c_right_after_an_open_leaves_no_descriptor_or_folder(mode, name_part, tmp_path, monkeypatch):
    k = torch.randn(1, 37, 2, 64)
    fired = _ctrl_c_after_open(monkeypatch, name_part)
    before = _descriptors()
    store = KVStore(OffloadConfig(mode=mode, file_dir=str(tmp_path)), "cpu")
    try:
        with pytest.raises(KeyboardInterrupt):
            for key in range(3):
                store.put(key, k, k)
            store.flush()
            for key in range(3):
                store.get(key)
    finally:
        store.close()
    assert fired
    monkeypatch.undo()
    assert os.listdir(tmp_path) == []
    assert _descriptors() == before

"""Ctrl-C at every line a put runs on the consumer's thread in the file tiers, and after the tier has taken the
layer but before the store has counted it. The put is then retried: every layer reads exact, each has one file and
no other file is left, every descriptor comes back, and the write staging is freed once the writes end."""

import os

import pytest
import torch

from filestores import MODES, file_store, layers
from offload_core.tiers import iopool
from interrupt_lines import ctrl_c_at, lines_of, put_with_ctrl_c_at


def layer_files(store):
    return sorted(n for n in os.listdir(store.stats()["file_dir"]) if n.startswith("layer-"))


def _put_lines():
    from offload_core.tiers import filesave
    from offload_core.tiers.file import FileTier
    from offload_core.tiers.fileos import FileOS
    from offload_core.tiers.filewrite import Writer

    functions = (FileTier.store, Writer.write, Writer._count, Writer._queue_writes, filesave.reserve, FileOS.open)
    return [(fn, line) for fn in functions for line in lines_of(fn)]


def _settled(store, wait_until):
    """Waits until no write runs, no temp file is left and the write staging is freed (the trim the next load
    queues behind the writes)."""
    tier = store._tiers["file"]
    store.flush()
    store.get(list(store._layers.layouts)[-1])  # the newest layer: a load, never a slot the ring holds
    wait_until(lambda: tier._writer._writing == 0)
    wait_until(lambda: not [n for n in os.listdir(tier.directory) if n.endswith(".tmp")])
    wait_until(lambda: not tier._writer.staging.buffers())


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open descriptors in /proc")
@pytest.mark.parametrize("mode", MODES)
def test_ctrl_c_at_every_line_of_a_put_loses_nothing(mode, tmp_path, monkeypatch, wait_until):
    from offload_core.tiers import fileio

    monkeypatch.setattr(fileio, "CHUNK", 64 << 10)
    monkeypatch.setattr(iopool, "IO_TIMEOUT_S", 10.0)
    lines = _put_lines()
    data = layers(len(lines) + 1, shape=(1, 4, 256, 64))  # 512 KiB a layer: 8 chunks, more than the staging
    store = file_store(mode, tmp_path, data, put=[0])
    _settled(store, wait_until)
    fds = len(os.listdir("/proc/self/fd"))
    interrupted = 0
    for key, (function, line) in enumerate(lines, start=1):
        interrupted += put_with_ctrl_c_at(store, function, line, key, *data[key])
        where = (function.__qualname__, line)
        _settled(store, wait_until)
        wait_until(lambda: len(os.listdir("/proc/self/fd")) == fds)
        assert len(layer_files(store)) == key + 1, where
        for got in (key, key - 1, 0):
            k, v = store.get(got)
            assert torch.equal(k, data[got][0]) and torch.equal(v, data[got][1]), where
    assert interrupted >= 40
    store.close()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("mode", MODES)
def test_a_put_stopped_after_the_tier_took_it_is_put_again_without_touching_other_layers(mode, tmp_path,
                                                                                       monkeypatch, wait_until):
    """Ctrl-C just after the tier queued the layer's write, before the store counted the layer: the retry writes
    the layer again under a new name and removes the first file; the next layer's file is its own (a name reused
    would replace the retry's file, and layer 1 would read as layer 2)."""
    from offload_core.layers import Layers

    data = layers(4)
    store = file_store(mode, tmp_path, data, put=[0])
    real_add = Layers.add

    def add(self, key, *args):
        monkeypatch.setattr(Layers, "add", real_add)
        raise KeyboardInterrupt
    monkeypatch.setattr(Layers, "add", add)
    with pytest.raises(KeyboardInterrupt):
        store.put(1, *data[1])
    store.put(1, *data[1])
    for key in (2, 3):
        store.put(key, *data[key])
    _settled(store, wait_until)
    wait_until(lambda: len(layer_files(store)) == 4)
    for key in (3, 1, 2, 0):
        k, v = store.get(key)
        assert torch.equal(k, data[key][0]) and torch.equal(v, data[key][1]), key
    store.close()
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open descriptors in /proc")
def test_a_handle_closed_again_after_ctrl_c_inside_its_close_closes_its_descriptor_once(tmp_path):
    from offload_core.tiers import fileos
    from offload_core.tiers.fileos import Handle

    fs = fileos.current()
    before = len(os.listdir("/proc/self/fd"))
    for line in lines_of(Handle.close):
        handle = fs.open(str(tmp_path / f"f{line}"), os.O_WRONLY | os.O_CREAT)
        with ctrl_c_at(Handle.close, line):
            try:
                handle.close()
            except KeyboardInterrupt:
                pass
        spare = os.open(str(tmp_path / f"f{line}"), os.O_RDONLY)  # takes the number a closed descriptor freed
        handle.close()  # must neither leave the descriptor open nor close `spare`
        os.fstat(spare)
        os.close(spare)
        assert len(os.listdir("/proc/self/fd")) == before, line

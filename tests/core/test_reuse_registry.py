"""The prefix registry's one rejection path, its named key parts, and stores that fail to close."""

import gc
import logging

import pytest
import torch

from offload_core.reuse.prefix import PrefixKey
from offload_core.reuse.registry import PrefixRegistry
from interrupt_lines import lines_of
from registry_stores import files, filled_store, key

BUDGET = {"device": 1 << 30, "host": 1 << 30, "file": 1 << 30}


def test_a_key_names_the_model_it_was_computed_by():
    header = ("flux2", 1234, (("identity",), b"weights"), "native")
    k = PrefixKey.build(header, [torch.zeros(2, 3), torch.ones(4, dtype=torch.int8)])
    assert (k.scope, k.model_id, k.weights) == (("flux2", 1234), 1234, b"weights")
    assert k.header == header and k.shapes == (((2, 3), "torch.float32"), ((4,), "torch.int8"))
    assert k.on_host().matches(k) and k.on_host().scope == k.scope
    # The same header and values under another dtype: the shapes tell them apart.
    other = PrefixKey.build(header, [torch.zeros(2, 3, dtype=torch.float64), torch.ones(4, dtype=torch.int8)])
    assert not k.matches(other)


def test_every_rejection_is_counted_and_logged_the_same_way(tmp_path, caplog):
    registry = PrefixRegistry({"host": 10}, name="cond")
    store, _ = filled_store("ram_sync", tmp_path)
    with caplog.at_level(logging.INFO, logger="offload_core.reuse.registry"):
        assert not registry.admit(key(torch.zeros(1)), store)  # over the budget: turned down by the registry
        registry.note_rejection("its files go with the run")  # turned down by the caller, before offering it
    stats = registry.stats()
    assert stats["rejected"] == 2 and stats["last_rejection"] == "its files go with the run"
    lines = [r.getMessage() for r in caplog.records if r.name == "offload_core.reuse.registry"]
    assert len(lines) == 2 and all(line.startswith("KV offload reuse [cond]: not kept (") for line in lines)
    assert "budget" in lines[0] and store.closed


@pytest.mark.parametrize("how", ["close", "garbage collected"])
def test_a_kept_store_that_fails_to_close_is_logged_and_the_others_still_close(how, tmp_path, caplog):
    registry = PrefixRegistry(BUDGET)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    broken, _ = filled_store("file_sync", tmp_path / "a")
    kept, _ = filled_store("file_sync", tmp_path / "b")
    assert registry.admit(key(torch.zeros(1)), broken) and registry.admit(key(torch.ones(1)), kept)
    real_close = broken.close

    def close():
        raise OSError(5, "Input/output error")  # e.g. its directory on a disk that went away
    broken.close = close
    with caplog.at_level(logging.WARNING, logger="offload_core.reuse.registry"):
        if how == "close":
            registry.close()
        else:
            del registry
            gc.collect()
    assert "closing a kept store failed" in caplog.text and "Input/output error" in caplog.text
    assert kept.closed and files(tmp_path / "b") == []
    real_close()
    assert files(tmp_path) == []


def test_a_bug_in_closing_a_kept_store_is_not_hidden(tmp_path):
    registry = PrefixRegistry(BUDGET)
    store, _ = filled_store("ram_sync", tmp_path)
    assert registry.admit(key(torch.zeros(1)), store)
    real_close = store.close
    store.close = lambda: None.missing  # an AttributeError: a bug, not an I/O failure
    with pytest.raises(AttributeError):
        registry.clear()
    del store.close  # fixed: the registry's close finishes what the failed one left
    registry.close()
    assert store.closed and real_close is not None


def _registry_close_lines():
    from offload_core.reuse.registry import _close_quietly
    from offload_core.store.kvstore import KVStore

    functions = (PrefixRegistry.close, PrefixRegistry._evict, PrefixRegistry._finish_closing, _close_quietly,
                 KVStore._close)
    return [(fn, line) for fn in functions for line in lines_of(fn)]


@pytest.mark.sweep
@pytest.mark.parametrize("leased", [False, True])
def test_a_registry_close_stopped_by_ctrl_c_at_any_line_is_finished_by_the_next(leased, tmp_path):
    # Kept stores (one of them leased to a request, when `leased`): Ctrl-C anywhere in the registry's close, from
    # the eviction down to a store's own close; the next registry close() closes every store and deletes its files.
    from interrupt_lines import call_with_ctrl_c_at

    interrupted = 0
    for n, (function, line) in enumerate(_registry_close_lines()):
        registry, stores = PrefixRegistry(BUDGET), []
        for i in range(2):
            (tmp_path / f"{n}-{i}").mkdir()
            stores.append(filled_store("file_async", tmp_path / f"{n}-{i}", seed=i)[0])
            assert registry.admit(key(torch.full((1,), float(i))), stores[-1])
        if leased:
            assert registry.lookup(key(torch.zeros(1))) is not None
        interrupted += call_with_ctrl_c_at(function, line, registry.close)
        registry.close()
        assert all(s.closed and s._res.closed for s in stores), (function.__qualname__, line)
        assert files(tmp_path) == [], (function.__qualname__, line)
    assert interrupted >= 15

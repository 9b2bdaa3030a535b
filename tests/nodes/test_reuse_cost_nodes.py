"""Reuse that does not pay turns itself off in the nodes too: where reading the model for the key costs more than a
hit saves (measured on the runs that captured a prefix, at each model and prefix size), reuse stops there with one
warning and the reason in the readout, and the latents are those of reuse off; `reuse_always` keeps it on."""

import logging
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from kv_offload_pack.nodes.run import reuse as reuse_module
from kv_offload_pack.nodes.run.branch import CACHED, CAPTURE
from kv_offload_pack.nodes.inputs import reuse_from_inputs
from kv_offload_pack.nodes.run.reuse import ALWAYS, REUSE, RunCost
from kv_offload_pack.offload_core.reuse import cost as reusecost
from kv_offload_pack.offload_core.reuse.cost import LOSSES, ReuseCost

from qwen21_tiny import Tiny21
from reuse_nodes_helpers import Fills, patched, queue

SLOW_KEY_S = 5.0  # far above what a hit saves on the tiny model (about a millisecond), and above any noise
OFF = "a hit would save"  # in the reason of a verdict


@pytest.fixture(autouse=True)
def _empty_registry():
    REUSE.reset()
    yield
    REUSE.reset()


@pytest.fixture
def slow_key(monkeypatch):
    """The key of a model whose weights take `SLOW_KEY_S` to read: a stand-in for a large model on a CPU. The
    clocks that time the key and the forwards run `SLOW_KEY_S` ahead at each read instead of the test sleeping, so
    the figure can be far above what a loaded machine adds to a forward. Returns the list of reads."""
    real, reads, ahead = reuse_module.model_state, [], [0.0]
    clock = SimpleNamespace(perf_counter=lambda: time.perf_counter() + ahead[0])
    monkeypatch.setattr(reuse_module, "time", clock)  # the key's time
    monkeypatch.setattr(reusecost, "time", clock)  # the forwards' times

    def slow(*args, **kwargs):
        reads.append(1)
        ahead[0] += SLOW_KEY_S
        return real(*args, **kwargs)
    monkeypatch.setattr(reuse_module, "model_state", slow)
    return reads


def _losses(dm, m, first=0):
    for prompt in range(first, first + LOSSES):  # another prompt each run: a miss each, at one prefix size
        queue(dm, m, prompt=prompt)


def _apply(dm, m):
    """Patch `dm` with `m`'s object patches again, as ModelPatcher does while `m` is the model sampled."""
    for name, obj in m.object_patches.items():
        setattr(dm, name.split(".", 1)[1], obj)
    return m


def _off_at(dm, tokens=8) -> str:
    """The verdict at the tiny model's prefix of `tokens` (its key: the prefix's features, then the target size)."""
    return REUSE.cost.off(RunCost.scope(dm, torch.zeros(1, tokens * 32 + 1))) or ""


def test_a_key_that_costs_more_than_a_hit_saves_turns_reuse_off_at_that_size(slow_key, caplog):
    dm = Tiny21()
    m = patched(dm, reuse=True)
    fills = Fills(dm, prefix_len=8)
    with caplog.at_level(logging.WARNING):
        for prompt in range(LOSSES):
            queue(dm, m, prompt=prompt)
            snap = REUSE.snapshot()
            assert snap["refused"] is None and snap["key_s"] >= SLOW_KEY_S and snap["saved_s"] < SLOW_KEY_S
        got = queue(dm, m, prompt=0, seed=1)  # kept, but the key is no longer read at this size
        queue(dm, m, prompt=0, seed=2)
    assert sum("prefix reuse is off" in r.message for r in caplog.records) == 1
    snap = REUSE.snapshot()
    assert len(slow_key) == LOSSES and snap["hits"] == 0 and fills.count == 3 * (LOSSES + 2)
    assert OFF in snap["refused"] and "reuse_always" in snap["refused"] and snap["key_s"] == 0.0
    assert snap["on"] and f"off for the last run: {snap['refused']}" in snap["line"]
    assert torch.equal(got, queue(dm, patched(dm, reuse=False), prompt=0, seed=1))
    REUSE.reset()  # the verdicts go with the counters
    queue(dm, _apply(dm, m), prompt=0)
    assert len(slow_key) == LOSSES + 1 and REUSE.snapshot()["refused"] is None


def test_a_larger_prefix_is_judged_on_its_own(slow_key):
    dm = Tiny21()
    m = patched(dm, reuse=True)
    _losses(dm, m)
    queue(dm, m, prompt=0, n_ref=9)  # more reference tokens: another prefix size, read and kept
    snap = REUSE.snapshot()
    assert snap["refused"] is None and snap["key_s"] >= SLOW_KEY_S and len(slow_key) == LOSSES + 1
    queue(dm, m, prompt=0, seed=1)  # the first size stays off
    assert OFF in REUSE.snapshot()["refused"]


def test_always_keeps_hitting_whatever_the_measurement(slow_key):
    dm = Tiny21()
    fills = Fills(dm, prefix_len=8)
    m = patched(dm, reuse=ALWAYS)
    for prompt in range(LOSSES + 1):
        queue(dm, m, prompt=prompt)
    queue(dm, m, prompt=0, seed=1)
    assert REUSE.snapshot()["hits"] == 1 and REUSE.snapshot()["refused"] is None
    _losses(dm, patched(dm, reuse=True), first=10)  # a node that measures: reuse off at this size
    assert OFF in _off_at(dm)
    queue(dm, _apply(dm, m), prompt=0, seed=2)  # the verdict does not bind a node set to always
    snap = REUSE.snapshot()
    assert snap["hits"] == 2 and snap["refused"] is None and fills.count == 3 * (2 * LOSSES + 1)


def test_a_run_is_timed_only_while_a_capture_lacks_its_later_forward(slow_key, monkeypatch):
    waited = []
    monkeypatch.setattr(reusecost, "devices", SimpleNamespace(wait_for_device=waited.append))
    dm = Tiny21()
    m = patched(dm, reuse=True)
    queue(dm, m)  # a miss: of its 4 forwards the capture and one later forward, each waited for at both ends
    assert len(waited) == 4
    queue(dm, m, seed=1)  # a hit: its first forward, then nothing is owed
    assert len(waited) == 6
    queue(dm, m, prompt=1)  # a miss: the second in a row (a hit is not judged), reuse turns off
    assert len(waited) == 10 and OFF in _off_at(dm)
    queue(dm, m, seed=2)  # no key read: its first forward only
    assert len(waited) == 12


def test_the_forwards_of_one_thread_are_compared():
    # multi-GPU sampling runs each device's forwards on its own thread: one device's are timed
    cost, cpu = RunCost(ReuseCost(), REUSE), torch.device("cpu")
    cost.begin(cpu)

    def other():
        cost.begin(cpu)
        cost.read(Tiny21(), torch.zeros(1, 3), 0.5)
        cost.end(CACHED)
    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    cost.end(CAPTURE)
    assert len(cost.times.extract) == 1 and cost.times.cached == [] and cost.key_s == 0.0 and cost.scopes == []


def test_the_settings_widgets_map_to_what_apply_offload_takes():
    assert reuse_from_inputs(True, False) is True and reuse_from_inputs(True, True) == ALWAYS
    assert reuse_from_inputs(False, True) is False and reuse_from_inputs(False, False) is False


def test_the_branches_of_one_run_count_as_one_run(slow_key):
    dm = Tiny21()
    m = patched(dm, reuse=True)
    queue(dm, m, cfg=3.0)  # cond and uncond: two captures of one size, one run
    assert _off_at(dm) == "" and REUSE.snapshot()["saved_s"] is not None
    queue(dm, m, prompt=1, cfg=3.0)
    assert OFF in _off_at(dm)


def test_the_key_read_inside_a_capture_is_not_counted_as_saved():
    dm = Tiny21()
    cost = RunCost(ReuseCost(), REUSE)
    cost.read(dm, torch.zeros(1, 3), 2.0)
    cost.times.extract, cost.times.cached = [3.0], [0.5, 0.5]  # a capture of 3 s, 2 s of it the key
    cost.free()
    assert REUSE.saved_s == 0.5

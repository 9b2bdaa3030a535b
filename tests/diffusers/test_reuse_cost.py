"""Reuse that does not pay turns itself off: where reading the model for the key costs more than a hit saves
(measured on the misses at each prefix size), reuse stops there with the reason, and serves the same images."""

import logging
import time

import pytest
import torch

from offload_core.reuse import cost as reusecost
from offload_core.bench import models
from offload_core.diffusers import enable_kv_offload, session as session_module
from offload_core.reuse.cost import LOSSES, ReuseCost, StepTimes

from reuse_helpers import BIG

SLOW_KEY_S = 0.25  # far above what a hit saves on the test model (tens of milliseconds)


def _run(pipe, image):
    return pipe(**models.call_kwargs(pipe, [image], steps=2, resolution=64, seed=0, cfg=False)).images


@pytest.fixture
def slow_key(monkeypatch):
    """The key of a model whose weights take a quarter second to read: a stand-in for a large model on a CPU."""
    real = session_module.model_state

    def slow(*args, **kwargs):
        time.sleep(SLOW_KEY_S)
        return real(*args, **kwargs)
    monkeypatch.setattr(session_module, "model_state", slow)


def test_a_key_that_costs_more_than_a_hit_saves_turns_reuse_off_at_that_size(flux_pipe, images, slow_key, caplog):
    others = models.condition_images(LOSSES, seed=7)  # another reference each request: a miss each
    session = enable_kv_offload(flux_pipe, "ram_sync", reuse_budget=BIG)
    with caplog.at_level(logging.WARNING):
        for image in others:
            _run(flux_pipe, image)
            stats = session.last_stats[0]
            assert stats["reuse"] == "kept" and stats["reuse_key_s"] >= SLOW_KEY_S
            assert stats["reuse_saved_s"] < SLOW_KEY_S  # what the extracting call cost beyond a later one
    assert sum("prefix reuse is off for this model" in r.message for r in caplog.records) == 1
    got = _run(flux_pipe, others[0])  # kept, but the key is no longer read at this size
    stats = session.last_stats[0]
    assert stats["reuse"] == "off" and "a hit would save" in stats["reuse_refused"]
    assert stats["reuse_key_s"] < SLOW_KEY_S
    enable_kv_offload(flux_pipe, "ram_sync", reuse=False)
    assert (_run(flux_pipe, others[0]) == got).all()


def test_another_prefix_size_is_judged_on_its_own_and_always_keeps_reuse_on(flux_pipe, images, slow_key):
    others = models.condition_images(LOSSES, seed=7)
    session = enable_kv_offload(flux_pipe, "ram_sync", reuse_budget=BIG)
    for image in others:
        _run(flux_pipe, image)
    _run(flux_pipe, models.condition_images(1, size=96, seed=7)[0])  # a larger reference: more prefix tokens
    assert session.last_stats[0]["reuse"] == "kept"  # the key was read: not judged yet at this size
    session = enable_kv_offload(flux_pipe, "ram_sync", reuse="always", reuse_budget=BIG)
    for image in others:
        _run(flux_pipe, image)
    _run(flux_pipe, others[0])
    assert session.last_stats[0]["reuse"] == "hit"


def test_the_verdict_needs_losses_in_a_row_and_a_measured_saving():
    cost = ReuseCost()
    scope = ("model", "size")
    assert cost.judge(scope, 0.2, None) is None  # nothing measured: nothing decided
    for _ in range(LOSSES - 1):
        assert cost.judge(scope, 0.2, 0.1) is None
    assert cost.judge(scope, 0.2, 0.3) is None  # a win resets the count
    for _ in range(LOSSES - 1):
        assert cost.judge(scope, 0.2, 0.1) is None
    reason = cost.judge(scope, 0.2, 0.1)
    assert "200.0 ms" in reason and "100.0 ms" in reason and cost.off(scope) == reason
    assert cost.off(("model", "other size")) is None
    always = ReuseCost(always=True)
    for _ in range(LOSSES + 1):
        assert always.judge(scope, 0.2, 0.1) is None


def test_step_times_compare_each_extracting_call_with_one_later_call(monkeypatch):
    clock = iter(range(100))
    monkeypatch.setattr(reusecost.time, "perf_counter", lambda: float(next(clock)))
    times, cpu = StepTimes(), torch.device("cpu")
    for extracting in (True, True, False, False, False):  # two branches extract, then later steps
        times.begin(cpu, extracting)
        for _ in range(3 if extracting else 0):  # an extracting call takes 4 ticks, a later one 1
            next(clock)
        times.end(cpu)
    assert times.extract == [4.0, 4.0] and times.cached == [1.0, 1.0]  # the third later call is not timed
    assert times.saved() == 6.0
    assert StepTimes().saved() is None


def test_step_times_wait_for_the_device_at_both_ends_of_a_timed_call(monkeypatch):
    # On a GPU a forward returns once its kernels are queued: the time of what ran needs the device's completion.
    from offload_core.host import devices
    waited = []
    monkeypatch.setattr(devices, "wait_for_device", waited.append)
    cuda, times = torch.device("cuda", 0), StepTimes()
    times.begin(cuda, True)
    times.end(cuda)
    assert waited == [cuda, cuda]
    times.begin(cuda, False)
    times.end(cuda)
    times.begin(cuda, False)  # a later call beyond the one compared: not timed, not waited for
    times.end(cuda)
    assert len(waited) == 4


def test_a_call_told_what_it_did_at_its_end_is_timed_while_it_could_be_one_to_compare(monkeypatch):
    # The ComfyUI nodes learn what a forward did only once it ran (it put layers, or read them).
    clock = iter(range(100))
    monkeypatch.setattr(reusecost.time, "perf_counter", lambda: float(next(clock)))
    times, cpu = StepTimes(), torch.device("cpu")
    for did in (None, True, False, False, False):  # a forward with no prefix, a capture, then later forwards
        times.begin(cpu)
        times.end(cpu, did)
    assert times.extract == [1.0] and times.cached == [1.0]  # neither: dropped; the later ones beyond: dropped
    monkeypatch.setattr(reusecost.time, "perf_counter", lambda: pytest.fail("a call timed with nothing to compare"))
    times.begin(cpu)  # every capture has its later call: not timed
    times.end(cpu, False)
    assert times.cached == [1.0]


def test_the_reason_says_how_to_keep_reuse_on():
    cost, scope = ReuseCost(keep_on="the node's reuse_always input"), ("model", "size")
    reasons = [cost.judge(scope, 0.2, 0.1) for _ in range(LOSSES)]
    assert reasons[-1].endswith("(the node's reuse_always input keeps it on)")

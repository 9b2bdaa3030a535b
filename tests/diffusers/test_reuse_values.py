"""Reuse is never stale across a change to a value the forward reads (issue 51): request 1 keeps a prefix, one
change, request 2 — compared bit for bit with the same request made with reuse off in the changed state. Undone,
the kept prefix serves again."""

import numpy as np
import pytest

from offload_core.bench import models
from offload_core.diffusers import disable_kv_offload, enable_kv_offload

from reuse_helpers import BIG
from valuechanges import SETUPS, VALUE_CHANGES


def _run(pipe, images, seed=1):
    return pipe(**models.call_kwargs(pipe, images, steps=2, resolution=64, seed=seed, cfg=False)).images


def _changed(pipe, images, change):
    undo = change(pipe)
    try:
        return _run(pipe, images)
    finally:
        undo()


@pytest.fixture
def setup(request):
    undo = []
    yield lambda name, pipe: undo.append(SETUPS[name](pipe)) if name in SETUPS else None
    for u in reversed(undo):
        u()


@pytest.mark.parametrize("name", sorted(VALUE_CHANGES))
@pytest.mark.parametrize("which", ["qwen", "flux"])
def test_a_changed_value_is_a_miss_and_undone_hits_again(which, name, qwen_pipe, flux_pipe, images, setup):
    pipe, imgs = (qwen_pipe if which == "qwen" else flux_pipe), images[:1]
    setup(name, pipe)
    reference = _changed(pipe, imgs, VALUE_CHANGES[name])
    unchanged = _run(pipe, imgs)
    session = enable_kv_offload(pipe, "ram_sync", reuse_budget=BIG, reuse="always")
    _run(pipe, imgs, seed=0)  # keeps the prefix
    assert session.reuse.stats()["admitted"] == 1, session.last_stats
    undo = VALUE_CHANGES[name](pipe)
    try:
        out = _run(pipe, imgs)
    finally:
        undo()
    assert np.array_equal(out, reference), f"{which}/{name}: stale output"
    assert session.reuse.stats()["hits"] == 0, f"{which}/{name}: served a hit across the change"
    assert np.array_equal(_run(pipe, imgs), unchanged)
    if name != "pair_sign_flips":  # new weights evict what the old ones made
        assert session.reuse.stats()["hits"] >= 1, f"{which}/{name}: undone, the kept prefix no longer hits"
    disable_kv_offload(pipe)


@pytest.mark.parametrize("name", sorted(VALUE_CHANGES))
def test_each_value_change_changes_an_image(name, qwen_pipe, flux_pipe, images, setup):
    """So a stale hit would show."""
    differs = []
    for pipe in (qwen_pipe, flux_pipe):
        setup(name, pipe)
        differs.append(not np.array_equal(_changed(pipe, images[:1], VALUE_CHANGES[name]), _run(pipe, images[:1])))
    assert any(differs), f"{name} changes neither image: it tests nothing"


@pytest.mark.parametrize("name", ["main_global_dict", "main_closure_tensor", "main_environment"])
def test_a_value_read_under_a_wrapper_from_another_package_is_still_read(name, qwen_pipe, images, setup):
    """The `__main__` patch wrapped again by a package the walk did not follow (the test's own `class_forward`):
    the wrapper was recorded by identity only, so what the patch under it reads was never read (a stale hit
    found by the property run). A function installed into the model's classes is a patch: its package is
    followed."""
    from changes import class_forward

    setup(name, qwen_pipe)
    wrapped = class_forward(qwen_pipe)
    try:
        reference = _changed(qwen_pipe, images[:1], VALUE_CHANGES[name])
        session = enable_kv_offload(qwen_pipe, "ram_sync", reuse_budget=BIG, reuse="always")
        _run(qwen_pipe, images[:1], seed=0)
        undo = VALUE_CHANGES[name](qwen_pipe)
        try:
            out = _run(qwen_pipe, images[:1])
        finally:
            undo()
        assert session.reuse.stats()["hits"] == 0 and np.array_equal(out, reference)
        disable_kv_offload(qwen_pipe)
    finally:
        wrapped()

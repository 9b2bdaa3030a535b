"""Reuse is never stale: request 1 keeps a prefix, one change, request 2 — compared bit for bit with the unpatched
pipeline in the changed state. Each change is a miss or refused (reuse off for that request, with the reason);
a lossy hit equals a fresh lossy request.
"""

import numpy as np
import pytest
import torch

from offload_core.bench import models
from offload_core.diffusers import disable_kv_offload, enable_kv_offload

from changes import CHANGES, tf32_changes_matmuls
from reuse_helpers import BIG

REFUSED = {"forward_hook", "pre_hook", "diffusers_hook", "attention_backend", "processor_attribute", "tf32"}  # off


def _run(pipe, images, seed=1):
    return pipe(**models.call_kwargs(pipe, images, steps=2, resolution=64, seed=seed, cfg=False)).images


def _changed_reference(pipe, images, change):
    undo = change(pipe)
    try:
        return _run(pipe, images)
    finally:
        undo()


@pytest.mark.parametrize("name", sorted(CHANGES))
@pytest.mark.parametrize("which", ["qwen", "flux"])
def test_a_change_after_a_kept_prefix_is_never_served_stale(which, name, qwen_pipe, flux_pipe, images):
    pipe = qwen_pipe if which == "qwen" else flux_pipe
    imgs = images[:1]
    reference = _changed_reference(pipe, imgs, CHANGES[name])
    unchanged = _run(pipe, imgs)
    session = enable_kv_offload(pipe, "ram_sync", reuse_budget=BIG, reuse="always")
    _run(pipe, imgs, seed=0)  # keeps the prefix
    undo = CHANGES[name](pipe)
    try:
        out = _run(pipe, imgs)
    finally:
        undo()
    stats = session.reuse.stats()
    assert np.array_equal(out, reference), f"{which}/{name}: stale output (hits {stats['hits']})"
    assert stats["hits"] == 0, f"{which}/{name}: served a hit across the change"
    if name in REFUSED:
        assert all(s["reuse"] == "off" and s["reuse_refused"] for s in session.last_stats)
    assert np.array_equal(_run(pipe, imgs), unchanged)  # undone: the kept prefix serves again
    assert session.reuse.stats()["hits"] >= 1 or name in {"data_edit", "tiny_data_edit"}
    disable_kv_offload(pipe)


def test_the_change_catalogue_changes_every_image(qwen_pipe, flux_pipe, images):
    """Each change alters the output of at least one pipeline, so a stale hit would show."""
    for name, change in CHANGES.items():
        if name != "tf32":  # the next test: whether it changes anything depends on the CPU
            _assert_changes_an_image(name, change, (qwen_pipe, flux_pipe), images)


def test_the_precision_switch_changes_an_image_where_the_machine_has_a_lower_precision_matmul(
        qwen_pipe, flux_pipe, images):
    if not tf32_changes_matmuls():
        pytest.skip("this CPU has no lower-precision float32 matmul (no bf16 in its vector unit): the 'tf32' change "
                    "alters nothing here, so its stale-hit case is checked for refusal only")
    _assert_changes_an_image("tf32", CHANGES["tf32"], (qwen_pipe, flux_pipe), images)


def _assert_changes_an_image(name, change, pipes, images):
    differs = [not np.array_equal(_changed_reference(p, images[:1], change), _run(p, images[:1])) for p in pipes]
    assert any(differs), f"{name} changes neither image: it tests nothing"


@pytest.mark.parametrize("storage", ["fp8", "int8"])
@pytest.mark.parametrize("which", ["qwen", "flux"])
def test_a_lossy_hit_equals_a_fresh_lossy_request(which, storage, qwen_pipe, flux_pipe, images):
    pipe = qwen_pipe if which == "qwen" else flux_pipe
    enable_kv_offload(pipe, "ram_sync", reuse=False, storage=storage)
    fresh = _run(pipe, images[:1])
    session = enable_kv_offload(pipe, "ram_sync", reuse_budget=BIG, storage=storage, reuse="always")
    first = _run(pipe, images[:1])
    hit = _run(pipe, images[:1])
    assert session.reuse.stats()["hits"] >= 1
    assert np.array_equal(first, fresh) and np.array_equal(hit, fresh)
    disable_kv_offload(pipe)
    assert not np.array_equal(_run(pipe, images[:1]), fresh)  # the decoded prefix is what it attends to


def test_storage_is_part_of_the_key(qwen_pipe, images):
    session = enable_kv_offload(qwen_pipe, "ram_sync", reuse_budget=BIG, reuse="always")
    key = session.reuse_key("qwenimage21", qwen_pipe.transformer, torch.device("cpu"), (), [torch.zeros(2)])
    disable_kv_offload(qwen_pipe)
    session = enable_kv_offload(qwen_pipe, "ram_sync", reuse_budget=BIG, storage="int8", reuse="always")
    other = session.reuse_key("qwenimage21", qwen_pipe.transformer, torch.device("cpu"), (), [torch.zeros(2)])
    assert not key.matches(other)


def test_attention_kwargs_are_keyed_by_content_and_unreadable_ones_refuse(qwen_pipe):
    session = enable_kv_offload(qwen_pipe, "ram_sync", reuse_budget=BIG, reuse="always")
    mask = torch.zeros(64, 64)
    other = mask.clone()
    other[30, 30] = 1  # the corners (and torch's repr) agree; the content does not
    assert repr({"m": [mask]}) == repr({"m": [other]})

    def key(options):
        return session.reuse_key("qwenimage21", qwen_pipe.transformer, torch.device("cpu"), (), [], options)

    assert key({"m": [mask]}).matches(key({"m": [mask.clone()]}))
    assert not key({"m": [mask]}).matches(key({"m": [other]}))
    assert key({"fn": object()}) is None and "attention kwargs" in session.refused


def test_a_peft_lora_b_edited_through_data_is_a_miss(images):
    """With PEFT: an adapter's `lora_B` edited in place (as a training step or a merge tool does) is a new prefix."""
    pytest.importorskip("peft", reason="LoRA adapters need peft (pip install peft)")
    from peft import LoraConfig

    pipe = models.flux2_klein_kv_pipeline()
    pipe.transformer.add_adapter(LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                            target_modules=["to_k"]), adapter_name="a")
    lora_b = next(p for n, p in pipe.transformer.named_parameters() if "lora_B" in n)
    session = enable_kv_offload(pipe, "ram_sync", reuse_budget=BIG, reuse="always")
    _run(pipe, images[:1], seed=0)
    lora_b.data[-1, -1] += 0.5
    out = _run(pipe, images[:1])
    assert session.reuse.stats()["hits"] == 0
    disable_kv_offload(pipe)
    assert np.array_equal(out, _run(pipe, images[:1]))


@pytest.mark.parametrize("which", ["qwen", "flux"])
def test_the_new_precision_api_set_to_bf16_runs_every_call_as_reuse_off_does(which, qwen_pipe, flux_pipe, images):
    """`torch.backends.mkldnn.matmul.fp32_precision = "bf16"` made torch's legacy getter raise inside the key:
    every call failed. Now each call runs, refused (reduced precision), and equals the same call without reuse."""
    pipe = qwen_pipe if which == "qwen" else flux_pipe
    saved = torch.backends.mkldnn.matmul.fp32_precision
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    try:
        enable_kv_offload(pipe, "ram_sync", reuse=False)
        reference = _run(pipe, images[:1])
        session = enable_kv_offload(pipe, "ram_sync", reuse_budget=BIG, reuse="always")
        for _ in range(2):
            assert np.array_equal(_run(pipe, images[:1]), reference)
            assert all("mkldnn.matmul.fp32_precision" in s["reuse_refused"] for s in session.last_stats)
    finally:
        torch.backends.mkldnn.matmul.fp32_precision = saved

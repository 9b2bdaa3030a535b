"""The model part of a reuse key: every weight byte, the module tree's state, the hooks — or a refusal."""

import pytest
import torch

from offload_core import passive
from offload_core.reuse.contentdigest import content_digest
from offload_core.reuse.fingerprint import Unkeyable, model_state, plain

CPU = torch.device("cpu")


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64))


def test_every_bit_of_every_weight_counts_and_placement_does_not():
    model = _model()
    base = model_state(model, CPU)
    for p in model.parameters():  # what model CPU offload does every request: same values, new storage
        p.data = p.data.clone()
    assert model_state(model, CPU).digest == base.digest
    with torch.no_grad():
        model[0].weight.add_(0)  # an in-place write that changes no value: the same model
    assert model_state(model, CPU).digest == base.digest
    weight = model[0].weight
    for index in [(0, 1), (63, 63), (17, 40)]:  # through `.data`: no version counter moves
        saved = weight.data[index].clone()
        weight.data[index] = torch.nextafter(saved, torch.tensor(float("inf")))  # one unit in the last place
        assert model_state(model, CPU).digest != base.digest, index
        weight.data[index] = saved
    assert model_state(model, CPU).digest == base.digest
    model.add_module("lora", torch.nn.Linear(4, 1))  # an adapter loaded: new parameters
    assert model_state(model, CPU).identity != base.identity


def test_module_and_processor_state_count():
    model = _model()
    base = model_state(model, CPU)
    model[1].eps = 1e-3
    assert model_state(model, CPU).identity != base.identity
    model[1].eps = 1e-5
    model.eval()  # a new module trains by default: dropout, if any, switches off
    assert model_state(model, CPU).identity != base.identity

    class Processor:
        pass

    model[0].processor = Processor()
    with_processor = model_state(model, CPU)
    model[0].processor.scale = 2.0
    assert model_state(model, CPU).identity != with_processor.identity
    model[0].processor.table = torch.zeros(1000)
    first = model_state(model, CPU)
    model[0].processor.table[500] = 1  # inside: torch's repr would hide it
    assert model_state(model, CPU).digest != first.digest
    model[0].processor.fn = object()
    with pytest.raises(Unkeyable, match="processor of '0'"):
        model_state(model, CPU)


def test_hooks_refuse_unless_ours_or_declared_passive():
    model = _model()
    handle = model[0].register_forward_hook(lambda m, a, o: o * 2)
    with pytest.raises(Unkeyable, match="module '0' carries the hook"):
        model_state(model, CPU)
    hook = handle.hooks_dict_ref()[handle.id]
    assert model_state(model, CPU, own=lambda h: h is hook)  # the caller's own hook is left out
    handle.remove()

    def watch(module, args):
        return None

    handle = model[1].register_forward_pre_hook(passive(watch))
    model_state(model, CPU)
    handle.remove()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: o)
    try:
        with pytest.raises(Unkeyable, match="global forward hooks"):
            model_state(model, CPU)
    finally:
        handle.remove()
    model[0].forward = lambda x: x
    with pytest.raises(Unkeyable, match="forward replaced"):
        model_state(model, CPU)


def test_weights_that_cannot_be_read_cheaply_refuse():
    with torch.device("meta"):
        meta = torch.nn.Linear(4, 4)
    with pytest.raises(Unkeyable, match="meta device"):
        model_state(meta, CPU)
    with pytest.raises(Unkeyable, match="offloaded weights"):
        model_state(_model(), torch.device("cuda", 0))  # weights on the host, prefix computed on a GPU


def test_torch_numerics_switches_count():
    model = _model()
    base = model_state(model, CPU)
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium" if saved == "highest" else "highest")
    try:
        assert model_state(model, CPU).identity != base.identity
    finally:
        torch.set_float32_matmul_precision(saved)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model_state(model, CPU).identity != base.identity


def test_plain_values_are_read_by_content_and_objects_refuse():
    mask = torch.zeros(64, 64)
    other = mask.clone()
    other[30, 30] = 1
    (d1, t1), (d2, t2) = plain({"m": [mask]}, "kwargs"), plain({"m": [other]}, "kwargs")
    assert d1 == d2 and content_digest(t1) != content_digest(t2)  # the description leaves content to the digest
    with pytest.raises(Unkeyable, match=r"kwargs\['f'\] holds a function"):
        plain({"f": lambda: 0}, "kwargs")



def test_the_new_precision_api_is_read_and_never_crashes_the_key():
    """`torch.backends.mkldnn.matmul.fp32_precision = "bf16"` makes the legacy getter raise; the key reads every
    switch instead, and sees the change."""
    from offload_core.reuse.fingerprint import reduced_matmul_precision

    model = _model()
    base = model_state(model, CPU)
    saved = torch.backends.mkldnn.matmul.fp32_precision
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    try:
        assert model_state(model, CPU).identity != base.identity
        assert "mkldnn.matmul.fp32_precision = 'bf16'" == reduced_matmul_precision()
    finally:
        torch.backends.mkldnn.matmul.fp32_precision = saved
    assert model_state(model, CPU).identity == base.identity and reduced_matmul_precision() is None

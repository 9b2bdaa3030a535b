"""The code a forward can reach, as the reuse key sees it: every patch that changes what the forward runs changes
the identity, undoing it gives the same identity back, and nothing else moves it."""

import torch
import torch.nn.functional as F

from offload_core.codeprint import code_identity


def helper(x):
    return torch.sigmoid(x) * SCALE


SCALE = 2.0


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.act = torch.sigmoid  # a function-valued attribute

    def forward(self, x):
        return helper(self.act(self.norm(self.lin(x)))) + F.scaled_dot_product_attention(x, x, x)


def changes(apply):
    """Whether `apply()` (which returns its undo) changes the identity, and whether undoing restores it."""
    model = Block()
    before = code_identity(model)
    undo = apply(model)
    during = code_identity(model)
    undo()
    return during != before, code_identity(model) == before


def test_nothing_changed_gives_the_same_identity():
    model = Block()
    assert code_identity(model) == code_identity(model)


def test_a_function_valued_attribute_changed_is_seen():
    def apply(model):
        model.act = torch.tanh
        return lambda: setattr(model, "act", torch.sigmoid)
    assert changes(apply) == (True, True)


def test_a_class_method_of_the_models_own_class_or_of_torchs_is_seen():
    for cls in (Block, torch.nn.LayerNorm):
        original = vars(cls)["forward"]

        def apply(model, cls=cls, original=original):
            cls.forward = lambda self, x: original(self, x) * 2
            return lambda: setattr(cls, "forward", original)
        assert changes(apply) == (True, True), cls


def test_a_module_function_its_globals_and_a_torch_function_are_seen():
    g = globals()
    for name, new in (("helper", lambda x: x), ("SCALE", 3.0)):
        old = g[name]

        def apply(model, name=name, new=new, old=old):
            g[name] = new
            return lambda: g.__setitem__(name, old)
        assert changes(apply) == (True, True), name
    sdpa = F.scaled_dot_product_attention

    def patch_torch(model):
        F.scaled_dot_product_attention = lambda *a, **k: sdpa(*a, **k)
        return lambda: setattr(F, "scaled_dot_product_attention", sdpa)
    assert changes(patch_torch) == (True, True)
    sigmoid = torch.sigmoid

    def patch_sigmoid(model):  # reached through `helper`'s code, which names `torch.sigmoid`
        torch.sigmoid = torch.tanh
        return lambda: setattr(torch, "sigmoid", sigmoid)
    assert changes(patch_sigmoid) == (True, True)


def test_a_function_s_code_replaced_in_place_is_seen():
    def apply(model):
        code = helper.__code__
        helper.__code__ = (lambda x: x).__code__
        return lambda: setattr(helper, "__code__", code)
    assert changes(apply) == (True, True)


def test_code_it_cannot_read_turns_reuse_off_instead_of_failing_the_request(monkeypatch):
    import pytest

    from offload_core import codeprint
    from offload_core.fingerprint import Unkeyable, model_state

    def broken(model):
        raise RuntimeError("a class that refuses to be looked at")

    monkeypatch.setattr(codeprint, "code_identity", broken)
    monkeypatch.setattr("offload_core.fingerprint.code_identity", broken)
    with pytest.raises(Unkeyable, match="could not be read .RuntimeError: a class that refuses"):
        model_state(Block(), torch.device("cpu"))

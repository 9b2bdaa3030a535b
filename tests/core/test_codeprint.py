"""The code a forward can reach, as the reuse key sees it: every patch that changes what the forward runs changes
the identity, undoing it gives the same identity back, and nothing else moves it. The identity kept from the
last walk (`codereads`) is compared with a fresh walk at every step: the two never differ."""

import gc
import weakref

import torch
import torch.nn.functional as F

from offload_core.reuse.codeprint import code_identity


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


def identity(model) -> tuple:
    """The identity as a request gets it (kept from the last walk when nothing it read changed), checked against a
    fresh walk."""
    kept = code_identity(model)
    assert kept == code_identity(model, fresh=True), "the kept identity differs from a walk"
    return kept


def changes(apply):
    """Whether `apply()` (which returns its undo) changes the identity, and whether undoing restores it."""
    model = Block()
    before = identity(model)
    assert identity(model) == before
    undo = apply(model)
    during = identity(model)
    undo()
    return during != before, identity(model) == before


def test_nothing_changed_gives_the_same_identity():
    model = Block()
    assert identity(model) == identity(model)


def test_the_next_request_reuses_the_last_walk_only_while_nothing_it_read_changed(monkeypatch):
    from offload_core.reuse import codeprint
    model = Block()
    walks = []
    real = codeprint._Walk
    monkeypatch.setattr(codeprint, "_Walk", lambda *args: walks.append(1) or real(*args))
    code_identity(model)
    code_identity(model)
    assert len(walks) == 1  # the second request compared, it did not walk
    model.act = torch.tanh
    code_identity(model)
    assert len(walks) == 2


def test_every_part_a_walk_reads_is_seen_when_it_changes():
    """Closure cells, defaults, keyword defaults, a subclass shadowing an inherited method, a class's bases, a
    registry's entry, a builtin: each changes the identity, also once the walk is kept."""
    def make(scale):
        def closed(x, *, k=torch.relu):
            return torch.tanh(x) * scale + k(x)
        return closed

    closed = make(2.0)
    registry = {"native": torch.sigmoid}

    class Base(torch.nn.Module):
        backends = registry

        def forward(self, x, act=torch.sigmoid):
            return closed(act(x)) + len(x)

    class Sub(Base):
        pass

    class Mixin:
        pass

    def reset():
        model = Sub()
        return model, identity(model)

    def cell(model):
        closed.__closure__[0].cell_contents = 3.0
    def default(model):
        Base.forward.__defaults__ = (torch.tanh,)
    def kwdefault(model):
        closed.__kwdefaults__["k"] = torch.tanh
    def shadow(model):
        Sub.forward = lambda self, x: x
    def bases(model):
        Sub.__bases__ = (Mixin, Base)
    def entry(model):
        registry["native"] = torch.tanh
    def builtin(model):
        import builtins
        builtins.len = lambda x: 0
    for change in (cell, default, kwdefault, shadow, bases, entry, builtin):
        import builtins
        saved = (closed.__closure__[0].cell_contents, Base.forward.__defaults__, dict(closed.__kwdefaults__),
                 vars(Sub).get("forward"), Sub.__bases__, dict(registry), builtins.len)
        model, before = reset()
        change(model)
        try:
            assert identity(model) != before, change.__name__
        finally:
            closed.__closure__[0].cell_contents, Base.forward.__defaults__ = saved[0], saved[1]
            closed.__kwdefaults__.update(saved[2])
            if saved[3] is None and "forward" in vars(Sub):
                del Sub.forward
            Sub.__bases__, builtins.len = saved[4], saved[6]
            registry.update(saved[5])
        assert identity(model) == before, change.__name__


def test_a_kept_walk_keeps_no_model_alive():
    model = Block()
    model.bound = model.forward  # a bound method: holds the module
    identity(model)
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None


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

    from offload_core.reuse import codeprint
    from offload_core.reuse.fingerprint import Unkeyable, model_state

    def broken(model):
        raise RuntimeError("a class that refuses to be looked at")

    monkeypatch.setattr(codeprint, "code_reads", broken)
    monkeypatch.setattr("offload_core.reuse.fingerprint.code_reads", broken)
    with pytest.raises(Unkeyable, match="could not be read .RuntimeError: a class that refuses"):
        model_state(Block(), torch.device("cpu"))


CONFIG = {"scale": 1.0}
TABLE = [1.0, 2.0]


class _Scaler:
    def __init__(self):
        self.factor = 1.0

    def __call__(self, x):
        return x * self.factor


def test_the_values_the_code_reads_are_seen_when_they_change_in_place():
    """Defaults, a global dict and list changed in place, a module attribute, the environment, a partial's
    arguments, a callable object's state, a bound method's receiver: each changes the identity, also once the
    walk is kept, and undone gives it back (issue 51: a walk that recorded functions, not values)."""
    import functools
    import os
    import types

    def read(x, scale=2.0):
        return x * scale * CONFIG["scale"] * TABLE[0] * float(os.environ.get("KV_OFFLOAD_TEST_X", "1")) * F.SCALE

    F.SCALE = 1.0  # a plain attribute of a module the code names
    scaler = _Scaler()
    cases = {
        "default": (lambda: setattr(read, "__defaults__", (3.0,)), lambda: setattr(read, "__defaults__", (2.0,))),
        "global dict": (lambda: CONFIG.__setitem__("scale", 2.0), lambda: CONFIG.__setitem__("scale", 1.0)),
        "global list": (lambda: TABLE.__setitem__(0, 5.0), lambda: TABLE.__setitem__(0, 1.0)),
        "module attribute": (lambda: setattr(F, "SCALE", 2.0), lambda: setattr(F, "SCALE", 1.0)),
        "environment": (lambda: os.environ.__setitem__("KV_OFFLOAD_TEST_X", "2"),
                        lambda: os.environ.pop("KV_OFFLOAD_TEST_X")),
        "callable state": (lambda: setattr(scaler, "factor", 2.0), lambda: setattr(scaler, "factor", 1.0)),
    }
    try:
        for attribute in (functools.partial(read, scale=2.0), scaler, types.MethodType(_Scaler.__call__, scaler)):
            for name, (apply, undo) in cases.items():
                def change(model, apply=apply, undo=undo, attribute=attribute):
                    model.act = attribute
                    model.reader = read
                    identity(model)
                    apply()
                    return undo
                model = Block()
                model.act, model.reader = attribute, read
                before = identity(model)
                undo = change(model)
                during = identity(model)
                undo()
                if name != "callable state" or not isinstance(attribute, functools.partial):
                    assert during != before, (name, type(attribute).__name__)
                after = identity(model)
                assert after == before, (name, [(x, y) for x, y in zip(before, after) if x != y][:2])
        model = Block()
        model.act = functools.partial(read, scale=2.0)
        before = identity(model)
        model.act = functools.partial(read, scale=3.0)  # another partial of the same function
        assert identity(model) != before
    finally:
        del F.SCALE


def test_a_tensor_the_code_reads_is_compared_by_content():
    from offload_core.reuse.fingerprint import model_state

    table = torch.ones(1000)

    def read(x):
        return x * table

    model = Block()
    model.reader = read
    base = model_state(model, torch.device("cpu"))
    table[500] = 2.0  # in place: the same object, another content (torch's repr would hide it)
    assert model_state(model, torch.device("cpu")).identity != base.identity
    table[500] = 1.0
    assert model_state(model, torch.device("cpu")).identity == base.identity


def test_a_value_the_key_cannot_read_refuses_with_the_reason():
    import pytest

    from offload_core.reuse.fingerprint import Unkeyable, model_state

    class Slotted:
        __slots__ = ("factor",)

        def __call__(self, x):
            return x

    model = Block()
    model.act = Slotted()
    with pytest.raises(Unkeyable, match="holds a .*Slotted, which the reuse key cannot read"):
        model_state(model, torch.device("cpu"))


def test_torch_s_own_module_code_is_followed_into_the_functions_it_calls():
    def apply(model):
        layer_norm = F.layer_norm
        F.layer_norm = lambda *a, **k: layer_norm(*a, **k) * 2  # nn.LayerNorm.forward calls F.layer_norm
        return lambda: setattr(F, "layer_norm", layer_norm)
    assert changes(apply) == (True, True)


def test_an_attribute_that_raises_when_looked_at_refuses_instead_of_failing_the_request():
    import pytest

    from offload_core.reuse.fingerprint import Unkeyable, model_state

    class Hostile:
        def __getattribute__(self, name):
            raise RuntimeError("do not look at me")

    model = Block()
    model.__dict__["thing"] = Hostile()  # nn.Module.__setattr__ would look at it first
    with pytest.raises(Unkeyable, match="could not be read"):
        model_state(model, torch.device("cpu"))

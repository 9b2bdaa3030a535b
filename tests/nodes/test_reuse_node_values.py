"""ComfyUI's Qwen-Image 2.1 path: a change to a value the forward reads between two queued runs is a miss that
matches the model alone, and undone, the kept prefix serves again (issue 51: the key recorded the functions a
forward reaches, not the values they read)."""

import functools
import os
import types

import pytest
import torch
import torch.nn.functional as F

from kv_offload_pack.nodes.run.reuse import REUSE

from qwen21_tiny import Tiny21
from reuse_nodes_helpers import Fills, own_cache, patched, queue
from scalers import Scaler, scaled

ENV = "KV_OFFLOAD_TEST_NODE_SCALE"
SOURCE = '''
def make(original):
    scale = torch.ones(())
    def _qkv(self, i, x, factor=1.0):
        factor = factor * scale * SCALE_T * CONFIG["scale"] * settings.SCALE * float(os.environ.get(ENV, "1.0"))
        return tuple(t * factor for t in original(self, i, x))
    return _qkv
'''


@pytest.fixture(autouse=True)
def _empty_registry():
    REUSE.reset()
    yield
    REUSE.reset()


def _attention(monkeypatch, make):
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", make(sdpa))
    return sdpa


def _main_patch(monkeypatch):
    """`Tiny21._qkv` patched by code of `__main__` that reads a default, a closure tensor, a global tensor, a
    global dict, a module attribute and an environment variable."""
    settings = types.ModuleType("kv_offload_test_node_settings")
    settings.SCALE = 1.0
    scope = {"__name__": "__main__", "torch": torch, "os": os, "ENV": ENV, "SCALE_T": torch.ones(()),
             "CONFIG": {"scale": 1.0}, "settings": settings}
    exec(compile(SOURCE, "<__main__>", "exec"), scope)  # noqa: S102 - builds a function of `__main__`
    patch = scope["make"](Tiny21._qkv)
    monkeypatch.setattr(Tiny21, "_qkv", patch)
    closure = next(c.cell_contents for c in patch.__closure__ if torch.is_tensor(c.cell_contents))
    return scope, patch, closure


def _change(kind, monkeypatch):
    """Puts the starting state of `kind` in force; returns (change, undo)."""
    if kind == "partial":
        sdpa = _attention(monkeypatch, lambda f: functools.partial(scaled, f, 1.0))
        return (lambda: setattr(F, "scaled_dot_product_attention", functools.partial(scaled, sdpa, 1.01)),
                lambda: setattr(F, "scaled_dot_product_attention", functools.partial(scaled, sdpa, 1.0)))
    if kind == "callable":
        _attention(monkeypatch, lambda f: Scaler(f, 1.0))
        return (lambda: setattr(F.scaled_dot_product_attention, "factor", 1.01),
                lambda: setattr(F.scaled_dot_product_attention, "factor", 1.0))
    scope, patch, closure = _main_patch(monkeypatch)
    return {
        "default": (lambda: setattr(patch, "__defaults__", (1.01,)), lambda: setattr(patch, "__defaults__", (1.0,))),
        "closure tensor": (lambda: closure.fill_(1.01), lambda: closure.fill_(1.0)),
        "global tensor": (lambda: scope["SCALE_T"].fill_(1.01), lambda: scope["SCALE_T"].fill_(1.0)),
        "global dict": (lambda: scope["CONFIG"].update(scale=1.01), lambda: scope["CONFIG"].update(scale=1.0)),
        "module attribute": (lambda: setattr(scope["settings"], "SCALE", 1.01),
                             lambda: setattr(scope["settings"], "SCALE", 1.0)),
        "environment": (lambda: os.environ.__setitem__(ENV, "1.01"), lambda: os.environ.pop(ENV, None)),
    }[kind]


@pytest.mark.parametrize("kind", ["partial", "callable", "default", "closure tensor", "global tensor",
                                  "global dict", "module attribute", "environment"])
def test_a_value_the_forward_reads_changed_between_two_queued_runs_is_a_miss(kind, monkeypatch):
    change, undo = _change(kind, monkeypatch)
    dm = Tiny21()
    m = patched(dm)
    fills = Fills(dm, prefix_len=8)
    unchanged, unchanged_1 = own_cache(0), own_cache(1)
    assert torch.equal(queue(dm, m, seed=0), unchanged)
    kept = fills.count
    change()
    try:
        changed = own_cache(1)
        assert not torch.equal(changed, unchanged_1), "the change changes nothing: it tests nothing"
        assert torch.equal(queue(dm, m, seed=1), changed) and fills.count == 2 * kept  # filled again
    finally:
        undo()
    assert torch.equal(queue(dm, m, seed=0), unchanged) and fills.count == 2 * kept  # the first prefix again

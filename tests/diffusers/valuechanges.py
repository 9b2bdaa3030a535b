"""Changes to the values a forward reads, not to the functions it reaches (issue 51): each a stale hit before.

`SETUPS[name](pipe)` puts the state a change starts from (a partial registered as the attention backend, a class
patched from `__main__`) and returns its undo; `VALUE_CHANGES[name](pipe)` then makes one change and returns its
undo, restoring the exact bits. A case without a setup starts from the pipeline as it is.
"""

from __future__ import annotations

import functools
import os
import types

import torch
import torch.nn.functional as F

from changes import _k_weight, _patch
from scalers import Scaler, scaled

ENV = "KV_OFFLOAD_TEST_SCALE"


def pair_sign_flips(pipe):
    """One input column of K's weight negated: bit 63 of an even number of 64-bit words (a linear digest's
    blind spot). Negating again restores the bits."""
    weight = _k_weight(pipe)
    column = 1 if weight.element_size() == 4 else 3
    weight.data[:, column].neg_()
    return lambda: weight.data[:, column].neg_()


def scale_default(pipe):
    """`dispatch_attention_fn`'s `scale` default changed (the processors do not pass it)."""
    from diffusers.models import attention_dispatch

    fn = attention_dispatch.dispatch_attention_fn
    saved = fn.__defaults__
    names = fn.__code__.co_varnames[fn.__code__.co_argcount - len(saved):fn.__code__.co_argcount]
    fn.__defaults__ = tuple(0.3 if n == "scale" else d for n, d in zip(names, saved))
    return lambda: setattr(fn, "__defaults__", saved)


def torch_norms(pipe):
    """`F.layer_norm` and `F.rms_norm` replaced: torch's own `nn.LayerNorm` / `nn.RMSNorm` call them."""
    undo = [_patch(F, name, lambda f: lambda *a, **k: f(*a, **k) * 1.01) for name in ("layer_norm", "rms_norm")]
    return lambda: [u() for u in undo]


# -- a backend held as a partial or a callable object ------------------------------------------------------------
def _backends():
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    return _AttentionBackendRegistry._backends, AttentionBackendName.NATIVE


def _set_backend(make):
    backends, name = _backends()
    original = backends[name]
    backends[name] = make(original)
    return lambda: backends.__setitem__(name, original)


def partial_backend_setup(pipe):
    return _set_backend(lambda original: functools.partial(scaled, original, 1.0))


def partial_backend(pipe):
    """The `native` partial swapped for another partial of the same function."""
    return _set_backend(lambda current: functools.partial(current.func, current.args[0], 1.01))


def callable_backend_setup(pipe):
    return _set_backend(lambda original: Scaler(original, 1.0))


def callable_backend(pipe):
    """The callable object registered as `native`: its attribute changed."""
    backends, name = _backends()
    backends[name].factor = 1.01
    return lambda: setattr(backends[name], "factor", 1.0)


# -- an activation held as a partial or a bound method -----------------------------------------------------------
def _activation(pipe):
    ff = next(m for m in pipe.transformer.modules() if isinstance(getattr(m, "activation_fn", None) or
                                                                   getattr(m, "gate_fn", None), torch.nn.SiLU))
    return ff, "activation_fn" if isinstance(getattr(ff, "activation_fn", None), torch.nn.SiLU) else "gate_fn"


def _set_activation(pipe, value):
    ff, name = _activation(pipe)
    module = ff._modules.pop(name)
    setattr(ff, name, value)

    def undo():
        delattr(ff, name)
        ff._modules[name] = module
    return undo


def gelu_partial_setup(pipe):
    return _set_activation(pipe, functools.partial(F.gelu, approximate="none"))


def _activation_holder(pipe):
    ff = next(m for m in pipe.transformer.modules()
              if any(not isinstance(v, torch.nn.Module) and callable(v) for k, v in vars(m).items()
                     if k in ("activation_fn", "gate_fn")))
    return ff, "activation_fn" if "activation_fn" in vars(ff) else "gate_fn"


def gelu_partial(pipe):
    """The activation partial swapped for `functools.partial(F.gelu, approximate="tanh")`."""
    ff, name = _activation_holder(pipe)
    saved = vars(ff)[name]
    setattr(ff, name, functools.partial(F.gelu, approximate="tanh"))
    return lambda: setattr(ff, name, saved)


def _apply(self, x):
    return self.fn(x) * self.factor


def bound_method_setup(pipe):
    return _set_activation(pipe, types.MethodType(_apply, Scaler(F.silu, 1.0)))


def bound_method(pipe):
    """The activation is a bound method over a callable object: the receiver's state changed."""
    ff, name = _activation_holder(pipe)
    receiver = vars(ff)[name].__self__
    receiver.factor = 1.01
    return lambda: setattr(receiver, "factor", 1.0)


# -- a class patched from __main__, reading values at call time --------------------------------------------------
_MAIN_SOURCE = '''
def make(original):
    scale = torch.ones(())
    def forward(self, x):
        value = original(self, x) * scale * SCALE_T * CONFIG["scale"] * settings.SCALE
        return value * float(os.environ.get(ENV, "1.0"))
    return forward
'''


def main_patch_setup(pipe):
    """The `forward` of the K norm's class patched by code defined in `__main__` (a user's script), which reads
    a tensor in a closure cell, a global tensor, a global dict, a module's attribute and an environment variable."""
    settings = types.ModuleType("kv_offload_test_settings")
    settings.SCALE = 1.0
    scope = {"__name__": "__main__", "torch": torch, "os": os, "ENV": ENV, "SCALE_T": torch.ones(()),
             "CONFIG": {"scale": 1.0}, "settings": settings}
    exec(compile(_MAIN_SOURCE, "<__main__>", "exec"), scope)  # noqa: S102 - builds a function of `__main__`
    cls = type(pipe.transformer.transformer_blocks[0].attn.norm_k)
    original = vars(cls)["forward"]
    forward = cls.forward = scope["make"](original)
    MAIN[:] = [scope, next(c.cell_contents for c in forward.__closure__ if torch.is_tensor(c.cell_contents))]
    return lambda: setattr(cls, "forward", original)


MAIN: list = []  # (the patch's globals, the tensor in its closure) while the setup is in force


def main_closure_tensor(pipe):
    MAIN[1].fill_(1.01)
    return lambda: MAIN[1].fill_(1.0)


def main_global_tensor(pipe):
    MAIN[0]["SCALE_T"].fill_(1.01)
    return lambda: MAIN[0]["SCALE_T"].fill_(1.0)


def main_global_dict(pipe):
    MAIN[0]["CONFIG"]["scale"] = 1.01
    return lambda: MAIN[0]["CONFIG"].__setitem__("scale", 1.0)


def main_module_attribute(pipe):
    settings = MAIN[0]["settings"]
    settings.SCALE = 1.01
    return lambda: setattr(settings, "SCALE", 1.0)


def main_environment(pipe):
    os.environ[ENV] = "1.01"
    return lambda: os.environ.pop(ENV, None)


VALUE_CHANGES = {
    "pair_sign_flips": pair_sign_flips, "scale_default": scale_default, "torch_norms": torch_norms,
    "partial_backend": partial_backend, "callable_backend": callable_backend, "gelu_partial": gelu_partial,
    "bound_method": bound_method, "main_closure_tensor": main_closure_tensor, "main_global_tensor": main_global_tensor,
    "main_global_dict": main_global_dict, "main_module_attribute": main_module_attribute,
    "main_environment": main_environment,
}
SETUPS = {
    "partial_backend": partial_backend_setup, "callable_backend": callable_backend_setup,
    "gelu_partial": gelu_partial_setup, "bound_method": bound_method_setup,
    **{name: main_patch_setup for name in VALUE_CHANGES if name.startswith("main_")},
}


# The property run's scenes: setups that can be in force together, and the changes of `changes.CHANGES` that
# would undo them out of order (another function registered under `native`).
SCENES = {
    "partials": (("partial_backend", "gelu_partial", "main_global_dict"), {"native_backend"}),
    "objects": (("callable_backend", "bound_method", "main_global_dict"), {"native_backend"}),
}


def scene(pipe, name):
    """Puts the setups of scene `name` in force; returns (their undo, the value changes they make possible,
    the changes to leave out)."""
    names, excluded = SCENES[name]
    undo = [SETUPS[n](pipe) for n in names]
    possible = {n: c for n, c in VALUE_CHANGES.items() if n not in SETUPS or SETUPS[n] in {SETUPS[m] for m in names}}
    return (lambda: [u() for u in reversed(undo)]), possible, excluded

"""Changes that may alter a prefix's K/V, each applied to a pipeline and undone exactly.

The catalogue the stale-reuse tests and the long property run draw from. `apply(pipe)` makes one change and
returns the function that undoes it (restoring the exact bits). Each names the case of issue 19 it covers.
"""

from __future__ import annotations

import contextlib
import functools

import torch


def _k_weight(pipe) -> torch.nn.Parameter:
    return pipe.transformer.transformer_blocks[0].attn.to_k.weight


def data_edit(pipe):
    """A weight edited through `.data` away from any sampled element: the version counter does not move."""
    weight = _k_weight(pipe)
    saved = weight.data[0, 1].clone()
    weight.data[0, 1] += 0.5
    return lambda: weight.data[0, 1].copy_(saved)  # that element only: other changes to the weight stay


def tiny_data_edit(pipe):
    """One weight moved by one unit in the last place: float sums would round it away."""
    weight = _k_weight(pipe)
    saved = weight.data[-1, -1].clone()
    weight.data[-1, -1] = torch.nextafter(saved, torch.tensor(float("inf")))
    return lambda: weight.data[-1, -1].copy_(saved)


def forward_hook(pipe):
    """A user's forward hook on a block that changes its output."""
    block = pipe.transformer.transformer_blocks[0]

    def scale(module, args, output):
        if isinstance(output, tuple):
            return tuple(o * 1.01 if torch.is_tensor(o) else o for o in output)
        return output * 1.01

    return block.register_forward_hook(scale).remove


def pre_hook(pipe):
    """A user's forward pre-hook on an attention module (sees, and may change, its input)."""
    attn = pipe.transformer.transformer_blocks[-1].attn

    def nudge(module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        if hidden is None:
            return None
        return (hidden * 1.01, *args[1:]) if args else (args, {**kwargs, "hidden_states": hidden * 1.01})

    return attn.register_forward_pre_hook(nudge, with_kwargs=True).remove


class _Scale:
    """A hook in diffusers' own hook registry (the mechanism of `apply_layer_skip`, caches, offloading)."""

    def __call__(self, pipe):
        from diffusers.hooks.hooks import HookRegistry, ModelHook

        class ScaleOutput(ModelHook):
            def post_forward(self, module, output):
                return tuple(o * 1.01 if torch.is_tensor(o) else o for o in output) if isinstance(output, tuple) \
                    else output * 1.01

        block = pipe.transformer.transformer_blocks[0]
        HookRegistry.check_if_exists_or_initialize(block).register_hook(ScaleOutput(), "scale_output")
        return lambda: HookRegistry.check_if_exists_or_initialize(block).remove_hook("scale_output")


diffusers_hook = _Scale()


def processor_attribute(pipe):
    """The same processor class with other instance state: each processor's own attention backend."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    processors = [m.processor for m in pipe.transformer.modules() if getattr(m, "processor", None) is not None]
    for processor in processors:
        processor._attention_backend = AttentionBackendName._NATIVE_MATH

    def undo():
        for processor in processors:
            del processor._attention_backend

    return undo


def module_attribute(pipe):
    """A plain attribute of a module changed (e.g. a norm's eps)."""
    norm = pipe.transformer.transformer_blocks[0].attn.norm_k
    saved = norm.eps
    norm.eps = saved * 1e6

    def undo():
        norm.eps = saved

    return undo


class _Backend:
    """`with attention_backend(...)` around the call: entered on apply, left on undo."""

    def __call__(self, pipe):
        from diffusers.models.attention_dispatch import attention_backend

        stack = contextlib.ExitStack()
        stack.enter_context(attention_backend("_native_math"))
        return stack.close


attention_backend_context = _Backend()


def tf32(pipe):
    """The float32 matmul precision switch (what TF32 does on a GPU)."""
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium" if saved == "highest" else "highest")
    return lambda: torch.set_float32_matmul_precision(saved)


def tf32_changes_matmuls() -> bool:
    """Whether the precision switch changes a float32 matmul on this machine: on a CPU without a lower-precision
    matmul (no bf16 in its vector unit) it changes nothing, and a stale hit across it could not show."""
    a, b = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)), torch.randn(64, 64)
    undo = tf32(None)
    try:
        lower = a @ b
    finally:
        undo()
    return not torch.equal(lower, a @ b)


CHANGES = {
    "data_edit": data_edit,
    "tiny_data_edit": tiny_data_edit,
    "forward_hook": forward_hook,
    "pre_hook": pre_hook,
    "diffusers_hook": diffusers_hook,
    "processor_attribute": processor_attribute,
    "module_attribute": module_attribute,
    "attention_backend": attention_backend_context,
    "tf32": tf32,
}


# -- code: what the forward reaches through a name at call time (issue 31) -------------------------------------
def _patch(owner, name, wrap):
    """Sets `owner.name` to `wrap(original)`; returns the undo (the original object put back)."""
    original = vars(owner)[name] if isinstance(owner, type) else getattr(owner, name)
    setattr(owner, name, wrap(original))
    return lambda: setattr(owner, name, original)


def class_forward(pipe):
    """The `forward` of a module's class replaced (a class-level monkeypatch, as speed-up packages do)."""
    cls = type(pipe.transformer.transformer_blocks[0].attn.norm_k)
    return _patch(cls, "forward", lambda forward: lambda self, x: forward(self, x) * 1.01)


def processor_call(pipe):
    """The `__call__` of the attention processor's class replaced."""
    cls = type(pipe.transformer.transformer_blocks[0].attn.processor)

    def wrap(call):
        @functools.wraps(call)  # diffusers reads the signature to pick the kwargs it passes
        def scaled(self, *args, **kwargs):
            out = call(self, *args, **kwargs)
            return tuple(o * 1.01 for o in out) if isinstance(out, tuple) else out * 1.01
        return scaled
    return _patch(cls, "__call__", wrap)


def native_backend(pipe):
    """Another function registered under diffusers' `native` attention backend (what kernel packages do)."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    backends, name = _AttentionBackendRegistry._backends, AttentionBackendName.NATIVE
    original = backends[name]
    backends[name] = lambda *args, **kwargs: original(*args, **kwargs) * 1.01
    return lambda: backends.__setitem__(name, original)


def torch_function(pipe):
    """A torch function patched globally: `F.scaled_dot_product_attention`, which the native backend calls."""
    return _patch(torch.nn.functional, "scaled_dot_product_attention",
                  lambda sdpa: lambda *args, **kwargs: sdpa(*args, **kwargs) * 1.01)


def function_attribute(pipe):
    """A module attribute that holds a function changed (an activation `torch.sigmoid` -> `torch.tanh`): the
    first feed-forward's activation module is a plain function for the whole change, then another one."""
    ff = next(m for m in pipe.transformer.modules() if isinstance(getattr(m, "activation_fn", None) or
                                                                   getattr(m, "gate_fn", None), torch.nn.SiLU))
    name = "activation_fn" if isinstance(getattr(ff, "activation_fn", None), torch.nn.SiLU) else "gate_fn"
    module = ff._modules.pop(name)
    setattr(ff, name, torch.tanh)  # torch.nn.functional.silu was the original; tanh changes the image

    def undo():
        delattr(ff, name)
        ff._modules[name] = module
    return undo


def module_function(pipe):
    """A module-level function of the model's code replaced (its rotary embedding, which K goes through)."""
    import sys

    module = sys.modules[type(pipe.transformer).__module__]
    name = next(n for n in ("apply_rotary_emb_qwen", "apply_rotary_emb") if n in vars(module))

    def wrap(rotate):
        @functools.wraps(rotate)
        def scaled(*args, **kwargs):
            out = rotate(*args, **kwargs)
            return tuple(o * 1.01 for o in out) if isinstance(out, tuple) else out * 1.01
        return scaled
    return _patch(module, name, wrap)


CHANGES.update({"class_forward": class_forward, "processor_call": processor_call, "native_backend": native_backend,
                "torch_function": torch_function, "function_attribute": function_attribute,
                "module_function": module_function})

"""What a torch model computes a prefix with, as a reuse key can see it — or why it cannot.

A prefix key must cover everything that can change the prefix's K/V (DESIGN.md §3c). For the model that is:

- the weights and buffers by their full content: `contentdigest.content_digest` hashes every byte of every
  tensor on the device it lives on (a write through `.data`, which torch's version counters never see,
  included);
- the module tree's state: every module's own attributes by content (`valueprint`: plain values, tensors by
  content — PEFT's adapter state, scalings, cached rope tables —, partials, callable objects by their state),
  its training flag, compiled or not, each attention processor's class and instance state;
- everything wrapped around the forward: torch forward hooks and pre-hooks on any module (global ones too),
  a replaced `forward`, active torch function / dispatch modes; and the torch numerics flags (TF32, every
  float32 precision switch, reduced precision reductions, SDPA backends, autocast);
- the code the forward can reach and the values it reads (`codeprint.code_reads`): a patched class or
  processor, a replaced module or torch function, a backend registered under another function, a default, a
  closure cell, a global or a module attribute changed, the environment; the tensors it reads by content.

It fails closed: whatever it cannot read (a user's hook, an object with `__slots__`, weights on the meta
device) raises `Unkeyable` with the reason, and the caller turns reuse off for that request. Hooks
the caller installed itself are passed in as `own` and skipped, and so are hooks declared `passive` (they
only observe). Weights that live on another device than the
one computing (model CPU offload, group offloading) are refused too: hashing them every request would cost
more than a hit saves.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable, List, Optional, Tuple

import torch

from .codeprint import code_reads
from .contentdigest import content_digest
from .valueprint import Unkeyable, Values

_PLAIN = (bool, int, float, str, bytes, type(None), torch.dtype, torch.device)
# read on their own: weights, submodules, the processor, hooks (diffusers' registry is added by a pipeline's first
# call: read as an attribute, it made the first request's key one no later request could match)
_SKIPPED_ATTRS = {"_parameters", "_buffers", "_modules", "training", "processor", "_compiled_call_impl",
                  "_diffusers_hook"}


@dataclass(frozen=True)
class ModelState:
    """A model as it affects its outputs now. `identity` is plain and hashable; `digest` covers every weight byte;
    `seconds` is what computing both cost (reported in the reuse stats)."""

    identity: tuple
    digest: bytes
    seconds: float


# -- plain values ----------------------------------------------------------------------------------------------
def plain(value, where: str) -> Tuple[object, List[torch.Tensor]]:
    """`(hashable description, tensors)` of `value`: scalars, strings, dtypes and containers of them; tensors are
    returned to be compared by content (their shape and dtype go into the description). Anything else raises
    `Unkeyable` naming `where` — its repr could hide what changed (torch abbreviates large tensors)."""
    tensors: List[torch.Tensor] = []
    return _plain(value, where, tensors), tensors


def _plain(value, where: str, tensors: List[torch.Tensor]):
    if isinstance(value, _PLAIN):
        return (type(value).__name__, repr(value))
    if torch.is_tensor(value):
        tensors.append(value.detach())
        return ("tensor", tuple(value.shape), str(value.dtype))
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        return (type(value).__name__, tuple(_plain(v, f"{where}[{i}]", tensors) for i, v in enumerate(items)))
    if isinstance(value, dict):
        return ("dict", tuple((repr(k), _plain(v, f"{where}[{k!r}]", tensors))
                              for k, v in sorted(value.items(), key=lambda kv: repr(kv[0]))))
    fields = getattr(value, "__dataclass_fields__", None)
    if fields is not None:
        return (type(value).__qualname__, tuple((n, _plain(getattr(value, n), f"{where}.{n}", tensors)) for n in fields))
    raise Unkeyable(f"{where} holds a {type(value).__qualname__}, which the reuse key cannot read")


# -- the model -------------------------------------------------------------------------------------------------
def model_state(module: torch.nn.Module, compute_device: torch.device,
                own: Callable[[object], bool] = lambda hook: False) -> ModelState:
    """The `ModelState` of `module` as it will compute on `compute_device`; raises `Unkeyable`.

    `own(hook)`: True for hooks the caller installed (they do not change the prefix and are left out).
    """
    start = time.perf_counter()
    tensors = list(module.named_parameters()) + list(module.named_buffers())
    _check_placement(tensors, compute_device)
    try:
        tree, state_tensors = _module_tree(module, own)
    except Unkeyable:
        raise
    except Exception as exc:  # noqa: BLE001 - an attribute that refuses to be looked at: refuse, never crash
        raise Unkeyable(f"the module tree's state could not be read ({type(exc).__name__}: {exc})") from exc
    code, code_tensors = _code(module)
    identity = (id(module), type(module).__qualname__, torch_state(compute_device),
                tuple((name, tuple(t.shape), str(t.dtype)) for name, t in tensors), tree, code,
                content_digest(code_tensors))  # apart from the weights': a change there is not new weights
    digest = content_digest([t for _, t in tensors] + state_tensors)
    return ModelState(identity, digest, time.perf_counter() - start)


def _code(module: torch.nn.Module) -> Tuple[tuple, List[torch.Tensor]]:
    """`codeprint.code_reads`, failing closed: code it cannot read (an object that refuses to be hashed or
    looked at) turns reuse off for the request instead of failing it."""
    try:
        return code_reads(module)
    except Unkeyable:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure to read the code is a reason to refuse, never to crash
        raise Unkeyable(f"the code its forward reaches could not be read ({type(exc).__name__}: {exc})") from exc


def _check_placement(tensors, compute_device: torch.device) -> None:
    for name, t in tensors:
        if t.device.type == "meta":
            raise Unkeyable(f"the weight {name!r} is on the meta device, so its content cannot be read")
        if compute_device.type != "cpu" and t.device != compute_device and t.device.type != compute_device.type:
            raise Unkeyable(f"the weight {name!r} lives on {t.device} while the prefix is computed on "
                            f"{compute_device} (offloaded weights): hashing them every request would cost more "
                            "than a hit saves")


def _module_tree(module: torch.nn.Module, own) -> Tuple[tuple, List[torch.Tensor]]:
    _check_hooks("torch's global forward hooks", _global_hooks(), own)
    modes = _active_modes()
    if modes:
        raise Unkeyable(f"a torch {modes} mode is active around the call")
    parts = []
    values = Values(tree=frozenset(map(id, module.modules())))
    for name, sub in module.named_modules():
        where = name or type(module).__name__
        _check_hooks(f"module {where!r}", _hooks_of(sub), own)
        if _forward_replaced(sub):
            raise Unkeyable(f"module {where!r} has its forward replaced (an accelerate or diffusers hook, or a "
                            "patch), which the reuse key cannot read")
        processor = getattr(sub, "processor", None)
        parts.append((name, type(sub).__qualname__, sub.training, getattr(sub, "_compiled_call_impl", None) is not None,
                      _attributes(sub, values, f"module {where!r}"), type(processor).__qualname__,
                      values.describe(vars(processor) if processor is not None else {}, f"the processor of {where!r}")))
    return tuple(parts), values.tensors


def _forward_replaced(sub: torch.nn.Module) -> bool:
    """An instance `forward` other than the class's own (diffusers' hook registry puts the original back as an
    instance attribute when its last hook goes)."""
    forward = vars(sub).get("forward")
    if forward is None:
        return False
    return not (getattr(forward, "__func__", None) is type(sub).forward and getattr(forward, "__self__", None) is sub)


def _attributes(sub: torch.nn.Module, values: Values, where: str) -> tuple:
    """A module's own attributes by content (`valueprint`: tensors by content, objects by type and state,
    functions by identity; their code is walked by `codeprint`)."""
    return tuple((name, values.describe(value, f"{where}.{name}")) for name, value in sorted(vars(sub).items())
                 if not (name in _SKIPPED_ATTRS or name.startswith(_HOOK_DICTS)))


_HOOK_DICTS = ("_forward", "_backward", "_state_dict", "_load_state")


def _hooks_of(sub: torch.nn.Module) -> Iterable[object]:
    yield from sub._forward_pre_hooks.values()
    yield from sub._forward_hooks.values()
    registry = getattr(sub, "_diffusers_hook", None)
    if registry is not None:
        yield from getattr(registry, "hooks", {}).values()


def _global_hooks() -> Iterable[object]:
    from torch.nn.modules import module as torch_module

    yield from torch_module._global_forward_pre_hooks.values()
    yield from torch_module._global_forward_hooks.values()


def passive(hook):
    """Declares that `hook` (a function or bound method, before it is registered or installed) never changes what
    its module computes — it only observes (logging, timing, progress, a counter) — so a reuse key may leave it
    out, and does not follow what it reads. Returns `hook`."""
    getattr(hook, "__func__", hook)._kv_offload_passive = True
    return hook


def _check_hooks(where: str, hooks: Iterable[object], own) -> None:
    for hook in hooks:
        if not (own(hook) or getattr(hook, "_kv_offload_passive", False) is True):
            name = getattr(hook, "__qualname__", None) or type(hook).__qualname__
            raise Unkeyable(f"{where} carries the hook {name}, whose effect the reuse key cannot read")


def _active_modes() -> Optional[str]:
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    if _get_current_function_mode_stack():
        return "function"
    if _get_current_dispatch_mode_stack():
        return "dispatch"
    return None


def torch_state(device: torch.device) -> tuple:
    """The process-wide torch switches that change what a matmul or an attention computes on `device`."""
    kind = device.type
    state = [*fp32_precisions().items(), torch.are_deterministic_algorithms_enabled(),
             torch.is_autocast_enabled(kind), str(torch.get_autocast_dtype(kind)) if torch.is_autocast_enabled(kind) else None]
    cuda = torch.backends.cuda
    state += [cuda.matmul.allow_tf32, cuda.matmul.allow_fp16_reduced_precision_reduction,
              cuda.matmul.allow_bf16_reduced_precision_reduction, torch.backends.cudnn.allow_tf32,
              cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled()]
    return tuple(repr(s) for s in state)


_FP32_SWITCHES = ("fp32_precision", "cuda.matmul.fp32_precision", "cudnn.fp32_precision", "cudnn.conv.fp32_precision",
                  "cudnn.rnn.fp32_precision", "mkldnn.fp32_precision", "mkldnn.matmul.fp32_precision",
                  "mkldnn.conv.fp32_precision", "mkldnn.rnn.fp32_precision")
FULL_PRECISION = {"highest", "none", "ieee"}  # what the legacy and the new precision API call full float32


def fp32_precisions() -> dict:
    """Every float32 precision switch torch has, by name. The legacy `get_float32_matmul_precision()` raises
    once the new per-backend API (`torch.backends.mkldnn.matmul.fp32_precision = "bf16"`) set a mixed state: it
    is then "mixed", and the per-backend values say what is in force."""
    try:
        legacy = torch.get_float32_matmul_precision()
    except RuntimeError:
        legacy = "mixed"
    out = {"float32_matmul_precision": legacy}
    for path in _FP32_SWITCHES:
        value = torch.backends
        for part in path.split("."):
            value = getattr(value, part, None)
        if value is not None:
            out[path] = str(value)
    return out


def reduced_matmul_precision() -> Optional[str]:
    """The first float32 matmul precision switch set below full precision, as `name = value`; None if none is."""
    switches = fp32_precisions()
    legacy = switches.pop("float32_matmul_precision")  # last: a "mixed" one is named by the switch that made it
    matmuls = {k: v for k, v in switches.items() if "conv" not in k and "rnn" not in k and k != "cudnn.fp32_precision"}
    for name, value in [*matmuls.items(), ("float32_matmul_precision", legacy)]:
        if value not in FULL_PRECISION:
            return f"{name} = {value!r}"
    return None

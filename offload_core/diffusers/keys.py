"""The diffusers part of a prefix reuse key: which hooks are ours, the attention backend, and the numerics under
which a hit is proven to give a fresh request's bits (the rest is `offload_core.fingerprint`)."""

from __future__ import annotations

from ..reuse.fingerprint import Unkeyable, reduced_matmul_precision


def ours(hook):
    """Marks a hook this adapter installs: the reuse key leaves it out (it does not change the prefix)."""
    hook._kv_offload = True
    return hook


def is_ours(hook) -> bool:
    return getattr(hook, "_kv_offload", False) is True


PROVEN_BACKENDS = {"native"}  # where a hit (a cached step 0) is bit-identical to an extract step 0, by test


def check_numerics(transformer) -> None:
    """Refuses numerics under which a hit is not proven bit-identical to a fresh request. A hit runs step 0 as a
    cached call (target queries only), a fresh request as an extract call (every query): under an attention
    backend or a matmul precision whose kernels round differently for another number of rows (`_native_math`;
    float32 matmuls in reduced precision, "high" / "medium", TF32 on a GPU) the image changes in its last bits
    although the prefix is the same. Found by the property run (tests/diffusers/reuse_property.py)."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    precision = reduced_matmul_precision()
    if precision is not None:
        raise Unkeyable(f"float32 matmuls run at reduced precision ({precision}), under which a hit is not proven to "
                        "give the same bits as a fresh request (set it back to full precision)")
    names = {str(getattr(_AttentionBackendRegistry.get_active_backend()[0], "value", "?"))}
    names |= {str(getattr(m.processor._attention_backend, "value", m.processor._attention_backend))
              for m in transformer.modules()
              if getattr(getattr(m, "processor", None), "_attention_backend", None) is not None}
    unproven = sorted(names - PROVEN_BACKENDS)
    if unproven:
        raise Unkeyable(f"the attention backend {', '.join(unproven)} is not proven to give a hit the same bits as "
                        "a fresh request (its kernels may round differently for a cached step)")


def attention_backend() -> str:
    """diffusers' attention backend in force (`attention_backend(...)` context or `set_active_backend`)."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    name, _ = _AttentionBackendRegistry.get_active_backend()
    return f"{name}, checks {_AttentionBackendRegistry._checks_enabled}"

"""Shared by the lifetime suites: what holds cached K/V right now, what is alive when the VAE decodes, and an
exception raised from inside the denoising loop."""

import gc


def resident_prefix_tensors():
    """Layer caches (upstream classes and ours) that hold K/V tensors right now."""
    from diffusers.models.transformers.transformer_flux2 import Flux2KVLayerCache
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVLayerCache

    held = []
    for obj in gc.get_objects():
        if issubclass(type(obj), QwenImage21KVLayerCache) and obj.k is not None:
            held.append(obj)
        elif issubclass(type(obj), Flux2KVLayerCache) and obj.k_ref is not None:
            held.append(obj)
    return held


class DecodeProbe:
    """Wraps `vae.decode` on the class (under the adapter's instance guard) and records what is alive."""

    def __init__(self, monkeypatch, vae, store_log):
        self.calls = []
        original = type(vae).decode

        def decode(vae_self, *args, **kwargs):
            self.calls.append((len(store_log.live), len(resident_prefix_tensors())))
            return original(vae_self, *args, **kwargs)

        monkeypatch.setattr(type(vae), "decode", decode)


class Boom(RuntimeError):
    pass


def raise_at_step(step):
    def callback(pipe, i, t, kwargs):
        if i == step:
            raise Boom(f"raised inside the denoising loop at step {i}")
        return kwargs

    return callback

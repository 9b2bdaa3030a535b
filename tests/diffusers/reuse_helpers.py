"""What the reuse tests observe: the sequence lengths blocks see, and the upstream prefix K/V of a request."""

import torch

from offload_core import passive

BIG = {"device": 1 << 30, "host": 1 << 30, "file": 1 << 30}  # room for every tiny cache, on every place


class SeqLens:
    """Sequence lengths the first transformer block sees, call by call (an extract call sees the prefix too)."""

    def __init__(self, pipe):
        self.seen = []
        self._handle = pipe.transformer.transformer_blocks[0].register_forward_pre_hook(passive(self._hook), with_kwargs=True)

    def _hook(self, module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        self.seen.append(hidden.shape[1])

    def take(self):
        seen, self.seen = self.seen, []
        return seen

    def remove(self):
        self._handle.remove()


class UpstreamKV:
    """Copies of the prefix K/V the unpatched pipeline extracts, per extract call, as lists of layer tensors."""

    def __init__(self, pipe):
        self.calls = []
        t = pipe.transformer
        self._handles = [t.register_forward_hook(passive(self._hook), with_kwargs=True)]

    def _hook(self, module, args, kwargs, output):
        if kwargs.get("kv_cache_mode") != "extract":
            return None
        cache = kwargs.get("kv_cache")
        if cache is not None and hasattr(cache, "layer_caches"):  # Qwen-Image 2.1: the pipeline's own container
            self.calls.append([torch.cat([c.k, c.v]).clone() for c in cache.layer_caches])
        else:  # FLUX.2: the transformer returns the cache it built
            built = output[1] if isinstance(output, tuple) else output.kv_cache
            layers = [*built.double_block_caches, *built.single_block_caches]
            self.calls.append([torch.cat([c.k_ref, c.v_ref]).clone() for c in layers])
        return None

    def remove(self):
        for h in self._handles:
            h.remove()


def same_kv(a, b) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))

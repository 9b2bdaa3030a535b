"""What a benchmark request holds, as the process and the unpatched pipeline show it: the peak resident set
size (`RssPeak`) and the K/V bytes of the pipeline's own cache (`UpstreamKVProbe`), for the rows without our
store."""

from __future__ import annotations

import re

import psutil
import torch


class RssPeak:
    """Peak resident set size of this process during a request.

    Linux: the kernel's high-water mark (VmHWM), reset per request through /proc/self/clear_refs, so nothing
    is missed between samples. Elsewhere: the RSS after the request (a lower bound), flagged as such.
    """

    def __init__(self):
        self.exact = self._reset()

    @staticmethod
    def _reset() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError:
            return False

    def start(self) -> None:
        self.exact = self._reset()

    def read(self) -> int:
        if self.exact:
            with open("/proc/self/status") as f:
                match = re.search(r"VmHWM:\s+(\d+)\s+kB", f.read())
            if match:
                return int(match.group(1)) * 1024
        return psutil.Process().memory_info().rss


class UpstreamKVProbe:
    """Sums the K/V bytes the unpatched pipeline's own cache holds (for the rows without our store)."""

    def __init__(self, transformer):
        self.caches: list = []
        self.bytes_at_extract = 0  # FLUX.2 clears its cache before returning: count it as the extract step returns
        self._handles = [
            transformer.register_forward_pre_hook(self._seen_input, with_kwargs=True),
            transformer.register_forward_hook(self._seen_output, with_kwargs=True),
        ]

    def _seen_input(self, module, args, kwargs):
        cache = kwargs.get("kv_cache")
        if cache is not None and all(cache is not c for c in self.caches):
            self.caches.append(cache)

    def _seen_output(self, module, args, kwargs, output):
        cache = output[1] if isinstance(output, tuple) and len(output) > 1 else getattr(output, "kv_cache", None)
        if cache is not None and kwargs.get("kv_cache_mode") == "extract":
            self.bytes_at_extract += _cache_bytes(cache)

    def total_bytes(self) -> int:
        return sum(_cache_bytes(c) for c in self.caches) + self.bytes_at_extract

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def _cache_bytes(cache) -> int:
    layers = getattr(cache, "layer_caches", None)
    if layers is None:
        layers = [*getattr(cache, "double_block_caches", []), *getattr(cache, "single_block_caches", [])]
    total = 0
    for layer in layers:
        for name in ("k", "v", "k_ref", "v_ref"):
            tensor = getattr(layer, name, None)
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()
    return total

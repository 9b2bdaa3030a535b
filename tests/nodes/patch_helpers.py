"""Shared by the node suites: the tiny DiT patched by the pack, its inputs, and stand-ins that record what the
patches made (the telemetry hub's calls, every store)."""

import os

import threading

import torch

from kv_offload_pack.nodes.apply import apply_offload
from kv_offload_pack.nodes.inputs import config_from_inputs
from kv_offload_pack.offload_core import HostServices, KVStore

from nodes_tiny import FakePatcher, TinyDiT, sample


class Recorder:
    """A telemetry hub stand-in that records the calls and the stores it was given."""

    def __init__(self):
        self.calls, self.stores = [], []

    def run_started(self, run_id):
        self.calls.append("start")

    def track(self, name, store):
        self.stores.append(store)

    def step(self):
        self.calls.append("step")

    def progress(self):
        pass

    def forward_done(self):
        self.calls.append("done")

    def note(self, text):
        self.calls.append("note")

    def run_finished(self, run_id):
        self.calls.append("final")


class Spy(KVStore):
    """A real store that keeps every instance in `Spy.made` (clear it before the run it observes) and records the
    threads its puts and gets ran on (`threads`)."""

    made = []

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.threads = {"put": set(), "get": set()}
        Spy.made.append(self)

    def put(self, key, k, v):
        self.threads["put"].add(threading.get_ident())
        return super().put(key, k, v)

    def get(self, key):
        self.threads["get"].add(threading.get_ident())
        return super().get(key)


def inputs(seed=0, cfg=False, device="cpu", batch=1, hidden=32, ref_tokens=5):
    """(noise, refs, txts): `batch` latents of one prompt and one reference of `ref_tokens` tokens (repeated to
    the batch, as ComfyUI's conds are); with `cfg` a second reference and prompt for the uncond."""
    g = torch.Generator().manual_seed(seed)
    n = 2 if cfg else 1
    noise = torch.randn(batch, 6, hidden, generator=g).to(device)
    refs = [torch.randn(1, ref_tokens, hidden, generator=g).expand(batch, -1, -1).clone().to(device)
            for _ in range(n)]
    txts = [torch.randn(1, 3, hidden, generator=g).expand(batch, -1, -1).clone().to(device) for _ in range(n)]
    return noise, refs, txts


def patched_tiny(mode, tmp_path, telemetry=None, store_factory=KVStore, device="cpu", **dit):
    """(the tiny DiT, its patcher after the pack's node in `mode`), cache files under `tmp_path`; `dit`: the
    DiT's widths (`TinyDiT`'s arguments)."""
    dm = TinyDiT(device=device, **dit)
    host = HostServices(temp_dir=lambda: str(tmp_path))
    patched, _ = apply_offload(FakePatcher(dm), config_from_inputs(mode), host=lambda p: host,
                               store_factory=store_factory, telemetry=telemetry)
    return dm, patched


def run_mode(mode, tmp_path, seed=0, cfg=None, batched=True, telemetry=None, fail_at=None, refs=None, device="cpu",
             hidden=32, heads=2, ref_tokens=5):
    """The latents the tiny DiT samples with the pack's node in `mode` (of `hidden` width in `heads` heads, with
    a reference of `ref_tokens` tokens)."""
    dm, patched = patched_tiny(mode, tmp_path, telemetry=telemetry, device=device, hidden=hidden, heads=heads)
    noise, r, txts = inputs(seed, cfg is not None, device, hidden=hidden, ref_tokens=ref_tokens)
    return sample(dm, patched.options(), noise, refs or r, txts, cfg=cfg, batched=batched, fail_at=fail_at)


def no_files(tmp_path):
    """Every file under `tmp_path` (the name says what a test expects of it)."""
    return [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs]

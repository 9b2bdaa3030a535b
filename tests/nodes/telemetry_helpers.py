"""The telemetry suites' stand-ins and set-up: an injected clock and sender, a hub on them, real stores."""

import gc
import json

import pytest
import torch

from kv_offload_pack.nodes.readout import telemetry as T
from kv_offload_pack.offload_core import KVStore, OffloadConfig


class FakeClock:
    """Monotonic seconds that only move when the test says so."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now

    def advance(self, seconds):
        self.now += seconds


class RecordingSender:
    """Stands in for PromptServer.send_sync: records (event, payload) and checks the payload is strict JSON."""

    def __init__(self):
        self.messages = []

    def __call__(self, event, data):
        json.dumps(data, allow_nan=False)  # what the page's JSON.parse would reject must never be sent
        self.messages.append((event, data))

    @property
    def events(self):
        return [data["event"] for _, data in self.messages]


@pytest.fixture
def hub():
    clock, sender = FakeClock(), RecordingSender()
    h = T.TelemetryHub(send=sender, clock=clock)
    h.clock, h.sender = clock, sender
    return h


def make_store(mode="ram_sync", name="cond", layers=3, batch=1):
    """`batch` > 1: every layer has that many identical rows (a batch of one prompt)."""
    store = KVStore(OffloadConfig(mode=mode), "cpu", name=name)
    g = torch.Generator().manual_seed(0)
    for i in range(layers):
        k = torch.randn(1, 2, 16, 8, generator=g).expand(batch, -1, -1, -1)
        store.put(i, k, k * 2)
    return store



def drive_run(hub, forwards, layers=2, tick=0.0, cfg=False):
    """A real `RunState` on real stores, forward by forward, the way the patches drive it; returns the stores'
    own stats as they were when the run closed them."""
    from kv_offload_pack.nodes.run.state import RunState

    run = RunState(OffloadConfig(mode="ram_sync"), None, n_layers=layers, store_factory=KVStore, telemetry=hub)
    uuids = ["u", "c"] if cfg else ["c"]  # uncond first in the batch, as ComfyUI may batch them
    k = torch.randn(len(uuids), 2, 4, 8)
    hub.run_started(run.run_id)
    for _ in range(forwards):
        hub.clock.advance(tick)
        run.step()
        fwd = run.begin_forward(uuids, ref_tokens=4, batch=len(uuids))
        for layer in range(layers):
            hub.clock.advance(tick)
            for i, u in enumerate(uuids):
                if fwd.phase == "capture":
                    run.put(u, layer, k[i:i + 1], k[i:i + 1], label="uncond" if u == "u" else "cond")
                else:
                    run.get(u, layer)
        hub.clock.advance(tick)
        run.end_forward(ok=True)
    closed = {b.name: b.store for b in run.branches.values()}
    run.close()
    stats = {name: store.stats() for name, store in closed.items()}
    del closed
    gc.collect()
    hub.run_finished(run.run_id)
    return stats

"""The telemetry hub: pushes only during a run, throttled, one final snapshot, honest store figures.

Runs without ComfyUI: the sender and the clock are injected (`telemetry_helpers`); the stores are
real engine `KVStore`s on the CPU.
"""

import gc
import json
import logging
import pathlib
import shutil
import subprocess

import pytest
import torch

from kv_offload_pack.nodes.readout import telemetry as T
from kv_offload_pack.nodes.readout.figures import to_json
from kv_offload_pack.offload_core import KVStore, OffloadConfig

from telemetry_helpers import FakeClock, hub, make_store  # noqa: F401 (hub: a fixture)

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_nothing_is_sent_while_idle(hub):
    for _ in range(50):
        hub.clock.advance(1.0)
        hub.step()
    hub.track("cond", object())
    hub.run_finished("never-started")
    assert hub.sender.messages == []
    hub.run_started("r1")
    hub.run_finished("r1")
    n = len(hub.sender.messages)
    for _ in range(50):  # after the final snapshot the hub is idle again
        hub.clock.advance(1.0)
        hub.step()
    assert len(hub.sender.messages) == n


def test_pushes_are_throttled_to_four_per_second(hub):
    hub.run_started("r1")
    for _ in range(300):  # 3 s of forwards at 100 per second
        hub.clock.advance(0.01)
        hub.step()
    times = [data["run"]["elapsed_s"] for _, data in hub.sender.messages]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert all(g >= T.MIN_PUSH_INTERVAL_S - 1e-9 for g in gaps), gaps
    assert 3 * 4 - 1 <= len(times) <= 3 * 4 + 1  # throttled, but not starved either
    assert {event for event, _ in hub.sender.messages} == {T.EVENT}


def test_one_final_snapshot_then_snapshot_serves_it_without_sending(hub):
    hub.run_started("r1")
    for _ in range(5):
        hub.clock.advance(0.1)
        hub.step()
    hub.clock.advance(0.01)  # well inside the throttle window: the final push is not throttled
    hub.run_finished("r1")
    assert hub.sender.events.count("final") == 1 and hub.sender.events[-1] == "final"
    final = hub.sender.messages[-1][1]
    assert final["v"] == T.PAYLOAD_VERSION
    assert final["run"] == {"id": "r1", "node": None, "active": False, "forwards": 5,
                            "elapsed_s": pytest.approx(0.51), "marks": [], "notes": []}
    n = len(hub.sender.messages)
    for _ in range(3):
        assert hub.snapshot() == final
    assert len(hub.sender.messages) == n


def test_finish_of_another_run_is_ignored(hub):
    hub.run_started("r1")
    hub.run_finished("r0")
    assert hub.active and "final" not in hub.sender.events


def test_snapshot_before_any_run_is_idle_and_sends_nothing(hub):
    snap = hub.snapshot()
    assert snap["event"] == "idle" and snap["run"]["active"] is False
    assert snap["memory"]["process"]["rss"] > 0  # the engine's real memory_snapshot
    assert hub.sender.messages == []


def test_tracked_store_figures_come_from_its_stats(hub):
    store = make_store("ram_sync")
    hub.run_started("r1")
    hub.track("cond", store)
    for _ in range(2):  # two cached passes over the three layers
        for i in range(3):
            store.get(i)
    hub.clock.advance(1.0)
    hub.step()
    entry = hub.sender.messages[-1][1]["stores"][0]
    stats = store.stats()
    assert entry["bytes"] == stats["bytes"] and entry["tier"] == "ram_sync"
    assert entry["scope"] == "process"
    t = stats["transfers"]
    assert entry["bandwidth_bytes_per_s"] == pytest.approx(t["bytes"] / t["seconds"])
    assert entry["passes"] == pytest.approx(stats["gets"] / stats["layers"]) == pytest.approx(2)
    assert entry["exposed_wait_per_pass_s"] == pytest.approx(stats["exposed_wait_s"] / 2)
    assert entry["bytes_while_open"] is None
    totals = hub.sender.messages[-1][1]["totals"]
    assert totals["bytes"]["host_pageable"] == stats["bytes"]["host_pageable"] > 0
    store.close()


def test_a_store_closed_and_collected_before_the_end_still_shows_what_it_held(hub):
    store = make_store("file_sync", name="uncond")
    hub.run_started("r1")
    hub.track("uncond", store)
    store.get(0)
    hub.clock.advance(0.01)
    hub.step()  # throttled: no push, but the figures are refreshed
    held = store.stats()["bytes"]
    assert held["file"] > 0
    store.close()
    del store
    gc.collect()
    hub.run_finished("r1")
    entry = hub.sender.messages[-1][1]["stores"][0]
    assert entry["closed"] is True
    assert entry["bytes_while_open"] == held
    assert all(v is None for v in entry["bytes"].values())  # unknown, not zero: the object is gone


def test_a_closed_store_still_alive_reports_zero_bytes_and_what_it_held(hub):
    store = make_store("ram_sync")
    hub.run_started("r1")
    hub.track("cond", store)
    hub.clock.advance(1.0)
    hub.step()
    held = store.stats()["bytes"]
    store.close()
    hub.run_finished("r1")
    entry = hub.sender.messages[-1][1]["stores"][0]
    assert entry["closed"] is True and entry["bytes_while_open"] == held
    assert sum(entry["bytes"].values()) == 0


def test_stores_are_dropped_at_run_end(hub):
    store = make_store()
    hub.run_started("r1")
    hub.track("cond", store)
    hub.run_finished("r1")
    hub.run_started("r2")
    assert hub.sender.messages[-1][1]["stores"] == []
    store.close()


def test_a_failing_sender_never_breaks_sampling():
    def broken_sender(event, data):
        raise ConnectionError("socket gone")

    clock = FakeClock()
    h = T.TelemetryHub(send=broken_sender, clock=clock)
    h.run_started("r1")
    clock.advance(1.0)
    h.step()
    h.run_finished("r1")
    assert h.snapshot()["event"] == "final"


def test_a_store_whose_stats_fail_keeps_its_last_figures_and_is_reported_once(hub, caplog):
    store = make_store("ram_sync")
    hub.run_started("r1")
    hub.track("cond", store)
    hub.clock.advance(1.0)
    hub.step()
    held = hub.snapshot()["stores"][0]["bytes"]

    def torn_down():
        raise RuntimeError("tier closed under the readout")

    store.stats = torn_down
    with caplog.at_level("WARNING", logger=T.__name__.replace("telemetry", "figures")):
        for _ in range(3):
            hub.clock.advance(1.0)
            hub.step()  # sampling goes on
    assert hub.snapshot()["stores"][0]["bytes"] == held
    assert [r.getMessage() for r in caplog.records].count(
        "KV Offload: the readout could not read KV store 'cond'; it shows its last figures") == 1
    del store.stats
    store.close()


def test_a_readout_call_that_fails_is_logged_and_never_breaks_the_run(caplog):
    from kv_offload_pack.nodes.run.state import RunState

    class Broken:
        def __getattr__(self, name):
            def fail(*args):
                raise RuntimeError(f"readout {name} broke")
            return fail

    run = RunState(OffloadConfig(mode="ram_sync"), None, n_layers=1, store_factory=KVStore, telemetry=Broken())
    k = torch.randn(1, 2, 4, 8)
    with caplog.at_level("DEBUG", logger=T.__name__):
        run.begin_forward(["c"], ref_tokens=4, batch=1)
        run.put("c", 0, k, k)  # tells track and progress
        run.end_forward(ok=True)  # tells forward_done
    assert run.branches["c"].complete and torch.equal(run.get("c", 0)[0], k)
    run.close()
    failed = [r for r in caplog.records if "memory readout's" in r.getMessage()]
    assert {r.getMessage().split("'s ")[1] for r in failed} >= {"track() failed", "progress() failed",
                                                                "forward_done() failed"}
    assert all(r.exc_info for r in failed)


def test_a_server_that_refuses_every_push_is_said_once_at_warning_and_the_run_goes_on(monkeypatch, caplog):
    from kv_offload_pack.nodes import once

    monkeypatch.setattr(once, "_SAID", set())

    def refuse(event, data):
        raise ConnectionError("socket closed")

    clock = FakeClock()
    hub = T.TelemetryHub(send=refuse, clock=clock)
    with caplog.at_level("DEBUG", logger=T.__name__):  # the readout logs under the telemetry logger
        for run in ("r1", "r2"):  # each run ends with a final snapshot
            hub.run_started(run)
            clock.advance(1.0)
            hub.run_finished(run)
    said = [r for r in caplog.records if f"push of {T.EVENT}" in r.getMessage()]
    assert len(said) >= 2 and [r.levelno for r in said].count(logging.WARNING) == 1
    assert said[0].levelno == logging.WARNING and said[0].exc_info


def test_payload_is_strict_json():
    payload = to_json({"a": float("nan"), "b": (1, float("inf")), "c": OffloadConfig(mode="gpu").mode})
    assert payload == {"a": None, "b": [1, None], "c": "gpu"}


@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js is not installed")
def test_the_page_formatter_reads_the_hub_payload(hub, tmp_path):
    """Contract between Python and JS: every figure the hub knows reaches the readout (no dash for it)."""
    store = make_store("ram_sync", batch=2)
    hub.run_started("r1")
    hub.track("cond", store)
    store.get(0)
    hub.clock.advance(1.0)
    hub.step()
    payload_file = tmp_path / "payload.json"
    payload_file.write_text(json.dumps(hub.snapshot()))
    script = (
        f"import {{ buildReadout }} from {json.dumps((ROOT / 'web' / 'kv_offload_format.js').as_uri())};\n"
        "import { readFileSync } from 'node:fs';\n"
        "const p = JSON.parse(readFileSync(process.argv[1], 'utf8'));\n"
        "const rows = {};\n"
        "for (const s of buildReadout(p)) for (const r of s.rows) rows[`${s.title}/${r.label}`] = r.value;\n"
        "console.log(JSON.stringify(rows));\n"
    )
    out = subprocess.run(["node", "--input-type=module", "-e", script, str(payload_file)],
                         capture_output=True, text=True, timeout=60, check=True)
    rows = json.loads(out.stdout)
    for key in ("memory/RAM", "memory/KV cache", "KV cond/mode", "KV cond/holds", "KV cond/transfers",
                "KV cond/exposed wait"):
        assert "\u2014" not in rows[key], (key, rows[key])
    assert rows["KV cond/mode"] == "ram_sync"
    assert rows["KV cond/batch rows"].startswith("3/6 rows kept \u00b7 6.00 KiB saved"), rows["KV cond/batch rows"]
    assert rows["status/run"].startswith("running")
    store.close()


@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js is not installed")
def test_the_page_names_the_places_the_engine_keys_its_bytes_by():
    from kv_offload_pack.offload_core.places import PLACES

    script = (f"import {{ KV_PLACES }} from {json.dumps((ROOT / 'web' / 'kv_offload_bars.js').as_uri())};\n"
              "console.log(JSON.stringify(KV_PLACES.map((p) => p.place)));\n")
    out = subprocess.run(["node", "--input-type=module", "-e", script], capture_output=True, text=True, timeout=60,
                         check=True)
    assert tuple(json.loads(out.stdout)) == PLACES


def test_payload_never_carries_the_cache_path(hub, tmp_path):
    # any client of the server gets the payload; a cache path would point it at another user's K/V on disk
    from kv_offload_pack.offload_core import HostServices

    store = KVStore(OffloadConfig(mode="file_sync"), "cpu", host=HostServices(temp_dir=lambda: str(tmp_path)),
                    name="cond")
    store.put(0, torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8))
    assert str(tmp_path) in json.dumps(store.stats())  # the engine knows the path ...
    hub.run_started("r1")
    hub.track("cond", store)
    hub.clock.advance(1.0)
    hub.step()
    store.close()
    hub.run_finished("r1")
    payloads = [data for _, data in hub.sender.messages] + [hub.snapshot()]
    assert payloads[-1]["stores"][0]["on_disk"] is True  # ... the readout only says that there are files
    for payload in payloads:
        assert str(tmp_path) not in json.dumps(payload)
        assert all("file_dir" not in s for s in payload["stores"])

"""The telemetry hub over a real `RunState`: fresh figures inside and after each forward, marks, order, views."""

import pytest

from kv_offload_pack.nodes.readout import telemetry as T
from kv_offload_pack.nodes.readout.figures import store_order
from telemetry_helpers import drive_run, hub  # noqa: F401 (hub: a fixture)


def test_the_final_snapshot_counts_every_transfer_even_when_every_push_was_throttled(hub):
    engine = drive_run(hub, forwards=6, tick=0.0)  # the clock never moves: only the start push goes out
    assert hub.sender.events == ["start", "final"]
    [store] = hub.snapshot()["stores"]
    assert store["transfers"]["count"] == engine["cond"]["transfers"]["count"] >= 5 * 2  # 5 cached forwards


def test_the_capture_step_shows_its_stores_while_it_runs_and_right_after(hub):
    drive_run(hub, forwards=3, layers=3, tick=0.3)  # every call is outside the rate limit
    payloads = [data for _, data in hub.sender.messages]
    first_forward = [p for p in payloads if p["run"]["forwards"] == 1 and p["event"] == "step"]
    # before the forward (no store yet), after each captured layer (growing), after the forward (complete)
    held = [p["stores"][0]["bytes"]["host_pageable"] if p["stores"] else 0 for p in first_forward]
    assert held[0] == 0 and held[1:4] == sorted(set(held[1:4])) and held[4] == held[3] > 0, held
    gaps = [b["run"]["elapsed_s"] - a["run"]["elapsed_s"] for a, b in zip(payloads, payloads[1:-1])]
    assert all(g >= T.MIN_PUSH_INTERVAL_S - 1e-9 for g in gaps), gaps


def test_progress_inside_a_throttled_forward_asks_no_store_for_figures(hub):
    calls = []

    class Counting:
        def stats(self):
            calls.append(1)
            return {"name": "cond", "bytes": {}, "layers": 1}

    store = Counting()
    hub.run_started("r1")
    hub.track("cond", store)
    for _ in range(100):
        hub.progress()
    assert calls == [] and hub.sender.events == ["start"]


def test_marks_show_the_capture_and_the_release(hub):
    drive_run(hub, forwards=4, tick=0.1)
    final = hub.snapshot()
    capture, release = final["run"]["marks"]
    assert capture["what"] == "capture" and release["what"] == "release"
    # the capture spans the first forward: from its first store to its end, before any cached forward
    assert 0 < capture["start_s"] < capture["end_s"] <= 4 * 0.1 + 1e-9
    assert release["start_s"] == pytest.approx(final["run"]["elapsed_s"])


def test_cond_is_listed_before_uncond(hub):
    drive_run(hub, forwards=2, cfg=True, tick=0.3)
    lists = [[s["name"] for s in payload["stores"]] for _, payload in hub.sender.messages]
    assert lists[-1] == ["cond", "uncond"]  # uncond was created first: its batch row comes first
    assert all(names in ([], ["uncond"], ["cond", "uncond"]) for names in lists), lists
    assert sorted(["uncond 2", "x", "cond 2", "uncond", "cond"], key=store_order) == \
        ["cond", "cond 2", "uncond", "uncond 2", "x"]


def test_a_node_view_tags_its_runs_with_the_node_id(hub):
    view = hub.for_node(17)
    view.run_started("r1")
    view.step()
    view.run_finished("r1")
    assert [data["run"]["node"] for _, data in hub.sender.messages] == ["17", "17"]
    hub.run_started("r2")  # a run without a node (e.g. another pack's call) says so
    assert hub.sender.messages[-1][1]["run"]["node"] is None
    import copy
    assert copy.copy(view).hub is hub  # the patched MODEL holds the view; copying it must not recurse

"""The memory monitor against a real ComfyUI: node and files registered, pushes only during a run, silence
otherwise (the acceptance check: no `kv_offload.*` message for 10 seconds with no run active).

Uses the `comfy` session fixture (conftest.py) and the graphs of graph_helpers.py (a tiny FLUX.2 on CPU).
Run: COMFYUI_PATH=/path/to/ComfyUI [COMFYUI_PYTHON=/path/to/python] pytest -m comfyui tests/comfyui
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from graph_helpers import graph  # the tiny FLUX.2 graph of the integration suite

websocket = pytest.importorskip("websocket", reason="the monitor tests need websocket-client")

pytestmark = pytest.mark.comfyui

IDLE_S = 10.0
PUSH_INTERVAL_S = 0.25


class SocketRecorder:
    """Listens on ComfyUI's websocket in a thread; keeps every `kv_offload.*` message with its arrival time."""

    def __init__(self, comfy):
        url = comfy.url.replace("http://", "ws://") + f"/ws?clientId=monitor-{time.monotonic_ns()}"
        self.ws = websocket.create_connection(url, timeout=30)
        self.ws.settimeout(0.2)
        self.messages: list = []  # (monotonic arrival, type, data)
        self.other = 0             # any other JSON message: proves the socket is live
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self):
        while not self._stop.is_set():
            try:
                raw = self.ws.recv()
            except websocket.WebSocketTimeoutException:
                continue
            except Exception:
                return
            if isinstance(raw, bytes):
                continue
            msg = json.loads(raw)
            if str(msg.get("type", "")).startswith("kv_offload."):
                self.messages.append((time.monotonic(), msg["type"], msg["data"]))
            else:
                self.other += 1

    def wait_for(self, predicate, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate(self.messages):
                return
            time.sleep(0.05)
        raise AssertionError(f"timed out; kv_offload messages so far: {[m[2].get('event') for m in self.messages]}")

    def close(self):
        self._stop.set()
        self._thread.join(timeout=5)
        self.ws.close()


@pytest.fixture
def recorder(comfy):
    rec = SocketRecorder(comfy)
    yield rec
    rec.close()


def test_monitor_node_and_web_files_are_registered(comfy):
    code, info = comfy.request("GET", "/object_info/KVMemoryMonitor")
    assert code == 200, info
    node = info["KVMemoryMonitor"]
    assert node["category"] == "kv_offload" and node["output"] == [] and not node["output_node"]
    assert not node["input"].get("required") and not node["input"].get("optional")
    _, extensions = comfy.request("GET", "/extensions")
    names = {path.rsplit("/", 1)[-1] for path in extensions}
    assert {"kv_offload.js", "kv_offload_format.js"} <= names


def test_idle_server_sends_no_kv_offload_message_for_ten_seconds(comfy, recorder):
    started = time.monotonic()
    snapshots = []
    while time.monotonic() - started < IDLE_S:  # reading the route must not make the server talk either
        code, snap = comfy.request("GET", "/kv_offload/stats")
        assert code == 200 and snap["v"] == 1 and snap["run"]["active"] is False
        snapshots.append(snap)
        time.sleep(1.0)
    assert recorder.messages == []
    if snapshots[0]["event"] == "idle":  # no run yet: each read is a fresh idle snapshot, never a run
        assert all(s["event"] == "idle" and s["run"]["id"] is None for s in snapshots)
    else:  # after a run: the stored final snapshot, unchanged by reading it
        assert all(s == snapshots[0] for s in snapshots), "GET /kv_offload/stats changed state while idle"
    assert comfy.proc.poll() is None


def test_a_run_pushes_throttled_snapshots_one_final_then_silence(comfy, recorder):
    entry = comfy.run(graph(mode="ram_sync", steps=6, seed=int(time.time())))
    assert entry["status"]["status_str"] == "success"
    recorder.wait_for(lambda ms: any(m[2]["event"] == "final" for m in ms), timeout=30)
    events = [m[2]["event"] for m in recorder.messages]
    assert events[0] == "start" and events[-1] == "final" and events.count("final") == 1, events
    assert all(m[1] == "kv_offload.memory" for m in recorder.messages)
    stamps = [m[2]["time"] for m in recorder.messages if m[2]["event"] != "final"]
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    assert all(g >= PUSH_INTERVAL_S - 0.02 for g in gaps), f"more than 4 pushes a second: {gaps}"
    final = recorder.messages[-1][2]
    assert final["run"]["active"] is False and final["run"]["forwards"] >= 6
    [store] = final["stores"]
    assert store["mode"] == "ram_sync" and store["closed"] is True
    assert store["bytes_while_open"]["host_pageable"] > 0
    _, snap = comfy.request("GET", "/kv_offload/stats")
    assert snap == final, "the route does not serve the final snapshot"
    n = len(recorder.messages)
    time.sleep(IDLE_S)  # after the run: idle again, nothing sent
    assert len(recorder.messages) == n, [m[2]["event"] for m in recorder.messages[n:]]

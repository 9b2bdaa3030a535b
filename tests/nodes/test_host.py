"""ComfyUI's services as the engine sees them, with stand-ins for `comfy.model_management` / `folder_paths`."""

import os
import stat
import sys
import types

import torch

from kv_offload_pack.nodes.run import host as host_mod
from kv_offload_pack.nodes.run.state import RunState
from kv_offload_pack.offload_core import KVStore, OffloadConfig


def install(monkeypatch, tmp_path, budget_ok=True, pin_ok=True, served_dirs=None):
    calls = []
    mm = types.ModuleType("comfy.model_management")
    mm.ensure_pin_budget = lambda size, evict_active=False, loaded=False: calls.append(("budget", size)) or budget_ok
    mm.pin_memory = lambda t: calls.append(("pin", t.nbytes)) or pin_ok
    mm.unpin_memory = lambda t: calls.append(("unpin", t.nbytes)) or True
    mm.get_free_memory = lambda dev=None, torch_free_too=False: 123
    mm.get_offload_stream = lambda device: calls.append(("stream", str(device))) or "side-stream"
    comfy = types.ModuleType("comfy")
    comfy.model_management = mm
    fp = types.ModuleType("folder_paths")
    fp.get_temp_directory = lambda: str(tmp_path / "temp")
    served = {t: str(tmp_path / t) for t in ("temp", "output", "input")}
    served.update(served_dirs or {})
    fp.get_directory_by_type = served.get
    monkeypatch.setitem(sys.modules, "comfy", comfy)
    monkeypatch.setitem(sys.modules, "comfy.model_management", mm)
    monkeypatch.setitem(sys.modules, "folder_paths", fp)
    return calls


def test_pinning_goes_through_comfyuis_budget(monkeypatch, tmp_path):
    calls = install(monkeypatch, tmp_path)
    services = host_mod.comfy_host_services()
    t = torch.zeros(256)
    assert services.pin(t) is True
    services.unpin(t)
    assert calls == [("budget", 1024), ("pin", 1024), ("unpin", 1024)]


def test_a_refused_budget_means_no_pin(monkeypatch, tmp_path):
    calls = install(monkeypatch, tmp_path, budget_ok=False)
    assert host_mod.comfy_host_services().pin(torch.zeros(4)) is False
    assert [c[0] for c in calls] == ["budget"]


def test_streams_memory_and_temp_dir(monkeypatch, tmp_path):
    calls = install(monkeypatch, tmp_path)

    class Patcher:
        def get_free_memory(self, device):
            return 456

    services = host_mod.comfy_host_services(Patcher())
    assert services.free_device_memory(torch.device("cpu")) == 456  # the sampling patcher's view (DynamicVRAM)
    assert host_mod.comfy_host_services().free_device_memory(torch.device("cpu")) == 123
    assert services.stream(torch.device("cpu")) is None and calls == []  # no side stream on CPU
    assert services.stream(torch.device("cuda", 0)) == "side-stream"


def _outside_served(path, tmp_path):
    return all(os.path.commonpath([path, str(tmp_path / t)]) != str(tmp_path / t) for t in ("temp", "output", "input"))


def test_cache_dir_is_private_and_outside_what_view_serves(monkeypatch, tmp_path):
    # ComfyUI's /view hands any client files under temp/, output/ and input/ (subfolders included)
    install(monkeypatch, tmp_path)
    (tmp_path / "temp").mkdir()
    run_dir = host_mod.comfy_host_services().temp_dir
    path = run_dir()
    assert run_dir() == path and os.path.isdir(path) and _outside_served(path, tmp_path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    assert path != host_mod.comfy_host_services().temp_dir()  # every run gets its own
    assert list((tmp_path / "temp").iterdir()) == []


def test_cache_dir_avoids_an_output_dir_that_holds_it(monkeypatch, tmp_path):
    install(monkeypatch, tmp_path, served_dirs={"output": str(tmp_path)})  # e.g. --output-directory <base>
    run_dir = host_mod.comfy_host_services().temp_dir
    path = run_dir()
    assert os.path.commonpath([path, str(tmp_path)]) != str(tmp_path)
    run_dir.cleanup()
    assert not os.path.exists(path)


def test_a_run_leaves_no_directory_behind(monkeypatch, tmp_path):
    install(monkeypatch, tmp_path)
    host = host_mod.comfy_host_services()
    run = RunState(OffloadConfig(mode="file_sync"), host, n_layers=1, store_factory=KVStore)
    run.begin_forward(["c"], ref_tokens=4, batch=1)
    k = torch.randn(1, 2, 4, 8)
    run.put("c", 0, k, k)
    assert [p for p in tmp_path.rglob("*") if p.is_file()]
    run.end_forward(ok=True)
    run.close()
    assert [p for p in tmp_path.rglob("*") if p.is_dir()] == []


CHILD = """
import importlib, os, sys, types
tiers = types.ModuleType("tiers")  # the tiers folder as a bare package: fileowner and fileos are stdlib only
tiers.__path__ = [os.path.dirname(sys.argv[2])]
sys.modules["tiers"] = tiers
fileowner = importlib.import_module("tiers.fileowner")
assert "torch" not in sys.modules
d = fileowner.OwnedDir(sys.argv[1], "run-")
open(d.path + "/layer-00000.safetensors", "wb").close()
print(d.path, flush=True)
sys.stdin.readline()
"""


def test_only_dead_processes_runs_are_reclaimed_never_a_live_ones(monkeypatch, tmp_path):
    # Two ComfyUIs started from one install (one per GPU) share the cache folder: the pack's start-up and every
    # new run remove what a killed process left, and leave the other live process's cache alone.
    import signal
    import subprocess

    install(monkeypatch, tmp_path)
    root = host_mod.cache_root()
    os.makedirs(root)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": repo}
    module = os.path.join(repo, "offload_core", "tiers", "file", "fileowner.py")
    live, dead = [subprocess.Popen([sys.executable, "-c", CHILD, root, module], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    try:
        live_dir, dead_dir = live.stdout.readline().strip(), dead.stdout.readline().strip()
        dead.send_signal(signal.SIGKILL)
        dead.wait(30)
        host_mod.reclaim_leftovers()  # what the pack does when it loads
        assert not os.path.exists(dead_dir)
        assert os.path.exists(os.path.join(live_dir, "layer-00000.safetensors"))
        run_dir = host_mod.comfy_host_services().temp_dir  # a new run in this process: also leaves it alone
        path = run_dir()
        assert os.path.isdir(live_dir) and path != live_dir
        run_dir.cleanup()
        assert not os.path.exists(path) and os.path.isdir(live_dir)
    finally:
        live.stdin.close()
        live.wait(30)
        dead.wait(30)


def test_a_failing_free_memory_query_is_said_once_at_warning(monkeypatch, tmp_path, caplog):
    import logging

    install(monkeypatch, tmp_path)
    monkeypatch.setattr(host_mod, "_WARNED_QUERIES", set())

    def broken(dev=None, torch_free_too=False):
        raise RuntimeError("driver gone")

    sys.modules["comfy.model_management"].get_free_memory = broken
    services = host_mod.comfy_host_services()
    with caplog.at_level(logging.WARNING, logger=host_mod.log.name):
        for _ in range(3):
            assert services.free_device_memory(torch.device("cpu")) is None
            assert services.free_host_memory() is None
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 2 and all("RuntimeError: driver gone" in m and "mode auto plans" in m for m in said)


def test_a_cache_folder_that_cannot_be_found_at_load_is_said_at_warning_and_the_pack_loads(monkeypatch, caplog):
    import logging

    def broken():
        raise RuntimeError("folder_paths not ready")

    monkeypatch.setattr(host_mod, "cache_root", broken)
    with caplog.at_level(logging.WARNING, logger=host_mod.log.name):
        host_mod.reclaim_leftovers()  # returns: loading the pack goes on
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 1 and "RuntimeError: folder_paths not ready" in said[0]


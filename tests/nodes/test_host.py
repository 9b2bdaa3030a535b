"""ComfyUI's services as the engine sees them, with stand-ins for `comfy.model_management` / `folder_paths`."""

import sys
import types

import torch

from kv_offload_pack.nodes import host as host_mod


def install(monkeypatch, tmp_path, budget_ok=True, pin_ok=True):
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
    root = services.temp_dir()
    assert root == str(tmp_path / "temp" / "kv_offload") and (tmp_path / "temp" / "kv_offload").is_dir()

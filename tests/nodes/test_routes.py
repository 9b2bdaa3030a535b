"""The readout's HTTP side (`nodes/readout/routes.py`), with a stand-in for `comfy.model_management`."""

import logging
import sys
import types

from kv_offload_pack.nodes.readout import routes


def test_a_torch_device_that_comfyui_cannot_name_is_said_at_warning(monkeypatch, caplog):
    mm = types.ModuleType("comfy.model_management")

    def broken():
        raise RuntimeError("no device yet")

    mm.get_torch_device = broken
    comfy = types.ModuleType("comfy")
    comfy.model_management = mm
    monkeypatch.setitem(sys.modules, "comfy", comfy)
    monkeypatch.setitem(sys.modules, "comfy.model_management", mm)
    with caplog.at_level(logging.WARNING, logger=routes.log.name):
        assert routes._comfy_device() is None  # the readout reports the engine's default device instead
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 1 and "RuntimeError: no device yet" in said[0]

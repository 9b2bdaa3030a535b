"""The `comfy` session fixture: one real ComfyUI for the whole `comfyui` suite.

`main.py --cpu` on 127.0.0.1 (a free port), with the pack and the test-only nodes made visible through
`--extra-model-paths-config` (a YAML with `custom_nodes:` pointing at a temp dir of symlinks), every
ComfyUI directory (temp, output, input, user) under a temp base directory, an in-memory database, and a
tiny random FLUX.2 and Wan Animate 2 checkpoints written at start-up. Skipped, with the reason, when COMFYUI_PATH is unset.

COMFYUI_FRONTEND_PATH (optional) names a folder holding another front end,
`pip install --target DIR comfyui-frontend-package==X`; it goes first on the ComfyUI process's PYTHONPATH,
so the page is that front end instead of the one ComfyUI's Python has installed (`comfy.frontend` is its version).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from procs import stop

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
START_TIMEOUT_S = 180
RUN_TIMEOUT_S = 120


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback only, never via a proxy


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Comfy:
    """A running ComfyUI server and the few HTTP calls the tests need (loopback only)."""

    def __init__(self, url: str, base: Path, proc: subprocess.Popen, log: Path, frontend: str | None = None):
        self.url, self.base, self.proc, self.log = url, base, proc, log
        self.frontend = frontend  # the version COMFYUI_FRONTEND_PATH holds; None: ComfyUI's own
        self.client_id = uuid.uuid4().hex

    def request(self, method: str, path: str, body=None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with _OPENER.open(req, timeout=30) as r:
                raw = r.read()
                return r.status, (json.loads(raw) if raw else None)
        except urllib.error.HTTPError as e:
            raw = e.read()
            return e.code, (json.loads(raw) if raw else None)

    def submit(self, graph: dict) -> tuple[int, dict]:
        return self.request("POST", "/prompt", {"prompt": graph, "client_id": self.client_id})

    def wait(self, prompt_id: str, timeout: float = RUN_TIMEOUT_S) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"ComfyUI exited; log:\n{self.tail()}"
            _, hist = self.request("GET", f"/history/{prompt_id}")
            if hist and prompt_id in hist and hist[prompt_id].get("status", {}).get("completed") is not None:
                entry = hist[prompt_id]
                if entry["status"].get("status_str") in ("success", "error"):
                    return entry
            time.sleep(0.05)
        raise AssertionError(f"prompt {prompt_id} did not finish in {timeout}s; log:\n{self.tail()}")

    def run(self, graph: dict) -> dict:
        code, body = self.submit(graph)
        assert code == 200, f"/prompt refused the graph: {body}"
        entry = self.wait(body["prompt_id"])
        assert entry["status"]["status_str"] == "success", f"run failed: {entry['status']}\n{self.tail()}"
        return entry

    def latent(self, entry: dict, node: str = "save"):
        from safetensors.torch import load_file

        info = entry["outputs"][node]["latents"][0]
        return load_file(str(self.base / "output" / info["subfolder"] / info["filename"]))["latent_tensor"]

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def kv_files(self) -> list:
        """Files of ours: the cache folder beside ComfyUI's temp dir, plus anything in temp (there should be none)."""
        dirs = [self.base / "temp", self.base / "kv_offload_cache"]
        return [str(p) for d in dirs if d.exists() for p in d.rglob("*") if p.is_file()]


def _frontend_env() -> tuple[dict, str | None]:
    """The ComfyUI process's environment and the front-end version COMFYUI_FRONTEND_PATH adds (None if unset)."""
    env = dict(os.environ)
    folder = env.pop("COMFYUI_FRONTEND_PATH", "")
    if not folder:
        return env, None
    found = sorted(Path(folder).glob("comfyui_frontend_package-*.dist-info"))
    if not (Path(folder) / "comfyui_frontend_package").is_dir() or not found:
        raise pytest.UsageError(f"COMFYUI_FRONTEND_PATH={folder} holds no comfyui_frontend_package; make it with "
                                f"`pip install --target {folder} comfyui-frontend-package==VERSION`")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (folder, env.get("PYTHONPATH")) if p)
    return env, found[-1].name.removeprefix("comfyui_frontend_package-").removesuffix(".dist-info")


@pytest.fixture(scope="session")
def comfy(tmp_path_factory):
    comfy_path = os.environ.get("COMFYUI_PATH")
    if not comfy_path:
        pytest.skip("COMFYUI_PATH is not set: the ComfyUI integration suite needs a ComfyUI checkout")
    comfy_path = Path(comfy_path).resolve()
    if not (comfy_path / "main.py").is_file():
        pytest.skip(f"COMFYUI_PATH={comfy_path} has no main.py")
    python = os.environ.get("COMFYUI_PYTHON", sys.executable)
    tmp = tmp_path_factory.mktemp("comfy")
    base, custom, models = tmp / "base", tmp / "custom_nodes", tmp / "models" / "diffusion_models"
    for d in (base, base / "custom_nodes", custom, models):
        d.mkdir(parents=True)
    (custom / "comfyui-kv-offload").symlink_to(ROOT, target_is_directory=True)
    (custom / "kv_offload_testnodes").symlink_to(HERE / "testnodes", target_is_directory=True)
    subprocess.run([python, str(HERE / "make_tiny_flux2.py"), str(comfy_path), str(models / "tiny_flux2.safetensors")],
                   check=True, cwd=tmp, capture_output=True, timeout=300)
    subprocess.run([python, str(HERE / "make_tiny_wan_animate2.py"), str(comfy_path),
                    str(models / "tiny_wan_animate2.safetensors")], check=True, cwd=tmp, capture_output=True, timeout=300)
    subprocess.run([python, str(HERE / "make_tiny_causal_wan.py"), str(comfy_path),
                    str(models / "tiny_causal_wan.safetensors")], check=True, cwd=tmp, capture_output=True, timeout=300)
    config = tmp / "extra_model_paths.yaml"
    config.write_text(f"kv_offload_tests:\n  base_path: {tmp}\n  custom_nodes: custom_nodes\n"
                      "  diffusion_models: models/diffusion_models\n")
    port = _free_port()
    log = tmp / "comfyui.log"
    cmd = [python, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port), "--base-directory", str(base),
           "--extra-model-paths-config", str(config), "--database-url", "sqlite:///:memory:",
           "--disable-auto-launch"]
    env, frontend = _frontend_env()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=comfy_path, stdout=out, stderr=subprocess.STDOUT, env=env)
    server = Comfy(f"http://127.0.0.1:{port}", base, proc, log, frontend)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert proc.poll() is None, f"ComfyUI exited at start-up; log:\n{server.tail()}"
            try:
                code, info = server.request("GET", "/object_info/KVOffloadSettings")
                if code == 200 and info:
                    break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            assert time.monotonic() < deadline, f"ComfyUI did not come up; log:\n{server.tail()}"
            time.sleep(0.25)
        yield server
    finally:
        stop(proc, 30)

"""The monitor's modules import without ComfyUI and start nothing at import."""

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_monitor_modules_import_without_comfyui_and_start_no_thread():
    script = textwrap.dedent(f"""
        import sys, threading
        sys.path.insert(0, {str(ROOT / "tests")!r})
        before = {{t.ident for t in threading.enumerate()}}
        import conftest  # loads the pack as a package, like ComfyUI does
        from kv_offload_pack.nodes.readout import monitor, routes, telemetry
        after = {{t.ident for t in threading.enumerate()}}
        assert after == before, "a thread was started at import"
        assert "comfy_api" not in sys.modules and "server" not in sys.modules and "aiohttp" not in sys.modules
        assert not hasattr(monitor, "KVMemoryMonitor") and monitor.NODE_ID == "KVMemoryMonitor"
        assert telemetry.TELEMETRY.active is False
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr

"""With `bypass_page_cache`, reading back a 1 GiB file-tier cache neither fills the page cache nor the RSS."""

import json
import os
import subprocess
import sys

import pytest

PROBE = os.path.join(os.path.dirname(__file__), "pagecache_probe.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAYERS, LAYER_MIB = 16, 64  # 1 GiB


def measure(mode, bypass, tmp_path):
    out = subprocess.run([sys.executable, PROBE, mode, bypass, str(LAYERS), str(LAYER_MIB), str(tmp_path)],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["file_sync", "file_async"])
def test_bypass_keeps_page_cache_and_rss_small(mode, tmp_path):
    m = measure(mode, "on", tmp_path)
    assert m["exact"] and m["left"] == []
    assert m["cache_bytes"] >= 1 << 30
    assert m["mode"] in ("o_direct", "fadvise")
    assert m["page_cache_bytes"] < 0.05 * m["cache_bytes"], m
    # Staging plus device slots: (depth + 1) layers each; far below the 1 GiB cache.
    assert m["rss_growth"] < 5 * m["layer_bytes"], m


@pytest.mark.slow
def test_without_bypass_the_page_cache_holds_the_cache(tmp_path):
    m = measure("file_sync", "off", tmp_path)
    assert m["exact"] and m["mode"] == "off"
    assert m["page_cache_bytes"] > 0.5 * m["cache_bytes"], m

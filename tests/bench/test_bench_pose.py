"""`bench --pose`: Wan Animate 2's pose cache in RAM, in files and under a RAM budget that spills, on the CPU."""

import json
import os
import statistics
import tempfile

import pytest
import torch

from offload_core.bench import cli
from offload_core.bench.pose import run as pose, cli as posecli

GiB = 1 << 30
ROW_FIELDS = {"row", "mode", "host_budget", "windows", "bytes", "spill_bytes", "fill_s", "latency_s", "latency_min_s",
              "latency_max_s", "exposed_wait_s", "peak_device_bytes", "mode_in_effect", "pinned_fallback", "exact",
              "overhead_s", "compute_s", "ratio"}


def test_the_sizes_are_wan_14b_at_480x832():
    full = pose.pose_sizes("full", 81)
    assert (full.latent_frames, full.tokens_per_frame, full.dim, full.blocks) == (21, 1560, 5120, 40)
    assert round(full.cache_bytes / GiB, 1) == 12.5  # ComfyUI's WanAnimate2Cache: ~12.5 GB at 480x832, 81 frames
    assert pose.pose_sizes("tiny", 81).cache_bytes * 40 == full.cache_bytes  # 320 MiB
    assert pose.PoseSizes(81, 8, windows=4).window_tokens() == [6 * 1560, 5 * 1560, 5 * 1560, 5 * 1560]


@pytest.fixture
def files_here(tmp_path, monkeypatch):
    """The file modes' private folders go under `tmp_path`, so the test sees what is left there."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_every_row_serves_the_puts_bit_for_bit_from_where_it_says(files_here):
    sizes = pose.PoseSizes(frames=5, dim=32)  # 2 latent frames: 3,120 tokens, 40 blocks, 7.6 MiB
    rows, compute_s = pose.measure(sizes, torch.device("cpu"), runs=1)
    by = {r["row"]: r for r in rows}
    assert list(by) == [label for label, _, _ in pose.ROWS] and all(set(r) == ROW_FIELDS for r in rows)
    assert all(r["exact"] for r in rows)
    cache = sizes.cache_bytes
    ram = {name: r["bytes"]["host_pinned"] + r["bytes"]["host_pageable"] for name, r in by.items()}
    assert by["gpu"]["bytes"]["device"] >= cache and ram["gpu"] == 0
    for name in ("ram_sync", "ram_async"):
        assert ram[name] >= cache and by[name]["bytes"]["file"] == 0 and by[name]["spill_bytes"] == 0
    for name in ("file_sync", "file_async"):
        assert by[name]["bytes"]["file"] >= cache and ram[name] < cache // 100  # a staging page
    budget = by["ram budget 50%"]
    assert budget["host_budget"] == cache // 2
    assert 0 < ram["ram budget 50%"] <= cache // 2 < budget["spill_bytes"] == budget["bytes"]["file"]
    assert by["ram_async"]["ratio"] == 1.0
    for r in rows:
        assert r["ratio"] == pytest.approx(r["latency_s"] / by["ram_async"]["latency_s"])
        assert r["overhead_s"] == pytest.approx(r["latency_s"] - r["compute_s"]) and r["compute_s"] > 0
    assert compute_s == statistics.median(r["compute_s"] for r in rows)
    assert os.listdir(files_here) == []  # every store closed: no file, no folder left


def test_windows_share_one_ram_budget(files_here):
    """One store per window; a window's budget is what the windows before it left (as the node's pose cache)."""
    sizes = pose.PoseSizes(frames=5, dim=16, windows=2)  # one latent frame each
    row = pose.measure_row("budget", "ram_async", 0.5, sizes, torch.randn(1, 1560, 16).bfloat16(),
                           pose.Reprojection(sizes, torch.device("cpu")), runs=1)
    half = sizes.cache_bytes // 2
    assert row["exact"] and row["windows"] == 2
    # the first window fills the whole budget, the second gets none of it: all of it in files
    assert half * 0.9 < row["bytes"]["host_pinned"] + row["bytes"]["host_pageable"] <= half
    assert row["spill_bytes"] >= half


def test_the_command_prints_the_table_and_writes_every_field(tmp_path, capsys):
    out = tmp_path / "pose.json"
    assert cli.main(["--pose", "--frames", "1", "--runs", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "ram budget 50% |" in text and "width 128" in text and "NO" not in text
    result = json.loads(out.read_text())
    assert result["sizes"]["cache_bytes"] == 1560 * 128 * 2 * 40
    assert result["sizes"]["full_width_cache_bytes"] == 1560 * 5120 * 2 * 40
    assert result["device"] == "cpu" and result["compute_s"] > 0
    assert [r["row"] for r in result["pose_rows"]] == [label for label, _, _ in pose.ROWS]
    assert all(set(r) == ROW_FIELDS for r in result["pose_rows"])


def test_a_cache_larger_than_the_free_memory_is_refused_before_anything_is_allocated(monkeypatch, capsys):
    full = pose.pose_sizes("full", 81)
    assert posecli.shortfall(full, torch.device("cpu"), "", free={"RAM": 64 * GiB, "disk": 64 * GiB}) is None
    free = {"RAM": 64 * GiB, "disk": 8 * GiB, "device": 80 * GiB}
    line = posecli.shortfall(full, torch.device("cuda"), "", free=free)
    assert line.startswith("bench --pose: a 12.50 GiB pose cache") and "disk 12.50 GiB (8.00 GiB free)" in line
    assert "RAM" not in line and "device" not in line and "fewer --frames" in line
    monkeypatch.setattr(posecli, "_free", lambda device, folder: {"RAM": GiB, "disk": 64 * GiB})
    monkeypatch.setattr(pose, "measure", lambda *a, **k: pytest.fail("measured after a refusal"))
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--pose", "--size", "full", "--device", "cpu"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "RAM" in err

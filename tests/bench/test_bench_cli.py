"""The benchmark command: row selection, the full table and JSON on a short run, the plot's fallback."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("diffusers", reason="the benchmark needs diffusers 0.42")

from offload_core.bench import main  # noqa: E402
from offload_core.bench.probes import RssPeak  # noqa: E402
from offload_core.bench.rows import ALL_ROWS, select_rows  # noqa: E402

COLUMNS = {"latency_s", "ratio_to_gpu", "peak_device_allocated", "peak_kv_device", "peak_rss", "kv_bytes",
           "exposed_wait_s", "modes", "label", "key"}


def test_the_default_rows_are_the_verdicts_and_all_is_the_fifteen_of_the_table():
    assert [r.key for r in select_rows(None)] == [
        "none", "gpu", "ram_async", "file_async_cold", "device_50", "host_50"]
    assert [r.key for r in select_rows("all")] == [
        "none", "gpu_upstream", "gpu", "ram_sync", "ram_async",
        "file_sync_warm", "file_async_warm", "file_sync_cold", "file_async_cold",
        "device_25", "device_50", "device_75", "host_50", "gpu_fp8", "gpu_int8"]
    assert select_rows("all") == list(ALL_ROWS)


def test_mode_shorthands_select_rows_in_table_order():
    assert [r.key for r in select_rows("cold,gpu")] == ["gpu", "file_sync_cold", "file_async_cold"]
    assert [r.key for r in select_rows("file_async, off")] == ["none", "file_async_warm", "file_async_cold"]
    assert [r.key for r in select_rows("auto")] == ["auto"]


def test_unknown_mode_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"unknown row 'vram'.*ram_sync"):
        select_rows("gpu,vram")


@pytest.mark.parametrize("argv", [["--resolution", "100"], ["--runs", "0"], ["--modes", "bogus"]])
def test_bad_arguments_exit_with_usage(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_short_run_prints_the_table_and_writes_every_row_and_column(tmp_path, capsys):
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    modes = "none,gpu_upstream,gpu,ram_sync,ram_async,file_sync_cold,file_async_warm"
    assert main(["--runs", "1", "--steps", "2", "--resolution", "64", "--modes", modes,
                 "--json", str(out_json), "--plot", str(out_png)]) == 0
    printed = capsys.readouterr().out
    for label in ("no cache", "gpu, upstream lifetime", "gpu, pre-VAE cleanup", "ram_async", "file_sync, cold"):
        assert label in printed
    assert "Hardware:" in printed and "peak KV MiB on the device (engine)" in printed
    assert " range s |" in printed
    # The headline names the request it is about: the real model the tiny one stands for, a projection.
    headline = "Recommendation: For a real 1024x1024 Qwen-Image 2.1 request on this machine (projected from its sizes)"
    assert printed.count(headline + ", use mode ") == 1 and "measured here on the tiny built-in model" in printed

    data = json.loads(out_json.read_text())
    rows = {r["key"]: r for r in data["rows"]}
    assert list(rows) == [r.key for r in select_rows(modes)]
    assert all(COLUMNS <= set(r) for r in rows.values())
    assert data["hardware"]["cpu_count"] >= 1 and data["settings"]["steps"] == 2
    load, free = data["hardware"]["load"], data["hardware"]["free"]
    assert load["before"]["cpu_count"] >= 1 and len(load["after"]["load_avg"]) == 3 and free["ram"] > 0
    verdict = data["verdict"]
    assert verdict["projected"]
    assert verdict["mode"] in ("gpu", "ram_async", "file_async", "off") and verdict["evidence"] in rows
    assert verdict["headline"] in printed and all(reason in printed for reason in verdict["why"])
    assert all(r["latency_min_s"] <= r["latency_s"] <= r["latency_max_s"] for r in rows.values())
    assert rows["gpu_upstream"]["ratio_to_gpu"] == pytest.approx(1.0)
    # The same K/V, wherever it lives: the upstream cache, our gpu tier, RAM and files hold identical byte counts.
    kv = rows["gpu_upstream"]["kv_bytes"]["device"]
    assert kv > 0 and rows["none"]["kv_bytes"]["device"] == 0
    assert rows["gpu"]["kv_bytes"]["device"] == kv
    assert rows["ram_sync"]["kv_bytes"]["host_pageable"] + rows["ram_sync"]["kv_bytes"]["host_pinned"] == kv
    # (the cold file tier aligns each tensor to a 4 KiB block for O_DIRECT: at most one block of padding per tensor)
    layers = 2 * 6
    assert kv <= rows["file_sync_cold"]["kv_bytes"]["file"] <= kv + layers * 4096
    # The tiny cache the verdict names is counted once (not a streamed row's ring slots beside its RAM copy).
    assert kv <= verdict["workload"]["measured_cache_bytes"] <= kv + layers * 4096
    # Offloaded modes keep less of it on the device than the whole cache.
    assert rows["ram_sync"]["peak_kv_device"] < rows["gpu"]["peak_kv_device"] == kv
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_how_to_install_it(monkeypatch, tmp_path):
    from offload_core.bench.plot import write_plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    row = {"key": "gpu", "label": "gpu", "latency_s": 1.0, "peak_device_allocated": None, "peak_kv_device": 1}
    message = write_plot(str(tmp_path / "p.png"), [row], "t", "cpu")
    assert "pip install matplotlib" in message and not (tmp_path / "p.png").exists()


def test_rss_peak_sees_a_transient_allocation():
    import mmap

    rss = RssPeak()
    if not rss.exact:
        pytest.skip("no resettable kernel RSS high-water mark on this platform")
    rss.start()
    base = rss.read()
    # 64 MiB of fresh anonymous pages, each touched: a heap block could reuse pages already resident (and
    # counted), which left the peak where it was once earlier tests had grown the heap
    block = mmap.mmap(-1, 64 * 2**20)
    for offset in range(0, len(block), mmap.PAGESIZE):
        block[offset] = 1
    block.close()
    assert rss.read() >= base + 60 * 2**20
    rss.start()
    assert rss.read() < base + 60 * 2**20


def test_module_entry_point_runs_the_benchmark_parser():
    done = subprocess.run([sys.executable, "-m", "offload_core", "bench", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "--model PATH" in done.stdout and "--plot FILE" in done.stdout


def test_model_folder_of_flux2_klein_kv_runs_without_the_no_cache_row(tmp_path, capsys):
    from offload_core.bench import models

    folder = tmp_path / "flux2"
    models.flux2_klein_kv_pipeline().save_pretrained(folder)
    out_json = tmp_path / "flux.json"
    assert main(["--model", str(folder), "--runs", "1", "--steps", "2", "--resolution", "64",
                 "--modes", "none,gpu_upstream,ram_async", "--json", str(out_json)]) == 0
    data = json.loads(out_json.read_text())
    assert [r["key"] for r in data["rows"]] == ["gpu_upstream", "ram_async"]
    assert "FLUX.2 Klein KV has no uncached mode" in data["settings"]["text"]
    assert data["rows"][1]["kv_bytes"]["host_pageable"] == data["rows"][0]["kv_bytes"]["device"] > 0


def test_model_folder_must_be_a_supported_pipeline(tmp_path, capsys):
    for content, expected in ((None, "has no model_index.json"), ("[1]", "cannot be read as a JSON object"),
                              ('{"_class_name": "StableDiffusionPipeline"}', "holds a StableDiffusionPipeline")):
        if content is not None:
            (tmp_path / "model_index.json").write_text(content)
        with pytest.raises(SystemExit) as exc:
            main(["--model", str(tmp_path), "--runs", "1"])
        assert exc.value.code == 2 and expected in capsys.readouterr().err


def test_dial_and_lossy_rows_measure_budgets_error_and_psnr(tmp_path, capsys):
    out_json = tmp_path / "bench.json"
    assert main(["--runs", "1", "--steps", "2", "--resolution", "64", "--modes", "gpu,dial,lossy",
                 "--json", str(out_json)]) == 0
    printed = capsys.readouterr().out
    assert "K/V error, image vs exact" in printed and "PSNR" in printed
    rows = {r["key"]: r for r in json.loads(out_json.read_text())["rows"]}
    layers = 6  # the built-in model; budgets are whole layers of one store's cache
    assert [rows[k]["plan"]["device"] for k in ("device_25", "device_50", "device_75")] == [1, 3, 4]
    # Resident layers plus the depth + 1 = 2 slots: 3, 5 and (4 + 2 =) all 6 layers of this small model.
    assert rows["device_25"]["peak_kv_device"] < rows["device_50"]["peak_kv_device"] \
        < rows["device_75"]["peak_kv_device"] <= rows["gpu"]["peak_kv_device"]
    assert rows["host_50"]["plan"]["file"] == layers - 3 and rows["host_50"]["kv_bytes"]["file"] > 0
    for key, bound in (("gpu_fp8", 0.04), ("gpu_int8", 0.015)):
        assert 0 < rows[key]["kv_error"]["relative"] <= bound and rows[key]["psnr_db"] > 20
        assert rows[key]["kv_bytes"]["device"] < 0.6 * rows["gpu"]["kv_bytes"]["device"]
    assert rows["gpu"]["kv_error"] is None and rows["gpu"]["psnr_db"] is None


def test_rerun_row_reports_its_speedup_over_the_same_request_without_reuse(tmp_path, capsys):
    out_json = tmp_path / "bench.json"
    assert main(["--runs", "1", "--steps", "2", "--resolution", "64", "--modes", "reuse", "--json", str(out_json)]) == 0
    rows = {r["key"]: r for r in json.loads(out_json.read_text())["rows"]}
    assert list(rows) == ["ram_async", "rerun"]
    rerun = rows["rerun"]
    assert rerun["reuse_hits"] == 1 and rerun["speedup_vs"] == "ram_async"
    assert rerun["speedup"] == pytest.approx(rows["ram_async"]["latency_s"] / rerun["latency_s"])
    assert f"{rerun['speedup']:.2f}x vs ram_async" in capsys.readouterr().out


def test_flux2_rerun_changes_prompt_and_seed_and_still_hits():
    import torch

    from offload_core.bench import loading, models
    from offload_core.bench.measure import measure_rows, rerun_kwargs
    from offload_core.bench.rows import select_rows

    pipe = models.flux2_klein_kv_pipeline()
    call = loading.call_factory(pipe, builtin=True, steps=2, resolution=64)
    first, second = call(), rerun_kwargs(pipe, call())
    assert second["prompt"] != first["prompt"] and second["generator"].initial_seed() != first["generator"].initial_seed()
    results = measure_rows(pipe, select_rows("reuse"), call, runs=1, device=torch.device("cpu"))
    assert results[1]["reuse_hits"] == 1 and results[1]["speedup"] > 0


@pytest.mark.parametrize("no_plot", [False, True])
def test_the_plot_is_written_beside_the_json_unless_asked_not_to(tmp_path, no_plot, capsys):
    out_json = tmp_path / "run.json"
    argv = ["--runs", "1", "--steps", "2", "--resolution", "64", "--modes", "gpu,ram_async", "--json", str(out_json)]
    assert main(argv + (["--no-plot"] if no_plot else [])) == 0
    assert (tmp_path / "run.png").exists() is not no_plot
    assert ("Plot written to" in capsys.readouterr().out) is not no_plot

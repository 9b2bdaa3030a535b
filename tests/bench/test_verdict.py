"""The benchmark's recommendation: the place from the free figures, the cost and the doubts from the rows."""

import pytest

from offload_core.bench.plot import pareto_front
from offload_core.bench.verdict import GiB, add_spread, recommend, reliability


def _row(key, mode, times, device_kv, config=None):
    return {"key": key, "label": key, "mode": mode, "config": config or {}, "latencies_s": times,
            "latency_s": sorted(times)[len(times) // 2], "peak_kv_device": device_kv}


def _rows(file_times=(2.0, 2.1, 2.2)):
    rows = [_row("none", None, [3.0, 3.1, 3.2], 0), _row("gpu", "gpu", [1.0, 1.1, 1.2], 8),
            _row("ram_async", "ram_async", [1.1, 1.15, 1.2], 2), _row("device_50", "ram_async", [1.0, 1.05, 1.1], 5),
            _row("host_50", "ram_async", [1.5, 1.6, 1.7], 2),
            _row("file_async_cold", "file_async", list(file_times), 2),
            _row("gpu_fp8", "gpu", [0.9, 1.0, 1.0], 4, {"storage": "fp8"})]
    add_spread(rows)
    return rows


WORKLOAD = {"cache_bytes": 4 * GiB, "other_device_bytes": 20 * GiB, "what": "a real request"}


def _free(device, ram, disk=100, unified=False):
    return {"device": device * GiB, "ram": ram * GiB, "disk": disk * GiB, "disk_dir": "/d", "unified": unified}


def test_the_cache_stays_on_a_device_it_fits_on_with_a_streamed_fallback_named():
    v = recommend(_rows(), _free(device=32, ram=64), WORKLOAD)
    assert (v["mode"], v["settings"], v["evidence"]) == ("gpu", {}, "gpu")
    assert v["headline"] == "For a real request on this machine, use mode gpu: the cache fits on the device"
    assert "fits in the device's free memory (12.0 GiB left beside the model)" in v["why"][0]
    # The streamed row keeping least on the device without being measurably slower; the lossy row is never one.
    assert "if that memory gets tight: 'ram_async' was not measurably slower" in v["why"][-1]


def test_a_tight_device_keeps_what_fits_resident_and_streams_the_rest_from_ram():
    v = recommend(_rows(), _free(device=22.3, ram=64), WORKLOAD)
    assert v["mode"] == "ram_async" and v["settings"] == {"device_budget": 2 * GiB + (256 << 20)}
    assert v["call"] == f'enable_kv_offload(pipe, mode="ram_async", device_budget={2 * GiB + (256 << 20)})'
    assert v["evidence"] == "device_50" and "within the noise of it" in v["why"][1]


def test_short_ram_puts_the_rest_in_files_and_no_room_anywhere_means_no_cache():
    v = recommend(_rows(), _free(device=10, ram=6, disk=100), WORKLOAD)
    assert (v["mode"], v["settings"], v["evidence"]) == ("ram_async", {"host_budget": 3 * GiB}, "host_50")
    v = recommend(_rows(), _free(device=10, ram=2, disk=4), WORKLOAD)
    assert (v["mode"], v["evidence"]) == ("off", "none") and "fits nowhere here" in v["why"][0]


def test_on_unified_memory_no_ram_tier_is_picked_and_a_file_tier_slower_than_no_cache_loses():
    v = recommend(_rows(), _free(device=22, ram=22, unified=True), WORKLOAD)
    assert (v["mode"], v["evidence"]) == ("file_async", "file_async_cold")
    assert "does not fit in RAM (this device's own memory) beside the model (2.0 GiB left); the disk" in v["why"][0]
    slow = recommend(_rows(file_times=(3.5, 3.6, 3.7)), _free(device=22, ram=22, unified=True), WORKLOAD)
    assert (slow["mode"], slow["evidence"]) == ("off", "none")
    assert "slower here than recomputing the prefix (3.60 vs 3.10 s, every request)" in slow["why"][1]


def test_a_projection_names_its_request_says_so_and_says_which_measured_row_was_the_fastest():
    # The run: the tiny model's rows, where file_async was not the fastest, and a real request's sizes,
    # for which RAM is short on a CPU machine.
    workload = dict(WORKLOAD, request="a real 1024x1024 Qwen-Image 2.1 request", projected=True,
                    measured_cache_bytes=int(7.2 * 2**20))
    v = recommend(_rows(), _free(device=22, ram=22, unified=True), workload)
    assert v["headline"] == ("For a real 1024x1024 Qwen-Image 2.1 request on this machine (projected from its "
                             "sizes), use mode file_async: the cache does not fit beside the model in memory")
    assert v["projected"]
    assert v["why"][1].startswith("measured here on the tiny built-in model: 'file_async_cold' 2.10 s")
    assert v["why"][2].startswith("the fastest row here was 'gpu_fp8', 1.00 s against the pick's 2.10 (beyond the "
                                  "noise): the rows ran a tiny stand-in whose 7.2 MiB cache fits anywhere here")
    assert v["why"][2].endswith("the pick follows where the real request's 4.0 GiB cache fits")
    # The benchmarked model itself: named, not a projection; a pick that was the fastest row is said to be.
    fast = _rows(file_times=(0.5, 0.6, 0.7))
    v = recommend(fast, _free(device=22, ram=22, unified=True),
                  dict(WORKLOAD, request="this model's 1024x1024 request"))
    assert v["headline"].startswith("For this model's 1024x1024 request on this machine, use mode file_async: ")
    assert not v["projected"] and v["why"][1].startswith("measured here: ")
    assert v["why"][2] == "'file_async_cold' was also the fastest row here"


def test_the_notes_name_noisy_rows_and_a_busy_machine_and_stay_quiet_otherwise():
    rows = _rows(file_times=(1.0, 2.0, 3.0))
    assert [r["key"] for r in rows if r["noisy"]] == ["file_async_cold"]
    assert rows[5]["spread"] == pytest.approx(1.0) and rows[5]["latency_min_s"] == 1.0
    calm = {"before": {"load_avg": [0.5, 0.5, 0.5], "cpu_count": 2}, "after": {"load_avg": [1.2, 1, 1], "cpu_count": 2}}
    busy = {"before": {"load_avg": [3.5, 2, 1], "cpu_count": 2}, "after": {"load_avg": [2.0, 2, 1], "cpu_count": 2}}
    assert reliability(_rows(), calm, threads=1) == []
    notes = reliability(rows, busy, threads=1)
    assert len(notes) == 2 and "'file_async_cold' spread by more than 25%" in notes[0]
    assert "load average 3.5 before and 2.0 after, on 2 CPUs" in notes[1]


def test_the_pareto_front_is_what_nothing_beats_in_memory_and_latency():
    points = [(0, 3.0), (8, 1.0), (2, 1.2), (5, 1.1), (2, 2.0), (6, 1.1)]
    assert pareto_front(points) == [0, 2, 3, 1]


def test_every_row_of_the_full_table_gets_its_own_colour_and_marker_and_the_axis_says_what_it_measures():
    from offload_core.bench.plot import COLOURS, MARKERS
    from offload_core.bench.report import memory_axis
    from offload_core.bench.rows import ALL_ROWS

    assert len(set(COLOURS)) >= len(ALL_ROWS) and len(set(MARKERS)) >= len(ALL_ROWS)
    cpu = [{"peak_device_allocated": None, "peak_kv_device": 1}]
    cuda = [{"peak_device_allocated": 5, "peak_kv_device": 1}]
    # On a CPU the device's memory is the RAM: the axis counts K/V in RAM beside the ring's slots on the device.
    assert memory_axis(cpu, "cpu") == ("K/V in the device's memory (a CPU: its RAM): peak on the device + in RAM, "
                                       "MiB (engine figures)")
    assert "resident" not in memory_axis([{"peak_device_allocated": None, "peak_kv_device": 1}], "mps")
    assert memory_axis(cpu, "cuda:0") == "peak K/V on the device (cuda:0), MiB (engine figure)"
    assert memory_axis(cuda, "cuda:0") == "peak VRAM allocated by torch (MiB, max_memory_allocated)"
    assert memory_axis(cuda, "cuda:0", unified=True).endswith("+ K/V in RAM (the same memory)")


def test_a_pipeline_that_always_caches_is_told_so_when_nothing_fits():
    workload = dict(WORKLOAD, can_skip_cache=False)
    v = recommend(_rows(), _free(device=10, ram=2, disk=4), workload)
    assert v["mode"] == "off" and "always caches" in v["why"][-1]

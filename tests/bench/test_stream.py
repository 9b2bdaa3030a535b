"""`python -m offload_core stream`: runs end to end on a small cache and reports every figure it promises."""

import json
import time

import pytest
import torch

from offload_core.__main__ import main as offload_main
from offload_core.bench.stream import run as stream, cli as streamcli, report as streamreport


def test_stream_reports_every_mode_against_the_raw_limits(tmp_path, capsys):
    out = tmp_path / "stream.json"
    code = offload_main(["stream", "--cache-mib", "16", "--layer-mib", "4", "--depths", "1,2", "--requests", "2,4",
                         "--dir", str(tmp_path), "--json", str(out)])  # as `python -m offload_core stream ...`
    assert code == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    limits = result["limits"]["file"]
    tried = {f"{r}MiBx{n}{tail}" for r in (2, 4) for n in (1, 2) for tail in ("", "-nofalloc")}
    assert set(limits["read_gib_s"]) == set(limits["write_gib_s"]) == tried and limits["best_read_gib_s"] > 0
    assert limits["best_read_pattern"] in tried and result["sweep_bytes"] == 16 << 20
    rows = {r["mode"]: r for r in result["rows"]}
    assert set(rows) == {"ram_sync", "ram_async", "file_sync", "file_async"}
    assert all(r["exact"] for r in rows.values())
    for mode in ("file_sync", "file_async"):
        assert rows[mode]["get_vs_raw"] == pytest.approx(rows[mode]["get_gib_s"] / limits["limit_read_gib_s"])
        assert rows[mode]["put_vs_raw"] == pytest.approx(rows[mode]["put_gib_s"] / limits["limit_write_gib_s"])
        assert rows[mode]["get_vs_paired"] > 0 and rows[mode]["put_vs_paired"] > 0
        assert all(r["paired_raw_read_gib_s"] > 0 and r["paired_raw_verified_read_gib_s"] > 0 for r in rows[mode]["rounds"])
        assert rows[mode]["get_vs_paired_verified"] > 0
        assert rows[mode]["get_vs_verified"] == pytest.approx(rows[mode]["get_gib_s"] / limits["limit_verified_read_gib_s"])
    assert 0 <= rows["file_async"]["exposed_s"] and rows["file_async"]["hidden"] <= 1
    assert limits["limit_passes"] == 3 * result["rounds"]  # raw passes around the two file modes in every round
    assert "get / raw read" in printed and "raw file limit" in printed and "file_async" in printed
    assert "a raw reader that verifies what it reads" in printed and "of the verifying reader" in printed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stream.json"]  # the raw file and the stores are gone


@pytest.mark.parametrize("argv, match", [
    (["--layer-mib", "0"], "--layer-mib must be >= 1"),
    (["--modes", "ram_sync,disk"], "unknown"),
    (["--depths", "1,x"], "comma-separated integers"),
    (["--depths", "0,2"], "--depths must all be between 1 and 64"),
    (["--requests", "2048"], "--requests must all be between 1 and 256"),
    (["--requests", "64", "--cache-mib", "32", "--layer-mib", "4"], "larger than the cache"),
    (["--dir", "/nonexistent/kv"], "not an existing directory"),
])
def test_bad_options_are_refused_with_the_rule(argv, match, capsys):
    with pytest.raises(SystemExit):
        streamcli.main(argv)
    assert match in capsys.readouterr().err


def test_the_old_tiers_option_still_picks_the_modes_and_says_it_is_deprecated(capsys):
    parser = streamcli.build_parser()
    args = parser.parse_args(["--tiers", "ram_sync,file_sync"])
    assert args.modes == "ram_sync,file_sync"
    assert "--tiers is deprecated" in capsys.readouterr().err and "--modes" in parser.format_help()
    assert parser.parse_args([]).modes == ",".join(streamcli.MODES)


def test_the_extraction_figure_counts_until_the_last_layer_is_on_disk(tmp_path, monkeypatch):
    """file_async queues its writes; its put figure must include them (a put loop alone only copies)."""
    from offload_core.tiers.file import filewrite as file_tier

    real = file_tier.pwrite_all

    def slow(*args):
        time.sleep(0.05)
        real(*args)

    monkeypatch.setattr(file_tier, "pwrite_all", slow)
    args = streamcli.build_parser().parse_args(["--cache-mib", "16", "--layer-mib", "4", "--compute-ratio", "0"])
    k, v = stream._layer(4 << 20, torch.device("cpu"))
    row = stream.measure_mode("file_async", args, torch.device("cpu"), str(tmp_path), k, v)
    # 4 layers, each one data chunk and then its header, the headers one after another on the write lane:
    # >= 50 ms + 4 x 50 ms once the figure waits for the disk; the put loop alone returns after about 150 ms
    # (the third put waits for a write staging buffer, freed when the first layer is written).
    assert row["put_gib_s"] <= (16 / 1024) / 0.25


def test_every_figure_is_the_median_of_the_rounds_and_the_best_of_ones_are_kept():
    def raw(w, r, passes):
        return {"file": {"write_gib_s": {1: w, 4: w + 0.5}, "read_gib_s": {1: r, 4: r - 0.5},
                         "passes": [{"write": pw, "read": pr, "verified_read": pr / 2} for pw, pr in passes]},
                "ram_gib_s": w}

    def mode_row(put, get):
        return [{"mode": "file_async", "put_gib_s": put, "get_gib_s": get, "read_ms_per_layer": 1.0, "hidden": get / 10,
                 "compute_ms_per_layer": 1.0, "loop_s": 1.0, "exposed_s": 0.1, "store_exposed_wait_s": 0.1,
                 "exact": True}]

    # A disk that was fast in one round only: the medians ignore the outlier, the best-of figures keep it.
    rounds = [(raw(1.0, 2.0, [(1.0, 2.0), (1.1, 2.1)]), mode_row(0.9, 1.8)),
              (raw(9.0, 9.0, [(2.2, 1.9), (0.8, 3.0)]), mode_row(1.1, 1.9)),
              (raw(1.2, 2.2, [(0.9, 4.0), (1.0, 1.5)]), mode_row(1.0, 2.0))]
    for (_, (row,)), (w, r) in zip(rounds, [(1.0, 2.0), (2.2, 1.9), (1.0, 4.0)]):
        # per-round ratios 0.9/0.5/1.0, 0.9/1.0/0.5; against the verifying reader (at half the read) twice those
        row.update(paired_raw_write_gib_s=w, paired_raw_read_gib_s=r, paired_raw_verified_read_gib_s=r / 2)
    limits, rows = streamreport.combine(rounds, torch.device("cpu"))
    f = limits["file"]
    assert f["write_gib_s"] == {1: 1.2, 4: 1.7} and f["best_write_pattern"] == 4 and f["best_write_gib_s"] == 1.7
    assert f["read_gib_s"] == {1: 2.2, 4: pytest.approx(1.7)} and f["best_read_gib_s"] == 2.2
    assert f["max_write_gib_s"] == 9.5 and f["max_read_gib_s"] == 9.0 and len(limits["rounds"]) == 3
    # The limit the ratios use: the best depth measured again, in the passes around the modes (not the sweep's
    # best median, which is read off the same samples that picked it), with how far those passes spread.
    assert (f["limit_write_gib_s"], f["limit_read_gib_s"], f["limit_passes"]) == (1.0, 2.05, 6)
    assert f["limit_write_range"] == [0.8, 2.2] and f["limit_read_range"] == [1.5, 4.0]
    row = rows[0]
    assert (row["put_gib_s"], row["get_gib_s"], row["best_put_gib_s"], row["best_get_gib_s"]) == (1.0, 1.9, 1.1, 2.0)
    assert row["hidden"] == 0.19 and len(row["rounds"]) == 3
    assert row["put_vs_paired"] == 0.9 and row["get_vs_paired"] == 0.9
    assert row["put_vs_paired_range"] == pytest.approx([0.5, 1.0]) and row["get_vs_paired_range"] == [0.5, 1.0]
    assert f["limit_verified_read_gib_s"] == 1.025 and f["limit_verified_read_range"] == [0.75, 2.0]
    assert row["get_vs_paired_verified"] == 1.8 and row["get_vs_paired_verified_range"] == [1.0, 2.0]
    assert row["get_vs_verified"] == pytest.approx(1.9 / 1.025)


def test_the_verifying_reader_takes_a_checksum_of_every_request_it_reads(tmp_path, monkeypatch):
    """The reference for the file tiers' checks: the same read, each request hashed by the thread that read it."""
    from offload_core.bench.stream import rawio

    hashed = []
    monkeypatch.setattr(rawio, "digest", lambda view: hashed.append(len(view)) or 0)
    pattern = rawio.Pattern(1 << 20, 2)
    plain = rawio.file_limits(str(tmp_path), 4 << 20, [pattern])
    assert hashed == [] and plain["verified_read_gib_s"] == {}
    got = rawio.file_limits(str(tmp_path), 4 << 20, [pattern], verified=[pattern.label])
    assert hashed == [1 << 20] * 8  # 4 requests, in each of two passes, each hashed whole
    assert got["verified_read_gib_s"][pattern.label] > 0 and list(tmp_path.iterdir()) == []


def test_each_file_mode_is_bracketed_by_raw_passes_and_every_other_round_runs_backwards(monkeypatch):
    """A disk that speeds up during a round: each mode's paired limit is the mean of the passes around it."""
    calls, speed = [], iter(range(1, 100))

    def raw_pass(directory, total, sweep):
        calls.append("raw")
        x = float(next(speed))
        return {"write": x, "read": 2 * x}

    def measured(mode, *args):
        calls.append(mode)
        return {"mode": mode}

    monkeypatch.setattr(stream, "_raw_pass", raw_pass)
    monkeypatch.setattr(stream, "measure_mode", measured)
    rows, passes = stream._round(["ram_sync", "file_sync", "file_async"], None, None, "", None, None, 0, {})
    assert calls == ["ram_sync", "raw", "file_sync", "raw", "file_async", "raw"]  # one pass shared between modes
    assert passes == [{"write": 1.0, "read": 2.0}, {"write": 2.0, "read": 4.0}, {"write": 3.0, "read": 6.0}]
    assert rows["file_sync"]["paired_raw_write_gib_s"] == 1.5 and rows["file_async"]["paired_raw_read_gib_s"] == 5.0
    assert "paired_raw_write_gib_s" not in rows["ram_sync"]

    calls.clear()
    monkeypatch.setattr(stream.rawio, "file_limits", lambda *a: {"write_gib_s": {1: 1.0}, "read_gib_s": {1: 1.0}})
    monkeypatch.setattr(stream.rawio, "ram_limit", lambda n: 1.0)
    monkeypatch.setattr(stream.rawio, "small_pages", lambda *a: {})
    monkeypatch.setattr(streamreport, "combine", lambda rounds, device: ({"file": {}}, []))
    parser = streamcli.build_parser()
    args = parser.parse_args(["--cache-mib", "4", "--layer-mib", "4", "--rounds", "2", "--requests", "4",
                              "--modes", "file_sync,file_async", "--device", "cpu"])
    streamcli.check(args, parser)
    stream.run(args)
    assert calls == ["raw", "file_sync", "raw", "file_async", "raw", "raw", "file_async", "raw", "file_sync", "raw"]


def _result(write_range, read_range):
    file = {"write_gib_s": {"8MiBx4": 1.0}, "read_gib_s": {"8MiBx4": 1.0}, "o_direct": True,
            "best_write_gib_s": 1.0, "best_read_gib_s": 1.0, "best_write_pattern": "8MiBx4", "best_read_pattern": "8MiBx4",
            "limit_write_gib_s": 1.0, "limit_read_gib_s": 1.0, "limit_write_range": write_range,
            "limit_read_range": read_range, "limit_passes": 3, "max_write_gib_s": 1.0, "max_read_gib_s": 1.0}
    row = {"mode": "file_sync", "put_gib_s": 0.9, "get_gib_s": 0.95, "put_vs_raw": 0.9, "get_vs_raw": 0.95,
           "read_ms_per_layer": 1.0, "exact": True, "put_vs_paired": 0.91, "get_vs_paired": 0.96,
           "put_vs_paired_range": [0.85, 0.97], "get_vs_paired_range": [0.9, 1.0],
           "best_put_vs_max_raw": 0.9, "best_get_vs_max_raw": 0.95,
           "file_io": {"pattern": "4MiBx8"}}
    return {"device": "cpu", "cache_bytes": 1 << 30, "layer_bytes": 64 << 20, "directory": "/d", "chunk_bytes": 8 << 20,
            "filesystem_in_ram": None, "io_depth": 4, "prefetch_depth": 2, "compute_ratio": 1.5, "rounds": 3,
            "limits": {"file": file, "ram_gib_s": 10.0}, "rows": [row]}


def test_the_table_says_when_the_disk_moved_too_much_to_settle_a_ratio():
    steady = streamreport.table(_result([0.95, 1.05], [0.9, 1.05]))
    assert "(0.95-1.05)" in steady and "put 91% (85%-97%)" in steady and "note:" not in steady
    assert "| file_sync  | 4MiBx8             |" in steady  # the file tier's request size and depth
    assert "verif" not in steady  # a result from before the verifying reader existed still prints
    result = _result([0.95, 1.05], [0.9, 1.05])
    result["limits"]["file"].update(limit_verified_read_gib_s=0.94, limit_verified_read_range=[0.9, 0.99])
    result["rows"][0].update(get_vs_paired_verified=0.97, get_vs_paired_verified_range=[0.93, 1.02])
    checked = streamreport.table(result)
    assert "same pattern, in the same passes: 0.94 (0.90-0.99) GiB/s, 94% of the raw read" in checked
    assert "get 96% (90%-100%), 97% of the verifying reader (93%-102%)" in checked
    noisy = streamreport.table(_result([0.9, 1.05], [0.7, 1.2]))
    assert "note: the disk's raw read throughput moved by more than 20%" in noisy


def test_the_hiding_loop_is_measured_in_its_steady_state(tmp_path, monkeypatch):
    """One compute comes before the timed loop with compute, after the plain get passes (as the previous step's
    last layer in a real loop), so the first layers' prefetch has something to hide behind."""
    events = []
    real_pass = stream._pass

    def recording_pass(store, layers, device, compute=None):
        events.append("timed loop with compute" if compute is not None else "get pass")
        return real_pass(store, layers, device, compute)

    monkeypatch.setattr(stream, "_pass", recording_pass)
    monkeypatch.setattr(stream._Compute, "__call__", lambda self: events.append("compute"))
    args = streamcli.build_parser().parse_args(["--cache-mib", "8", "--layer-mib", "4"])
    k, v = stream._layer(4 << 20, torch.device("cpu"))
    stream.measure_mode("file_async", args, torch.device("cpu"), str(tmp_path), k, v)
    assert events[:3] == ["get pass", "get pass", "compute"]
    assert events[3] == "timed loop with compute"


def test_the_sweep_skips_a_pattern_whose_ring_would_pass_its_memory_cap():
    from offload_core.bench.stream import rawio

    tried = {p.label for p in rawio.patterns([16 << 20, 32 << 20], [4, 16])}
    assert tried == {"16MiBx4", "16MiBx4-nofalloc", "16MiBx16", "16MiBx16-nofalloc", "32MiBx4", "32MiBx4-nofalloc"}
    assert rawio.parse("32MiBx4-nofalloc") == rawio.Pattern(32 << 20, 4, False)  # labels round-trip
    ring = rawio.patterns([16 << 20], [16], ring_bytes=64 << 20)  # the reference: 16 requests, 4 buffers
    assert [p.ring for p in ring] == [4, 4] and all(rawio.parse(p.label) == p for p in ring)
    from offload_core.bench.stream import cli as streamcli

    assert streamcli.MAX_RING_MIB << 20 == rawio.RING_CAP
    for pattern in (rawio.Pattern(8 << 20, 2, True, False), rawio.Pattern(8 << 20, 2, False, False)):
        assert rawio.parse(pattern.label) == pattern and pattern.label.endswith("-4k")


def test_small_pages_measures_the_best_patterns_again_in_4k_pages(tmp_path, monkeypatch):
    """The 4 KiB comparison runs the sweep's best write and read patterns with `huge=False`, each against the
    same pattern's sweep figure; the table prints it."""
    from offload_core.bench.stream import rawio

    seen = []
    real = rawio.file_limits

    def recording(directory, total, tried):
        seen.extend(tried)
        return real(directory, total, tried)

    monkeypatch.setattr(rawio, "file_limits", recording)
    sweep = {"best_write_pattern": "4MiBx1", "best_read_pattern": "4MiBx2-nofalloc",
             "write_gib_s": {"4MiBx1": 1e-9, "4MiBx2-nofalloc": 1.0}, "read_gib_s": {"4MiBx1": 1.0, "4MiBx2-nofalloc": 1e-9}}
    ratios = rawio.small_pages(str(tmp_path), 8 << 20, sweep)
    assert seen == [rawio.Pattern(4 << 20, 1, True, False), rawio.Pattern(4 << 20, 2, False, False)]
    assert ratios["write"] > 1 and ratios["read"] > 1  # against a sweep figure set near zero
    seen.clear()
    same = dict(sweep, best_read_pattern="4MiBx1", read_gib_s={"4MiBx1": 1e-9})
    assert set(rawio.small_pages(str(tmp_path), 8 << 20, same)) == {"write", "read"}
    assert seen == [rawio.Pattern(4 << 20, 1, True, False)]  # one pattern best at both: measured once
    result = _result([1.0, 1.0], [1.0, 1.0])
    result["limits"]["file"]["small_pages"] = {"write": 0.98, "read": 0.61}
    assert "in 4 KiB pages instead: write 98%, read 61%" in streamreport.table(result)

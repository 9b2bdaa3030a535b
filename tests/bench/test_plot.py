"""The bench's plot: every row has its own visible point and legend entry, and the verdict's reason is written."""

import numpy as np
import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from offload_core.bench.plot import write_plot  # noqa: E402

MiB = 1 << 20


def _row(key, latency, kv, ram=0.0, file=0.0, times=None):
    low, high = times or (latency, latency)
    return {"key": key, "label": key, "latency_s": latency, "latency_min_s": low, "latency_max_s": high,
            "peak_device_allocated": None, "peak_kv_device": kv,
            "kv_bytes": {"device": kv, "host_pinned": 0, "host_pageable": ram, "file": file}}


def _draw(tmp_path, monkeypatch, rows, **kwargs):
    """The figure `write_plot` saved, kept open to read its artists back."""
    figs = []
    monkeypatch.setattr(plt, "close", figs.append)
    kwargs.setdefault("headline", "For a real request on this machine, use mode file_async: reasons")
    assert write_plot(str(tmp_path / "b.png"), rows, device=kwargs.pop("device", "cpu"), **kwargs) is None
    assert (tmp_path / "b.png").stat().st_size > 0
    return figs[0]


def _series(ax):
    """key -> (x, y) of the point each row's series draws (the label starts with the row's key)."""
    return {c.get_label().split(":")[0]: tuple(c.lines[0].get_xydata()[0]) for c in ax.containers}


def _front(ax):
    line = next(line for line in ax.get_lines() if "Pareto" in line.get_label())
    return [tuple(p) for p in line.get_xydata()]


def _ring(ax):
    ring = next(c for c in ax.collections if c.get_label().startswith("recommended"))
    return tuple(ring.get_offsets()[0]), ring.get_label()


# The issue's run (docs/benchmark.md, 2-core CPU): the tiny model's rows, file_async picked for the real request.
ISSUE_ROWS = [_row("none", 3.581, 0, times=(2.95, 7.74)),
              _row("gpu", 2.881, 7.2 * MiB, times=(2.79, 3.52)),
              _row("ram_async", 2.997, 2.4 * MiB, ram=7.2 * MiB, times=(2.98, 3.16)),
              _row("file_async_cold", 3.274, 2.4 * MiB, file=7.2 * MiB, times=(2.92, 3.52)),
              _row("device_50", 2.425, 6.0 * MiB, ram=3.6 * MiB, times=(2.37, 2.95)),
              _row("host_50", 2.108, 2.4 * MiB, ram=3.6 * MiB, file=3.6 * MiB, times=(2.09, 2.38))]


def test_coinciding_rows_each_visible_and_reason_written(tmp_path, monkeypatch):
    # Three rows on one point (same latency, same memory), as the default table gives on a CPU.
    rows = [_row("gpu", 1.5, 7e6), _row("ram_async", 1.6, 2.4e6), _row("file_async_cold", 1.6, 2.4e6),
            _row("host_50", 1.6, 2.4e6)]
    reason = "the cache does not fit beside the model in memory"
    fig = _draw(tmp_path, monkeypatch, rows, recommended="file_async_cold", reasons=(reason,))
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    for r in rows:
        assert sum(label.startswith(f"{r['key']}:") for label in labels) == 1
    points = [tuple(line.get_xydata()[0]) for line in ax.get_lines() if line.get_marker() not in ("None", "", None)
              and len(line.get_xydata()) == 1]
    assert len(set(points)) == len(rows)  # no two rows drawn on one point
    markers = {line.get_marker() for line in ax.get_lines() if len(line.get_xydata()) == 1}
    assert len(markers) >= len(rows)
    texts = " ".join(t.get_text() for t in fig.texts).replace("\n", " ")
    assert reason in texts


def test_the_ring_sits_on_the_picked_rows_point_and_that_point_on_the_pareto_line(tmp_path, monkeypatch):
    # On a CPU the device's memory is the RAM: ram_async's copy there counts beside its ring's slots, so the rows
    # that keep the cache in RAM take more of it, and file_async, the pick, is on the front it was drawn off.
    ax = _draw(tmp_path, monkeypatch, ISSUE_ROWS, recommended="file_async_cold").axes[0]
    series, front = _series(ax), _front(ax)
    (x, y), label = _ring(ax)
    assert (x, y) == series["file_async_cold"] and np.isclose(x, 2.4) and y == 3.274
    assert (x, y) in front and label == "recommended: file_async_cold"
    assert front == [series[k] for k in ("none", "file_async_cold", "host_50")]
    assert np.isclose(series["ram_async"][0], 9.6, atol=0.5) and np.isclose(series["host_50"][0], 6.0)
    # Where the device's memory is not the RAM, RAM copies do not count, and a pick that a row beats on both
    # axes is said to be beaten, in the ring's own legend entry, rather than drawn as if it were on the front.
    ax = _draw(tmp_path, monkeypatch, ISSUE_ROWS, recommended="file_async_cold", device="cuda:0").axes[0]
    (x, y), label = _ring(ax)
    assert (x, y) == _series(ax)["file_async_cold"] and (x, y) not in _front(ax)
    assert label.startswith("recommended: file_async_cold (beaten here on both axes")

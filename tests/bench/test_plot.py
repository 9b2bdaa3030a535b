"""The bench's plot: every row has its own visible point and legend entry, and the verdict's reason is written."""

import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from offload_core.bench.plot import write_plot  # noqa: E402


def _row(key, latency, kv):
    return {"key": key, "label": key, "latency_s": latency, "latency_min_s": latency, "latency_max_s": latency,
            "peak_device_allocated": None, "peak_kv_device": kv}


def test_coinciding_rows_each_visible_and_reason_written(tmp_path, monkeypatch):
    # Three rows on one point (same latency, same memory), as the default table gives on a CPU.
    rows = [_row("gpu", 1.5, 7e6), _row("ram_async", 1.6, 2.4e6), _row("file_async_cold", 1.6, 2.4e6),
            _row("host_50", 1.6, 2.4e6)]
    figs = []
    monkeypatch.setattr(plt, "close", figs.append)
    reason = "the cache does not fit beside the model in memory"
    assert write_plot(str(tmp_path / "b.png"), rows, "Use mode file_async", "cpu",
                      recommended="file_async_cold", reasons=(reason,)) is None
    assert (tmp_path / "b.png").stat().st_size > 0
    fig = figs[0]
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

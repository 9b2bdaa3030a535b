"""The benchmark's plot: latency against device memory, one series per row, the recommendation as its headline.

Its geometry is set here rather than left to autoscaling and `tight_layout` guesses: the headline, the notes
under it and the footer are measured once drawn and the figure grows to hold them above and below the axes'
band; the y label is checked against that band; rows at one memory figure are spread inside the data's range;
the axes' limits leave room for the widest marker, the ring, at every edge. The pure parts (`spread_sideways`,
`padded_limits`, `pareto_front`) are what the tests pin.
"""

from __future__ import annotations

import math
import textwrap

from ..places import MiB
from .report import device_memory, is_unified, memory_axis

# 15 rows and more: each gets its own colour and its own marker (tab20 colours, no two alike).
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd", "#e6550d", "#31a354")
MARKERS = "osD^v<>PXph*H8d"
DPI = 120
WIDTH_IN = 10.0
BAND_IN = 3.9  # the axes' band: the axes, their ticks and the x label
GAP_IN = 0.08  # around each text block
MARKER_SIZE = 8  # points
RING_AREA = 300  # points squared (scatter's `s`): the recommended row's ring
RING_LINE = 2  # points
SPREAD_SHARE = 0.05  # rows at one memory figure are drawn at most this share of the x range apart


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points nothing beats (no other is at least as low in both and lower in one), by x."""
    front = []
    for i, (x, y) in enumerate(points):
        beaten = any((ox <= x and oy <= y) and (ox < x or oy < y) for j, (ox, oy) in enumerate(points) if j != i)
        if not beaten:
            front.append(i)
    return sorted(front, key=lambda i: points[i])


def spread_sideways(xs: list[float], share: float = SPREAD_SHARE) -> list[float]:
    """Rows at one memory figure moved apart so that none hides another (nor the ring), in the order given.

    Each group is at most `share` of the range apart, and spans at most a third of the gap to the nearest other
    figure, so groups never mix. Where the data has a range, a group stays inside it (rows at the lowest or the
    highest figure are spread inwards); a lone figure's group is not drawn below 0.
    """
    distinct = sorted(set(xs))
    if not distinct:
        return []
    lo, hi = distinct[0], distinct[-1]
    span = hi - lo
    out = list(xs)
    for k, x in enumerate(distinct):
        same = [i for i, other in enumerate(xs) if other == x]
        if len(same) < 2:
            continue
        step = share * (span or max(abs(x), 1.0))
        gaps = [abs(x - distinct[j]) for j in (k - 1, k + 1) if 0 <= j < len(distinct)]
        if gaps:
            step = min(step, min(gaps) / 3 / (len(same) - 1))
        width = step * (len(same) - 1)
        start = x - width / 2
        if span >= width:
            start = min(max(start, lo), hi - width)
        elif x >= 0:
            start = max(start, 0.0)
        for rank, i in enumerate(same):
            out[i] = start + rank * step
            if span >= width:
                out[i] = min(max(out[i], lo), hi)  # not past the ends by a rounding
    return out


def padded_limits(lo: float, hi: float, pad_px: float, length_px: float) -> tuple[float, float]:
    """Axis limits around data from `lo` to `hi` that leave `pad_px` pixels between the data and each end of an
    axis `length_px` pixels long (a lone value gets some room around it)."""
    if hi <= lo:
        half = max(abs(lo) * 0.1, 0.5)
        lo, hi = lo - half, hi + half
    usable = max(length_px - 2 * pad_px, 0.2 * length_px)
    per_px = (hi - lo) / usable
    return lo - pad_px * per_px, hi + pad_px * per_px


def ring_radius_px(dpi: float = DPI) -> float:
    """The recommended ring's outer radius in pixels: half its marker's side plus half its line."""
    return (math.sqrt(RING_AREA) / 2 + RING_LINE / 2) * dpi / 72


def _arrange(fig, above: list, below) -> tuple[float, float]:
    """Size the figure to its text and put the axes' band between: `above` stacked from the top (headline,
    notes), `below` at the bottom (footer). Returns the band's bottom and top in figure pixels."""
    renderer = fig.canvas.get_renderer()
    heights = [t.get_window_extent(renderer).height / fig.dpi for t in above]
    low_in = below.get_window_extent(renderer).height / fig.dpi + 2 * GAP_IN if below is not None else GAP_IN
    high_in = GAP_IN + sum(h + GAP_IN for h in heights)
    total = high_in + BAND_IN + low_in
    fig.set_size_inches(WIDTH_IN, total)
    y = total - GAP_IN
    for text, h in zip(above, heights):
        text.set_y(y / total)
        y -= h + GAP_IN
    if below is not None:
        below.set_y(GAP_IN / total)
    fig.tight_layout(rect=(0, low_in / total, 1, (total - high_in) / total))
    return low_in * fig.dpi, (total - high_in) * fig.dpi


def _limits(ax, xs: list[float], lows: list[float], highs: list[float], pad: float) -> None:
    """Both axes' limits for the axes' present size: every point, its range and the ring `pad` pixels inside."""
    box = ax.get_window_extent()
    ax.set_xlim(*padded_limits(min(xs), max(xs), pad, box.width))
    ax.set_ylim(*padded_limits(min(lows), max(highs), pad, box.height))


def _fit_labels(fig, ax, band: tuple[float, float]) -> None:
    """Shrink an axis label that leaves its room: the y label (centred on the axes, and maybe longer) the axes'
    band, the x label (centred under the axes, and maybe wider) the figure's width."""
    fig.canvas.draw()  # places the labels for this layout
    renderer = fig.canvas.get_renderer()
    for label, fits in ((ax.yaxis.label, lambda box: band[0] <= box.y0 and box.y1 <= band[1]),
                        (ax.xaxis.label, lambda box: 0 <= box.x0 and box.x1 <= fig.bbox.width)):
        while label.get_fontsize() > 5 and not fits(label.get_window_extent(renderer)):
            label.set_fontsize(label.get_fontsize() - 0.5)
            fig.canvas.draw()


def write_plot(path: str, rows: list[dict], headline: str, device: str, footer: str = "",
               recommended: str | None = None, cautions: tuple = (), reasons: tuple = (),
               unified: bool | None = None) -> str | None:
    """Save a PNG of median latency (with its range as error bars) against the device memory each row takes
    (`report.device_memory`: on a `unified` device, K/V in RAM included), one series per row, the Pareto front
    joined, the better corner marked, the recommendation's `reasons` and the `cautions` under the headline.
    Returns an error message or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "--plot needs matplotlib, which is not installed: `pip install matplotlib`. The plot was skipped."
    unified = is_unified(device) if unified is None else unified
    mib = [held / MiB for held in device_memory(rows, unified)]
    xs, ys = spread_sideways(mib), [r["latency_s"] for r in rows]
    lows = [r.get("latency_min_s", y) for r, y in zip(rows, ys)]
    highs = [r.get("latency_max_s", y) for r, y in zip(rows, ys)]
    fig = plt.figure(figsize=(WIDTH_IN, 5.6), dpi=DPI)
    ax = fig.add_subplot()
    for i, r in enumerate(rows):
        ax.errorbar([xs[i]], [ys[i]], yerr=[[ys[i] - lows[i]], [highs[i] - ys[i]]], fmt=MARKERS[i % len(MARKERS)],
                    color=COLOURS[i % len(COLOURS)], markersize=MARKER_SIZE, capsize=4, alpha=0.9,
                    label=f"{r['label']}: {ys[i]:.2f} s ({lows[i]:.2f}-{highs[i]:.2f})")
    # The front of the true figures, drawn through the points as plotted: a row on it is a vertex of the line.
    front = pareto_front(list(zip(mib, ys)))
    if len(front) > 1:
        ax.plot([xs[i] for i in front], [ys[i] for i in front], "--", color="black", linewidth=1, zorder=0,
                label="nothing beats these (Pareto front)")
    pick = next((i for i, r in enumerate(rows) if r["key"] == recommended), None)
    if pick is not None:
        # Off the front only where a row was faster with no more memory: the pick follows the sizes (Why), said so.
        beaten = "" if pick in front else " (beaten here on both axes; the pick follows the sizes: Why)"
        ax.scatter([xs[pick]], [ys[pick]], s=RING_AREA, facecolors="none", edgecolors="black",
                   linewidths=RING_LINE, zorder=3, label=f"recommended: {rows[pick]['label']}{beaten}")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.set_xlabel("\n".join(textwrap.wrap(f"{memory_axis(rows, device, unified)}  \u2190 less is better", 80)))
    ax.set_ylabel("latency per request (s)\nmedian and range  \u2190 lower is better")
    # Lower-left is better on both axes: said in that corner (axes coordinates, wherever the data lies).
    ax.text(0.01, 0.01, "\u2199 better", transform=ax.transAxes, fontsize=10, color="green", fontweight="bold")
    ax.grid(True, alpha=0.3)
    above = [fig.text(0.01, 1, "\n".join(textwrap.wrap(headline, 85)), fontsize=12, fontweight="bold", va="top")]
    why = [line for note in reasons for line in textwrap.wrap(f"Why: {note}", 170)]
    notes = "\n".join(why + [line for note in cautions for line in textwrap.wrap(f"Caution: {note}", 190)])
    if notes:
        above.append(fig.text(0.01, 1, notes, fontsize=6.5, color="darkred" if cautions else "black", va="top"))
    below = None
    if footer:
        footer += "; rows at one memory figure are drawn side by side"
        below = fig.text(0.01, 0, "\n".join(textwrap.wrap(footer, 170)), fontsize=6.5, color="dimgrey",
                         va="bottom")
    pad = ring_radius_px(fig.dpi) + 3
    lows, highs = lows + ys, highs + ys  # the ring is around the median, whatever the range
    _arrange(fig, above, below)
    _limits(ax, xs, lows, highs, pad)
    band = _arrange(fig, above, below)  # again, for the tick labels of those limits
    _limits(ax, xs, lows, highs, pad)  # for the axes' final size
    _fit_labels(fig, ax, band)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return None

"""The benchmark's plot: latency against device memory, one series per row, the recommendation as its headline."""

from __future__ import annotations

import textwrap

from ..places import MiB
from .report import device_memory, is_unified, memory_axis

# 15 rows and more: each gets its own colour and its own marker (tab20 colours, no two alike).
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd", "#e6550d", "#31a354")
MARKERS = "osD^v<>PXph*H8d"


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points nothing beats (no other is at least as low in both and lower in one), by x."""
    front = []
    for i, (x, y) in enumerate(points):
        beaten = any((ox <= x and oy <= y) and (ox < x or oy < y) for j, (ox, oy) in enumerate(points) if j != i)
        if not beaten:
            front.append(i)
    return sorted(front, key=lambda i: points[i])


def _spread_sideways(xs: list[float]) -> list[float]:
    """Rows at one memory figure, moved apart by 5 % of the axis each so that none hides another (nor the ring)."""
    step = 0.05 * ((max(xs) - min(xs)) or 1.0)
    out = list(xs)
    for x in set(xs):
        same = [i for i, other in enumerate(xs) if other == x]
        for rank, i in enumerate(same):
            out[i] = x + (rank - (len(same) - 1) / 2) * step
    return out


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
    xs, ys = _spread_sideways(mib), [r["latency_s"] for r in rows]
    fig, ax = plt.subplots(figsize=(10, 5.6))
    for i, r in enumerate(rows):
        low, high = r.get("latency_min_s", ys[i]), r.get("latency_max_s", ys[i])
        ax.errorbar([xs[i]], [ys[i]], yerr=[[ys[i] - low], [high - ys[i]]], fmt=MARKERS[i % len(MARKERS)],
                    color=COLOURS[i % len(COLOURS)], markersize=8, capsize=4, alpha=0.9,
                    label=f"{r['label']}: {ys[i]:.2f} s ({low:.2f}-{high:.2f})")
    front = pareto_front(list(zip(mib, ys)))
    if len(front) > 1:
        ax.plot([xs[i] for i in front], [ys[i] for i in front], "--", color="black", linewidth=1, zorder=0,
                label="nothing beats these (Pareto front)")
    pick = next((i for i, r in enumerate(rows) if r["key"] == recommended), None)
    if pick is not None:
        # Off the front only where a row was faster with no more memory: the pick follows the sizes (Why), said so.
        beaten = "" if pick in front else " (beaten here on both axes; the pick follows the sizes: Why)"
        ax.scatter([xs[pick]], [ys[pick]], s=300, facecolors="none", edgecolors="black", linewidths=2, zorder=3,
                   label=f"recommended: {rows[pick]['label']}{beaten}")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.set_xlabel(f"{memory_axis(rows, device, unified)}  \u2190 less is better")
    ax.set_ylabel("latency per request (s): median, range  \u2190 lower is better")
    # Lower-left is better on both axes: said in that corner (axes coordinates, wherever the data lies).
    ax.text(0.01, 0.01, "\u2199 better", transform=ax.transAxes, fontsize=10, color="green", fontweight="bold")
    fig.suptitle("\n".join(textwrap.wrap(headline, 90)), x=0.01, ha="left", fontsize=12, fontweight="bold")
    why = [line for note in reasons for line in textwrap.wrap(f"Why: {note}", 170)]
    caution = "\n".join(why + [line for note in cautions for line in textwrap.wrap(f"Caution: {note}", 190)])
    if caution:
        fig.text(0.01, 0.93, caution, fontsize=6.5, color="darkred" if cautions else "black", va="top")
    ax.grid(True, alpha=0.3)
    if footer:
        footer += "; rows at one memory figure are drawn side by side"
        fig.text(0.01, 0.01, "\n".join(textwrap.wrap(footer, 170)), fontsize=6.5, color="dimgrey", va="bottom")
    fig.tight_layout(rect=(0, 0.06 if footer else 0, 1, 0.93 - 0.022 * caution.count("\n") if caution else 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None

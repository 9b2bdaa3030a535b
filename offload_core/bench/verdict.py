"""The benchmark's one recommendation: the mode and dial settings for this machine, and why.

Pure policy over plain data: the measured rows (median and range of each), the free device memory, RAM and
disk, and the cache a real request of the benchmarked pipeline keeps (`workload`). The places are tried from
the fastest down: the device (nothing moves), RAM with what fits kept resident, RAM and files, files, no cache.
The measured rows then say what the pick costs here, and whether this run can tell it apart from the others.

The request is named in the headline. With the tiny built-in model it is not the one measured: the rows time each
mode's transfers on a cache that fits anywhere, the place comes from the real request's sizes (`projected`), and
the reasons say which row was the fastest here, so that a pick that was not is not read as one.
"""

from __future__ import annotations

from ..places import GiB, MiB
from .rows import BASELINE_KEY

SPREAD_LIMIT = 0.25  # a row whose slowest and fastest request differ by more than this share of its median
HOST_SHARE = 0.5  # RAM or a disk takes the cache when the cache is at most this share of what is free there
BUDGET_STEP = 256 << 20  # a recommended budget is rounded down to this
# choice -> the headline's reason
SHORT = {"gpu": "the cache fits on the device", "dial": "keep what fits on the device, stream the rest from RAM",
         "ram_async": "the cache does not fit on the device, RAM has room",
         "ram_and_files": "the cache fits neither on the device nor in RAM alone",
         "file_async": "the cache does not fit beside the model in memory", "off": "the cache fits nowhere here"}
# choice -> (the mode it runs, the measured rows that show its cost here, first found is used)
CHOICES = {
    "gpu": ("gpu", ("gpu", "gpu_upstream")),
    "dial": ("ram_async", ("device_50", "device_25", "device_75", "ram_async")),
    "ram_async": ("ram_async", ("ram_async",)),
    "ram_and_files": ("ram_async", ("host_50",)),
    "file_async": ("file_async", ("file_async_cold", "file_async_warm")),
    "off": ("off", ("none",)),
}


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def add_spread(rows: list[dict]) -> None:
    """Each row's range: `latency_min_s`, `latency_max_s`, `spread` ((max - min) / median) and `noisy`."""
    for row in rows:
        times = row["latencies_s"]
        row["latency_min_s"], row["latency_max_s"] = min(times), max(times)
        row["spread"] = (max(times) - min(times)) / row["latency_s"] if row["latency_s"] > 0 else 0.0
        row["noisy"] = row["spread"] > SPREAD_LIMIT


def clearly_slower(a: dict, b: dict) -> bool:
    """Every request of `a` took longer than every request of `b`: a difference this run settles."""
    return a["latency_min_s"] > b["latency_max_s"]


def _place(cache: int, free: dict, workload: dict) -> tuple[str, dict, str]:
    """(choice, budgets, why) from the sizes alone: the fastest place the cache fits in."""
    room = max(0, free["device"] - workload["other_device_bytes"])
    host = int(HOST_SHARE * free["ram"])
    disk = int(HOST_SHARE * (free["disk"] or 0))
    need = f"the {_gib(cache)} K/V cache of {workload['what']}"
    where = "RAM (this device's own memory)" if free["unified"] else "the device's free memory"
    if cache <= room:
        return "gpu", {}, f"{need} fits in {where} ({_gib(room)} left beside the model), so nothing has to move"
    if not free["unified"] and cache <= host:
        resident = int(room) // BUDGET_STEP * BUDGET_STEP
        if resident:
            return "dial", {"device_budget": resident}, (
                f"{need} does not fit on the device ({_gib(room)} left beside the model): keep "
                f"{_gib(resident)} of it resident and stream the rest from RAM ({_gib(free['ram'])} available)")
        return "ram_async", {}, f"{need} does not fit on the device; RAM has {_gib(free['ram'])} available"
    if not free["unified"] and host and cache <= host + disk:
        return "ram_and_files", {"host_budget": host}, (
            f"{need} fits neither on the device nor in half the available RAM: {_gib(host)} in RAM, the rest in "
            f"files on {free['disk_dir']}")
    if cache <= disk:
        ram = "" if free["unified"] else " nor in RAM"
        return "file_async", {}, (f"{need} does not fit in {where} beside the model ({_gib(room)} left){ram}; "
                                  f"the disk at {free['disk_dir']} has {_gib(free['disk'])} free")
    return "off", {}, f"{need} fits nowhere here: recompute the prefix every step"


def _measured(choice: str, by_key: dict) -> dict | None:
    return next((by_key[k] for k in CHOICES[choice][1] if k in by_key), None)


def _cost(row: dict, by_key: dict, projected: bool) -> str:
    """What the pick's row measured here, against the table's baseline (the row its `ratio_to_gpu` divides by)."""
    base = by_key.get(BASELINE_KEY) or by_key.get("gpu")
    where = "here on the tiny built-in model" if projected else "here"
    text = (f"measured {where}: '{row['label']}' {row['latency_s']:.2f} s "
            f"({row['latency_min_s']:.2f}-{row['latency_max_s']:.2f} s over {len(row['latencies_s'])} requests)")
    if base is None or base is row:
        return text
    settled = "slower, beyond the noise" if clearly_slower(row, base) else (
        "faster, beyond the noise" if clearly_slower(base, row) else "within the noise of it")
    return f"{text}, {row['latency_s'] / base['latency_s']:.2f}x the '{base['label']}' row ({settled})"


def _fastest(row: dict, rows: list[dict], workload: dict) -> str:
    """Which measured row was the fastest, against the pick's; for a projection, why the pick need not be it."""
    timed = [r for r in rows if r["key"] != "rerun"]  # the re-run row times a second request, served by reuse
    fastest = min(timed, key=lambda r: r["latency_s"])
    if fastest is row:
        return f"'{row['label']}' was also the fastest row here"
    gap = "beyond the noise" if clearly_slower(row, fastest) else "within the noise"
    text = (f"the fastest row here was '{fastest['label']}', {fastest['latency_s']:.2f} s against the pick's "
            f"{row['latency_s']:.2f} ({gap})")
    if not workload.get("projected"):
        return text
    tiny = workload.get("measured_cache_bytes")
    tiny = f"{tiny / MiB:.1f} MiB " if tiny else ""
    return (f"{text}: the rows ran a tiny stand-in whose {tiny}cache fits anywhere here, so they time each mode's "
            f"transfers; the pick follows where the real request's {_gib(workload['cache_bytes'])} cache fits")


def _fallback(pick: dict, rows: list[dict], unified: bool) -> str | None:
    """For a `gpu` pick: the streamed row that keeps the least on the device without being measurably slower."""
    if pick is None:
        return None
    saves = [r for r in rows if r["mode"] not in (None, "gpu", "auto") and not r["config"].get("storage")
             and r["key"] != "rerun" and (not unified or r["mode"].startswith("file"))
             and not clearly_slower(r, pick) and r["peak_kv_device"] < pick["peak_kv_device"]]
    if not saves:
        return None
    best = min(saves, key=lambda r: (r["peak_kv_device"], r["latency_s"]))
    return (f"if that memory gets tight: '{best['label']}' was not measurably slower here "
            f"({best['latency_s'] / pick['latency_s']:.2f}x) and kept {best['peak_kv_device'] / MiB:.1f} MiB of "
            f"K/V on the device instead of {pick['peak_kv_device'] / MiB:.1f}")


def recommend(rows: list[dict], free: dict, workload: dict) -> dict:
    """The one recommendation: {mode, settings, choice, headline, why[], evidence}. Rows need `add_spread`."""
    by_key = {r["key"]: r for r in rows}
    choice, settings, why = _place(workload["cache_bytes"], free, workload)
    reasons = [why]
    row, nocache = _measured(choice, by_key), by_key.get("none")
    if choice not in ("gpu", "off") and row is not None and nocache is not None and clearly_slower(row, nocache):
        reasons.append(f"but '{row['label']}' was slower here than recomputing the prefix ({row['latency_s']:.2f} "
                       f"vs {nocache['latency_s']:.2f} s, every request): no cache is the faster choice")
        choice, settings, row = "off", {}, nocache
    projected = bool(workload.get("projected"))
    if row is not None:
        reasons.append(_cost(row, by_key, projected))
        reasons.append(_fastest(row, rows, workload))
    if choice == "gpu":
        reasons.append(_fallback(row, rows, free["unified"]))
    if choice == "off" and not workload.get("can_skip_cache", True):
        reasons.append("this pipeline always caches (it has no uncached mode): free memory or disk space first")
    mode = CHOICES[choice][0]
    dials = ", ".join(f"{name}={_gib(value)}" for name, value in settings.items())
    call = ", ".join([f'mode="{mode}"', *(f"{name}={value}" for name, value in settings.items())])
    request = workload.get("request", workload["what"])
    headline = (f"For {request} on this machine{' (projected from its sizes)' if projected else ''}, use mode "
                f"{mode}{' with ' + dials if dials else ''}: {SHORT[choice]}")
    return {"mode": mode, "settings": settings, "choice": choice, "headline": headline, "projected": projected,
            "why": [r for r in reasons if r], "evidence": None if row is None else row["key"],
            "call": f"enable_kv_offload(pipe, {call})", "workload": workload, "free": free}


def reliability(rows: list[dict], load: dict, threads: int) -> list[str]:
    """Notes on what this run cannot settle: rows whose requests spread widely, a machine busy with others."""
    notes = []
    noisy = [f"'{r['label']}'" for r in rows if r.get("noisy")]
    if noisy:
        noisy = ["every row"] if len(noisy) == len(rows) > 1 else noisy
        notes.append(f"the requests of {', '.join(noisy)} spread by more than {SPREAD_LIMIT:.0%} of their median "
                     "(range column): a ratio to them is not settled by this run; more --runs narrow it.")
    before, after = load["before"], load["after"]
    if before["load_avg"] and after["load_avg"]:
        cpus, peak = before["cpu_count"] or 1, max(before["load_avg"][0], after["load_avg"][0])
        if peak > cpus:
            notes.append(f"the machine was busy: 1-minute load average {before['load_avg'][0]:.1f} before and "
                         f"{after['load_avg'][0]:.1f} after, on {cpus} CPUs (this run uses {threads} thread(s)); "
                         "other processes shared the cores, so times are inflated and only differences beyond "
                         "the ranges count.")
    return notes

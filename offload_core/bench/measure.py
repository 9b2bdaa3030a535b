"""Measure one row: warm-up, then N timed full-pipeline requests with their memory peaks."""

from __future__ import annotations

import gc
import hashlib
import math
import statistics
import time
from typing import Callable

import numpy as np
import torch

from ..diffusers import disable_kv_offload, enable_kv_offload
from ..places import DEVICE, PLACES
from .probes import RssPeak, UpstreamKVProbe
from .rows import Row

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def one_request(pipe, call: Callable[[], object], device: torch.device, rss: RssPeak, session) -> dict:
    """Run one request; return its latency, peaks and (offloaded rows) the stores' stats."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    probe = None if session is not None else UpstreamKVProbe(pipe.transformer)
    rss.start()
    _sync(device)
    start = time.perf_counter()
    try:
        output = call()
        _sync(device)
        latency = time.perf_counter() - start
    finally:
        if probe is not None:
            probe.close()
    sample = {"latency_s": latency, "peak_rss": rss.read(), "image": _image(output),
              "output_sha256": output_digest(output),
              "peak_device_allocated": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}
    if session is not None:
        stats = session.last_stats
        sample["plan"] = {t: sum(s.get("plan", {}).get(t, 0) for s in stats) for t in PLACES}
        sample["kv_error"] = _kv_error(stats)
        sample["cache_bytes"] = max((_aligned_cache_bytes(s) for s in stats), default=0)
        sample["kv_bytes"] = {t: sum(s["bytes"][t] for s in stats) for t in PLACES}
        sample["peak_kv_device"] = sum(s["peak_device_bytes"] for s in stats)
        sample["exposed_wait_s"] = sum(s["exposed_wait_s"] for s in stats)
        sample["modes"] = sorted({s["mode"] for s in stats})
        sample["page_cache"] = sorted({s["page_cache"] for s in stats if s.get("page_cache")})
        sample["reasons"] = sorted({s["reason"] for s in stats if s.get("reason")})
        sample["pinned_fallback"] = any(s.get("pinned_fallback") for s in stats)
    else:
        kv = probe.total_bytes()
        sample["kv_bytes"] = {t: (kv if t == DEVICE else 0) for t in PLACES}
        sample["peak_kv_device"] = kv
        sample["exposed_wait_s"] = 0.0
        sample["modes"] = ["gpu"] if kv else []
    return sample


def _image(output):
    images = getattr(output, "images", output)
    return np.asarray(images, dtype=np.float64) if isinstance(images, np.ndarray) else None


def _kv_error(stats: list) -> dict | None:
    errors = [s["kv_error"] for s in stats if s.get("kv_error")]
    if not errors:
        return None
    return {"max_abs": max(e["max_abs"] for e in errors), "relative": max(e["relative"] for e in errors),
            "exact_layers": sum(e.get("exact_layers", 0) for e in errors)}


def _aligned_cache_bytes(stats: dict) -> int:
    """One store's cache as its places keep it: K and V of each layer each padded to a 4 KiB boundary."""
    layers = stats["layers"] or 1
    per_tensor = stats["stored_bytes"].get("device", 0) // (2 * layers)
    return layers * 2 * (-(-per_tensor // 4096) * 4096)


def psnr(image, reference) -> float | None:
    """Peak signal-to-noise ratio (dB) of an image in [0, 1] against the exact one; inf when identical."""
    if image is None or reference is None or image.shape != reference.shape:
        return None
    mse = float(np.mean((image - reference) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def prepare_rows(pipe, rows: list[Row], call_kwargs: Callable[[], dict], device: torch.device) -> tuple[list[Row], object]:
    """Rows with budgets in bytes, and the exact image lossy rows are compared with.

    One `gpu` request measures the cache (per store) and gives that image; only run when a row needs either.
    """
    if not any(row.fractions or row.lossy for row in rows):
        return rows, None
    reference = request_for_row(pipe, Row("reference", "reference", "gpu"), call_kwargs, device, RssPeak())
    return [row.with_budgets(reference["cache_bytes"]) for row in rows], reference["image"]


def output_digest(output) -> str | None:
    """SHA-256 of the images a request returned: equal digests are bit-identical outputs (exactness check)."""
    images = getattr(output, "images", output)
    if isinstance(images, torch.Tensor):
        images = images.detach().float().cpu().numpy()
    try:
        data = np.ascontiguousarray(np.asarray(images)).tobytes()
    except (TypeError, ValueError):
        return None
    return hashlib.sha256(data).hexdigest()


def request_for_row(pipe, row: Row, call_kwargs: Callable[[], dict], device: torch.device, rss: RssPeak) -> dict:
    """Enable the row's mode, run one request, disable again: one sample of `row`.

    A re-run row runs an untimed first request with reuse on, then times a second one with a new seed (and
    for FLUX.2 a new prompt), whose prefix comes from the first.
    """
    reuse = row.rerun_of is not None
    session = enable_kv_offload(pipe, row.mode, reuse=reuse, **row.config) if row.mode else None
    try:
        if reuse:
            pipe(**call_kwargs(), **row.call_kwargs)
            sample = one_request(pipe, lambda: pipe(**rerun_kwargs(pipe, call_kwargs()), **row.call_kwargs),
                                 device, rss, session)
            sample["reuse_hits"] = sum(s.get("reuse") == "hit" for s in session.last_stats)
            sample["reuse_key_s"] = max((s.get("reuse_key_s", 0.0) for s in session.last_stats), default=0.0)
            return sample
        return one_request(pipe, lambda: pipe(**call_kwargs(), **row.call_kwargs), device, rss, session)
    finally:
        if session is not None:
            disable_kv_offload(pipe)


def rerun_kwargs(pipe, kwargs: dict) -> dict:
    """The second request of a re-run: a new seed; for FLUX.2 (whose reference K/V ignore it) a new prompt."""
    kwargs = {**kwargs, "generator": torch.Generator().manual_seed(1)}
    if "Flux2" in type(pipe).__name__:
        kwargs["prompt"] = f"{kwargs.get('prompt', '')}, at dusk"
    return kwargs


def measure_rows(pipe, rows: list[Row], call_kwargs: Callable[[], dict], *, runs: int, device: torch.device,
                 on_start: Callable[[Row], None] = lambda row: None,
                 on_done: Callable[[Row], None] = lambda row: None) -> list[dict]:
    """One warm-up round, then `runs` timed rounds; each round runs every row once, in table order.

    Round-robin rather than row after row: a load that comes and goes (another job on a shared machine, a
    thermal limit) then slows every row alike instead of whichever rows happened to run during it.
    """
    rss = RssPeak()
    rows, reference = prepare_rows(pipe, rows, call_kwargs, device)
    samples: dict[str, list[dict]] = {row.key: [] for row in rows}
    # The model's own objects never become garbage: park them outside the collector so the per-request
    # gc.collect() only walks what the requests allocate (a full walk per request would show in the latencies).
    gc.collect()
    gc.freeze()
    try:
        for round_index in range(runs + 1):
            for row in rows:
                on_start(row)
                sample = request_for_row(pipe, row, call_kwargs, device, rss)
                if round_index > 0:  # round 0 is the warm-up
                    if samples[row.key]:
                        samples[row.key][-1].pop("image", None)  # only the last request's image is compared
                    samples[row.key].append(sample)
                on_done(row)
    finally:
        gc.unfreeze()
    results = [summarize(row, samples[row.key], rss_exact=rss.exact, reference=reference) for row in rows]
    _add_rerun_speedups(rows, results)
    return results


def _add_rerun_speedups(rows: list[Row], results: list[dict]) -> None:
    """A re-run row's speed-up over its base row (the same request without reuse), in its label and JSON."""
    by_key = {r["key"]: r for r in results}
    for row in rows:
        mine, base = by_key[row.key], by_key.get(row.rerun_of or "")
        if row.rerun_of is None:
            continue
        mine["speedup_vs"] = row.rerun_of if base else None
        mine["speedup"] = base["latency_s"] / mine["latency_s"] if base and mine["latency_s"] > 0 else None
        if mine["speedup"] is not None:
            key = f", key {mine['reuse_key_s'] * 1e3:.1f} ms" if mine.get("reuse_key_s") is not None else ""
            mine["label"] = f"{mine['label']} ({mine['speedup']:.2f}x vs {base['label']}{key})"


def summarize(row: Row, samples: list[dict], *, rss_exact: bool, reference=None) -> dict:
    """One table row: medians of latency and exposed wait, maxima of the memory peaks, the last request's bytes."""
    last = samples[-1]
    device_peaks = [s["peak_device_allocated"] for s in samples if s["peak_device_allocated"] is not None]
    return {
        "key": row.key, "mode": row.mode, "config": dict(row.config),
        "label": f"{row.label} -> {'+'.join(last['modes'])}" if row.mode == "auto" else row.label,
        "latency_s": statistics.median(s["latency_s"] for s in samples),
        "latencies_s": [s["latency_s"] for s in samples],
        "peak_device_allocated": max(device_peaks) if device_peaks else None,
        "peak_kv_device": max(s["peak_kv_device"] for s in samples),
        "peak_rss": max(s["peak_rss"] for s in samples), "peak_rss_exact": rss_exact,
        "kv_bytes": last["kv_bytes"],
        "exposed_wait_s": statistics.median(s["exposed_wait_s"] for s in samples),
        "modes": last["modes"], "page_cache": last.get("page_cache", []), "reasons": last.get("reasons", []),
        "pinned_fallback": last.get("pinned_fallback", False),
        "plan": last.get("plan"), "kv_error": last.get("kv_error"),
        "psnr_db": psnr(last["image"], reference) if row.lossy else None,
        "output_sha256": sorted({s.get("output_sha256") or "" for s in samples}),  # >1: not reproducible
        "reuse_hits": last.get("reuse_hits"),
        "reuse_key_s": statistics.median(s["reuse_key_s"] for s in samples) if "reuse_key_s" in last else None,
    }

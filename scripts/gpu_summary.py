"""The one summary table of `scripts/gpu_check.sh`, read from its results folder; exit 1 on any failure.

Each step of the check leaves `<step>.rc` (its exit status) and `<step>.log` in the folder; pytest steps also
`<step>.xml` (JUnit), benchmark steps `<step>.json`. A benchmark row is exact when every request of it
returned the same images, bit for bit, as the `gpu` row (`output_sha256`); the `none` row (no cache,
recomputed prefix) is shown but not required to match. A missing optional step (the streaming benchmark
in a version without it) is a note, not a failure.

Usage: python scripts/gpu_summary.py RESULTS_DIR
"""

from __future__ import annotations

import json
import os
import sys
import xml.etree.ElementTree as ET

PASS, FAIL, NOTE = "pass", "FAIL", "note"
ABSENT_MARKERS = ("unknown command", "invalid choice")


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _rc(folder: str, step: str):
    text = _read(os.path.join(folder, f"{step}.rc")).strip()
    return int(text) if text.lstrip("-").isdigit() else None


def _last_line(folder: str, step: str) -> str:
    lines = [line.strip() for line in _read(os.path.join(folder, f"{step}.log")).splitlines() if line.strip()]
    return lines[-1][:160] if lines else "no output"


def _not_run(folder: str, step: str, title: str) -> list:
    """A step that did not run: a failure when the check's time budget ran out before it, else a note."""
    if os.path.exists(os.path.join(folder, f"{step}.budget")):
        return [(title, FAIL, "not run: the check's time budget ran out before it")]
    return [(title, NOTE, "not run")]


def env_row(folder: str, step: str, title: str) -> list:
    rc = _rc(folder, step)
    if rc is None:
        return _not_run(folder, step, title)
    lines = [line.strip() for line in _read(os.path.join(folder, f"{step}.log")).splitlines()]
    facts = [line for line in lines if line.startswith(("torch:", "from the wheel folder", "in the environment:"))]
    return [(title, PASS if rc == 0 else FAIL, "; ".join(facts) if rc == 0 else f"exit {rc}: {_last_line(folder, step)}")]


def pytest_row(folder: str, step: str, title: str) -> list:
    rc = _rc(folder, step)
    if rc is None:
        return _not_run(folder, step, title)
    try:
        suites = ET.parse(os.path.join(folder, f"{step}.xml")).getroot()
    except (OSError, ET.ParseError):
        return [(title, FAIL, f"exit {rc}, no JUnit report: {_last_line(folder, step)}")]
    suites = [suites] if suites.tag == "testsuite" else list(suites.iter("testsuite"))
    count = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    seconds = sum(float(s.get("time", 0)) for s in suites)
    passed = count["tests"] - count["failures"] - count["errors"] - count["skipped"]
    detail = (f"{passed} passed, {count['failures']} failed, {count['errors']} errors, {count['skipped']} skipped, "
              f"{seconds:.0f} s")
    ok = rc == 0 and count["failures"] == 0 and count["errors"] == 0 and passed > 0
    return [(title, PASS if ok else FAIL, detail if ok else f"exit {rc}: {detail}")]  # none passed: a failure too


def demo_row(folder: str, step: str, title: str) -> list:
    rc = _rc(folder, step)
    if rc is None:
        return _not_run(folder, step, title)
    rows = [line.split() for line in _read(os.path.join(folder, f"{step}.log")).splitlines()]
    table = [r for r in rows if len(r) >= 3 and r[2] in ("yes", "NO")]
    inexact = [r[0] for r in table if r[2] == "NO"]
    if rc != 0 or not table:
        return [(title, FAIL, f"exit {rc}: {_last_line(folder, step)}")]
    if inexact:
        return [(title, FAIL, f"not bit-exact: {', '.join(inexact)}")]
    return [(title, PASS, f"{len(table)} tiers, every one bit-exact")]


def _bench_json(folder: str, step: str, title: str):
    """(exit status, the benchmark step's JSON), or (None, the rows that say why there is none)."""
    rc = _rc(folder, step)
    if rc is None:
        return None, _not_run(folder, step, title)
    try:
        with open(os.path.join(folder, f"{step}.json")) as f:
            return rc, json.load(f)
    except (OSError, ValueError):
        status = NOTE if rc == 2 and "needs about" in _last_line(folder, step) else FAIL
        return None, [(title, status, f"exit {rc}: {_last_line(folder, step)}")]


def bench_rows(folder: str, step: str, title: str) -> list:
    rc, data = _bench_json(folder, step, title)
    if rc is None:
        return data
    rows = data.get("rows", [])
    reference = next((r.get("output_sha256") for r in rows if r.get("key") == "gpu"), None)
    out = [] if rc == 0 else [(title, FAIL, f"exit {rc}: {_last_line(folder, step)}")]
    for row in rows:
        digests = row.get("output_sha256") or []
        if not reference or not digests or not all(digests):
            status, exact = FAIL, "no output digest"
        elif len(digests) > 1:
            status, exact = FAIL, f"{len(digests)} different outputs across its runs"
        elif digests == reference:
            status, exact = PASS, "bit-exact vs gpu"
        elif row.get("key") == "none":
            status, exact = NOTE, "differs from gpu (recomputed prefix: not required)"
        else:
            status, exact = FAIL, "NOT bit-exact vs gpu"
        ratio = row.get("ratio_to_gpu")
        peak = row.get("peak_device_allocated")
        detail = (f"{row.get('latency_s', float('nan')):.2f} s" + (f" ({ratio:.2f}x gpu)" if ratio else "")
                  + (f", peak device {peak / 2**30:.1f} GiB" if peak else "")
                  + f", exposed wait {row.get('exposed_wait_s', 0.0):.2f} s, {exact}")
        out.append((f"{title}: {row.get('label', row.get('key'))}", status, detail))
    return out or [(title, FAIL, "no rows")]


def reuse_rows(folder: str, step: str, title: str) -> list:
    """The prefix reuse key at real size: what reading the model cost, beside what the hit saved (issue 31)."""
    rc, data = _bench_json(folder, step, title)
    if rc is None:
        return data
    rows = {r.get("key"): r for r in data.get("rows", [])}
    hit, base = rows.get("rerun"), rows.get("ram_async")
    if rc != 0 or hit is None or base is None or hit.get("reuse_key_s") is None:
        return [(title, FAIL, f"exit {rc}: no re-run row with its key time ({_last_line(folder, step)})")]
    key, saved = hit["reuse_key_s"], base["latency_s"] - hit["latency_s"]
    status = PASS if hit.get("reuse_hits") and saved > key else FAIL
    return [(title, status, f"key {key * 1e3:.1f} ms per request; a hit {hit['latency_s']:.2f} s against "
                            f"{base['latency_s']:.2f} s without reuse (saves {saved:.2f} s), hits {hit.get('reuse_hits')}")]


def _family_rows(folder: str, step: str, title: str, field: str, flag: str, short_of_memory):
    """(rc, rows of `field` in the step's JSON) or (rc, [a summary row]) when there are none: a NOTE where the
    engine has no `flag` or the step refused for lack of memory (`short_of_memory(log)`), else a FAIL."""
    rc = _rc(folder, step)
    if rc is None:
        return rc, None, _not_run(folder, step, title)
    try:
        with open(os.path.join(folder, f"{step}.json")) as f:
            return rc, json.load(f)[field], None
    except (OSError, ValueError, KeyError, TypeError):
        log = _read(os.path.join(folder, f"{step}.log"))
        absent = rc == 2 and f"unrecognized arguments: {flag}" in log
        status = NOTE if absent or (rc == 2 and short_of_memory(log)) else FAIL
        why = "not in this version of the engine" if absent else f"exit {rc}: {_last_line(folder, step)}"
        return rc, None, [(title, status, why)]


def batch_rows(folder: str, step: str, title: str) -> list:
    """`bench --batch`: a batch-4 row passes when its images match the batch-4 row without dedup bit for bit."""
    rc, rows, summary_rows = _family_rows(folder, step, title, "batch_rows", "--batch", lambda log: "needs about" in log)
    if rows is None:
        return summary_rows
    out = [] if rc in (0, 1) else [(title, FAIL, f"exit {rc}: {_last_line(folder, step)}")]
    for r in rows:
        exact = r.get("exact")
        status = FAIL if exact is False else PASS
        detail = (f"{r['latency_s']:.2f} s, kept {r['kept_bytes'] / 2**20:.0f} MiB, moved "
                  f"{r['moved_bytes_per_step'] / 2**20:.0f} MiB/step, rows {r['rows_kept']}/{r['rows_put']}"
                  + ("" if exact is None else ", bit-exact vs dedup off" if exact else ", NOT bit-exact vs dedup off"))
        out.append((f"{title}: {r['mode']} batch {r['batch']}", status, detail))
    return out or [(title, FAIL, "no rows")]


def pose_rows(folder: str, step: str, title: str) -> list:
    """`bench --pose`: a row passes when every block it served was the bytes put, bit for bit."""
    rc, rows, summary_rows = _family_rows(folder, step, title, "pose_rows", "--pose",
                                          lambda log: "pose cache (" in log and " needs " in log)
    if rows is None:
        return summary_rows
    out = [] if rc in (0, 1) else [(title, FAIL, f"exit {rc}: {_last_line(folder, step)}")]
    for r in rows:
        b, ratio = r["bytes"], r.get("ratio")
        detail = (f"{r['latency_s']:.2f} s a pass" + (f" ({ratio:.2f}x ram_async)" if ratio else "")
                  + f", exposed wait {r['exposed_wait_s'] * 1e3:.0f} ms, RAM "
                  f"{(b['host_pinned'] + b['host_pageable']) / 2**30:.2f} GiB, files {b['file'] / 2**30:.2f} GiB, "
                  + ("bit-exact" if r["exact"] else "NOT bit-exact"))
        out.append((f"{title}: {r['row']}", PASS if r["exact"] else FAIL, detail))
    return out or [(title, FAIL, "no rows")]


def arvideo_rows(folder: str, step: str, title: str) -> list:
    """`python -m offload_core arvideo`: a row passes when the whole video's cache read back was what was written."""
    rc = _rc(folder, step)
    if rc is None:
        return _not_run(folder, step, title)
    try:
        with open(os.path.join(folder, f"{step}.json")) as f:
            rows = json.load(f)
    except (OSError, ValueError):
        log = _read(os.path.join(folder, f"{step}.log"))
        if rc != 0 and any(marker in log for marker in ABSENT_MARKERS):
            return [(title, NOTE, "not in this version of the engine: skipped")]
        return [(title, FAIL, f"exit {rc}: {_last_line(folder, step)}")]
    base = next((r["step_s"] for r in rows if r["mode"] == "gpu"), None)
    out = [] if rc in (0, 1) else [(title, FAIL, f"exit {rc}: {_last_line(folder, step)}")]
    for r in rows:
        vs = f" ({r['step_s'] / base:.2f}x gpu)" if base else ""
        detail = (f"peak on device {r['peak_device_bytes'] / 2**30:.2f} GiB ({100 * r['peak_device_share']:.1f} %), "
                  f"moved {r['moved_per_forward_bytes'] / 2**20:.0f} MiB/forward, files {r['file_bytes'] / 2**30:.2f} "
                  f"GiB, step {1000 * r['step_s']:.0f} ms{vs}, wait {r['exposed_wait_s']:.2f} s, "
                  + ("exact" if r["exact"] else "NOT exact"))
        out.append((f"{title}: {r['mode']}", PASS if r["exact"] else FAIL, detail))
    return out or [(title, FAIL, "no rows")]


def multigpu_row(folder: str, step: str, title: str) -> list:
    """The multi-GPU case runs on a host with two GPUs or more; elsewhere the script says it skipped it."""
    skipped = _read(os.path.join(folder, f"{step}.skipped")).strip()
    if skipped:
        return [(title, NOTE, skipped.removeprefix(f"== {step}: "))]
    return pytest_row(folder, step, title)


def optional_row(folder: str, step: str, title: str) -> list:
    rc = _rc(folder, step)
    if rc is None:
        return _not_run(folder, step, title)
    log = _read(os.path.join(folder, f"{step}.log"))
    if rc != 0 and any(marker in log for marker in ABSENT_MARKERS):
        return [(title, NOTE, "not in this version of the engine: skipped")]
    return [(title, PASS if rc == 0 else FAIL, f"exit {rc}: {_last_line(folder, step)}")]


STEPS = [
    (env_row, "env", "environment (no network)"),
    (pytest_row, "sanitizer", "gpu tests, TORCH_CUDA_SANITIZER=1"),
    (demo_row, "demo", "demo round trip, every tier"),
    (bench_rows, "bench-qwen21", "bench full Qwen-Image 2.1"),
    (bench_rows, "bench-flux2", "bench full FLUX.2 klein 9B"),
    (reuse_rows, "reuse-key", "reuse key at 9B size, FLUX.2 klein"),
    (batch_rows, "batch-qwen21", "batch 4 vs 1, Qwen-Image 2.1"),
    (batch_rows, "batch-flux2", "batch 4 vs 1, FLUX.2 klein 9B"),
    (pose_rows, "pose", "pose cache, Wan 14B width"),
    (arvideo_rows, "arvideo", "AR video cache, Wan 1.3B shapes"),
    (optional_row, "stream", "streaming benchmark"),
    (pytest_row, "tests", "gpu tests"),
    (multigpu_row, "multigpu", "multi-GPU sampling, 2 GPUs"),
]


def summary(folder: str) -> tuple[str, bool]:
    rows = [row for fn, step, title in STEPS for row in fn(folder, step, title)]
    width = max(len(r[0]) for r in rows)
    lines = [f"{'check':<{width}}  {'result':<6}  details", f"{'-' * width}  ------  {'-' * 40}"]
    lines += [f"{name:<{width}}  {status:<6}  {detail}" for name, status, detail in rows]
    return "\n".join(lines), not any(status == FAIL for _, status, _ in rows)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not os.path.isdir(argv[0]):
        print("usage: python scripts/gpu_summary.py RESULTS_DIR", file=sys.stderr)
        return 2
    text, ok = summary(argv[0])
    print(text)
    print("all checks passed" if ok else "SOME CHECKS FAILED (see the FAIL rows and their logs)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

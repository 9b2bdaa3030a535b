// Unit tests of the pure formatting module of the memory readout: `node --test tests/web/`.
import { test } from "node:test";
import assert from "node:assert/strict";

import {
  UNKNOWN, barWidth, buildCompact, buildReadout, formatBytes, formatDuration, formatOf, formatPercent,
  formatPlaces, formatRate, readoutText, statusLine, storeRows,
} from "../../web/kv_offload_format.js";

const GiB = 2 ** 30;
const MiB = 2 ** 20;

test("bytes use binary units with three significant digits", () => {
  assert.equal(formatBytes(0), "0 B");
  assert.equal(formatBytes(1023), "1023 B");
  assert.equal(formatBytes(1536), "1.50 KiB");
  assert.equal(formatBytes(12.25 * MiB), "12.3 MiB");
  assert.equal(formatBytes(150 * GiB), "150 GiB");
  assert.equal(formatBytes(2 * 1024 ** 4), "2.00 TiB");
  assert.equal(formatBytes(1024 * MiB - 1), "1.00 GiB", "rounding up to 1024 carries into the next unit");
});

test("unknown values are shown as a dash, never as zero", () => {
  for (const bad of [null, undefined, NaN, Infinity, "12", {}]) {
    assert.equal(formatBytes(bad), UNKNOWN);
    assert.equal(formatDuration(bad), UNKNOWN);
    assert.equal(formatRate(bad), UNKNOWN);
    assert.equal(barWidth(bad, 10), null);
    assert.equal(formatPercent(1, bad), UNKNOWN);
  }
  assert.equal(formatOf(null, 8 * GiB), UNKNOWN);
  assert.equal(formatPlaces(null), UNKNOWN);
  assert.equal(formatPlaces({ device: null, host_pinned: null }), UNKNOWN);
});

test("percentages and bar widths", () => {
  assert.equal(formatPercent(1, 4), "25%");
  assert.equal(formatPercent(5, 4), "125%", "an overshoot is reported, not hidden");
  assert.equal(formatPercent(1, 0), UNKNOWN, "a zero total has no percentage");
  assert.equal(barWidth(1, 3), 33.3);
  assert.equal(barWidth(5, 4), 100, "bars are clamped to their track");
  assert.equal(barWidth(-1, 4), 0);
  assert.equal(formatOf(3 * GiB, 12 * GiB), "3.00 GiB of 12.0 GiB (25%)");
  assert.equal(formatOf(3 * GiB, null), "3.00 GiB");
});

test("durations and rates", () => {
  assert.equal(formatDuration(0), "0 ms");
  assert.equal(formatDuration(0.00085), "850 \u00b5s");
  assert.equal(formatDuration(0.0042), "4.20 ms");
  assert.equal(formatDuration(0.0123), "12.3 ms");
  assert.equal(formatDuration(0.2915), "292 ms");
  assert.equal(formatDuration(1.2), "1.20 s");
  assert.equal(formatDuration(125), "2 min 5 s");
  assert.equal(formatRate(25 * GiB), "25.0 GiB/s");
});

function cudaPayload(overrides = {}) {
  return {
    v: 1, event: "step", time: 0,
    run: { id: "r1", active: true, forwards: 7, elapsed_s: 1.5 },
    memory: {
      v: 1,
      process: { pid: 1, rss: 6 * GiB, device_allocated: 10 * GiB, device_reserved: 12 * GiB },
      device: { type: "cuda", name: "GPU", total: 24 * GiB, free: 8 * GiB, integrated: false },
      system: { ram_total: 64 * GiB, ram_available: 48 * GiB, swap_used: 0, swap_total: 0, cgroup_limit: null, cgroup_usage: null },
    },
    stores: [{
      name: "cond", requested: "ram_async", tier: "ram_async", reason: "requested", layers: 32,
      bytes: { device: 0, host_pinned: 2 * GiB, host_pageable: 0, file: 0 },
      device_bytes: 128 * MiB, peak_device_bytes: 192 * MiB, resident_layers: 2,
      transfers: { count: 64, bytes: 4 * GiB, seconds: 0.2 }, exposed_wait_s: 0.012,
      bandwidth_bytes_per_s: 20 * GiB, exposed_wait_per_pass_s: 0.006, closed: false, pinned_fallback: false,
    }],
    ...overrides,
  };
}

function rowsOf(sections) {
  return Object.fromEntries(sections.flatMap((s) => s.rows.map((r) => [`${s.title}/${r.label}`, r])));
}

test("the CUDA readout separates this process from the whole device", () => {
  const rows = rowsOf(buildReadout(cudaPayload()));
  assert.equal(rows["device/VRAM allocated"].scope, "process");
  assert.equal(rows["device/VRAM allocated"].value, "10.0 GiB of 24.0 GiB (42%)");
  assert.equal(rows["device/VRAM reserved"].value, "12.0 GiB of 24.0 GiB (50%)");
  assert.equal(rows["device/VRAM in use, all processes"].scope, "device");
  assert.equal(rows["device/VRAM in use, all processes"].value, "16.0 GiB of 24.0 GiB (67%)");
  assert.equal(rows["device/VRAM in use, all processes"].bar, 66.7);
  assert.equal(rows["host/RSS"].scope, "process");
  assert.equal(rows["host/RAM available"].scope, "system");
  assert.equal(rows["host/RAM available"].bar, 25, "the RAM bar shows the used share");
  assert.equal(rows["host/swap used"].value, "no swap");
  assert.equal(rows["host/cgroup"], undefined, "no cgroup row without a limit");
});

test("a store row shows tier, holdings, device residency, bandwidth and exposed wait per step", () => {
  const rows = rowsOf(buildReadout(cudaPayload()));
  assert.equal(rows["KV cond/tier"].value, "ram_async");
  assert.equal(rows["KV cond/why"], undefined, "no reason line for a tier that is simply the one asked for");
  assert.equal(rows["KV cond/holds"].value, "pinned RAM 2.00 GiB");
  assert.equal(rows["KV cond/on device"].value, "128 MiB (peak 192 MiB) \u00b7 2/32 layers");
  assert.equal(rows["KV cond/transfers"].value, "64 loads, 4.00 GiB \u00b7 20.0 GiB/s");
  assert.equal(rows["KV cond/exposed wait"].value, "6.00 ms/step \u00b7 12.0 ms total");
});

test("a fallback tier says what was asked and why", () => {
  const [store] = cudaPayload().stores;
  const rows = storeRows({ ...store, tier: "gpu", reason: "ram_async -> gpu: RAM tiers disabled, unified memory (Apple MPS)" });
  assert.equal(rows[0].value, "gpu (asked ram_async)");
  assert.match(rows[1].value, /RAM tiers disabled, unified memory/);
  const undecided = storeRows({ ...store, requested: "auto", tier: null });
  assert.equal(undecided[0].value, "auto: not decided yet");
});

test("a closed store shows what it held, not an empty store", () => {
  const [store] = cudaPayload().stores;
  const closed = { ...store, closed: true, bytes: { device: 0, host_pinned: 0, host_pageable: 0, file: 0 },
    bytes_while_open: { device: 0, host_pinned: 0, host_pageable: 0, file: 3 * GiB } };
  const holds = storeRows(closed).find((r) => r.label === "holds");
  assert.equal(holds.value, "closed; held file 3.00 GiB");
});

test("Apple MPS shows current / driver / recommended max and swap", () => {
  const payload = cudaPayload({ memory: {
    v: 1, process: { rss: GiB, mps_current_allocated: 4 * GiB, mps_driver_allocated: 6 * GiB },
    device: { type: "mps", name: "Apple MPS", recommended_max: 16 * GiB, integrated: true },
    system: { ram_total: 32 * GiB, ram_available: 2 * GiB, swap_used: 3 * GiB, swap_total: 8 * GiB },
  } });
  const rows = rowsOf(buildReadout(payload));
  assert.equal(rows["device/MPS allocated"].value, "4.00 GiB of 16.0 GiB (25%)");
  assert.equal(rows["device/MPS driver"].value, "6.00 GiB of 16.0 GiB (38%)");
  assert.equal(rows["device/MPS recommended max"].scope, "device");
  assert.match(rows["device/memory"].value, /unified/);
  assert.equal(rows["host/swap used"].value, "3.00 GiB of 8.00 GiB (38%)");
  assert.equal(rows["device/VRAM allocated"], undefined);
});

test("status line follows the run", () => {
  assert.equal(statusLine(cudaPayload()), "running \u00b7 7 forwards \u00b7 1.50 s");
  assert.equal(statusLine(cudaPayload({ event: "final", run: { id: "r", active: false, forwards: 1, elapsed_s: null } })),
    "last run finished \u00b7 1 forward");
  assert.equal(statusLine({ v: 1, event: "idle", run: { active: false, forwards: null } }), "idle: no run since start-up");
  assert.equal(statusLine(null), "no data yet");
  assert.equal(statusLine({ v: 99 }), "unsupported payload version 99");
  assert.equal(buildReadout({ v: 99 }).length, 1, "an unknown version shows only the status");
});

test("readout text has one line per row, each naming its scope", () => {
  const sections = buildReadout(cudaPayload());
  const lines = readoutText(sections).split("\n");
  assert.equal(lines.length, sections.reduce((n, s) => n + s.rows.length, 0));
  assert.ok(lines.includes("VRAM free [whole device]: 8.00 GiB of 24.0 GiB"));
  assert.ok(lines.includes("RSS [this process]: 6.00 GiB of 64.0 GiB (9%)"));
});

test("compact readout: status, device, RAM and one line per store", () => {
  const lines = buildCompact(cudaPayload());
  assert.equal(lines.length, 4);
  assert.equal(lines[1], "VRAM 10.0 GiB alloc \u00b7 8.00 GiB free of 24.0 GiB");
  assert.equal(lines[2], "RAM RSS 6.00 GiB \u00b7 48.0 GiB free \u00b7 swap 0 B");
  assert.equal(lines[3], "cond: ram_async \u00b7 pinned RAM 2.00 GiB \u00b7 wait 6.00 ms/step");
});

test("compact readout: the server's prefix-reuse line comes last, nothing when absent", () => {
  const line = "reuse: 3 hits, 1 miss, 1 kept (14.2 MiB host)";
  const lines = buildCompact({ ...cudaPayload(), reuse: { on: true, line } });
  assert.equal(lines.length, 5);
  assert.equal(lines[4], line);
  assert.equal(buildCompact({ ...cudaPayload(), reuse: null }).length, 4);
});

// Unit tests of the pure formatting module of the memory readout: `node --test tests/web/`.
import { test } from "node:test";
import assert from "node:assert/strict";

import {
  UNKNOWN, barWidth, buildCompact, buildReadout, formatBytes, formatDuration, formatOf, formatPercent,
  batchRowsLine, formatPlaces, growingLine, formatRate, isRunOf, readoutText, rowLead, statusLine, storeRows,
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
      name: "cond", requested: "ram_async", mode: "ram_async", reason: "requested", layers: 32,
      bytes: { device: 128 * MiB, host_pinned: 2 * GiB, host_pageable: 0, file: 0 },
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
  assert.equal(rows["memory/VRAM"].scope, "device");
  assert.equal(rows["memory/VRAM"].value, "16.0 GiB used of 24.0 GiB (67%)");
  assert.equal(rows["memory/RAM"].scope, "system");
  assert.equal(rows["memory/RAM"].value, "16.0 GiB used of 64.0 GiB (25%)");
  assert.equal(rows["memory/swap"].value, "no swap");
  assert.equal(rows["memory/swap"].segments, undefined, "no swap: no bar to draw");
  assert.equal(rows["memory/cgroup"], undefined, "no cgroup row without a limit");
  const text = readoutText(buildReadout(cudaPayload())).split("\n");
  assert.ok(text.includes("[this process] KV on device 128 MiB \u00b7 allocated 10.0 GiB \u00b7 reserved 12.0 GiB"), text);
  assert.ok(text.includes("[whole device] others 4.00 GiB \u00b7 free 8.00 GiB"));
  assert.ok(text.includes("[this process] KV pinned 2.00 GiB \u00b7 RSS 6.00 GiB"));
  assert.ok(text.includes("[whole system] others 10.0 GiB \u00b7 available 48.0 GiB"));
});

test("a store row shows its mode, holdings, device residency, bandwidth and exposed wait per step", () => {
  const rows = rowsOf(buildReadout(cudaPayload()));
  assert.equal(rows["KV cond/mode"].value, "ram_async");
  assert.equal(rows["KV cond/why"], undefined, "no reason line for a mode that is simply the one asked for");
  assert.equal(rows["KV cond/holds"].value, "device 128 MiB \u00b7 pinned RAM 2.00 GiB");
  assert.equal(rows["KV cond/on device"].value, "128 MiB (peak 192 MiB) \u00b7 2/32 layers");
  assert.equal(rows["KV cond/transfers"].value, "64 loads, 4.00 GiB \u00b7 20.0 GiB/s");
  assert.equal(rows["KV cond/exposed wait"].value, "6.00 ms/step \u00b7 12.0 ms total");
});

test("a fallback mode says what was asked and why", () => {
  const [store] = cudaPayload().stores;
  const rows = storeRows({ ...store, mode: "gpu", reason: "ram_async -> gpu: RAM tiers disabled, unified memory (Apple MPS)" });
  assert.equal(rows[0].value, "gpu (asked ram_async)");
  assert.match(rows[1].value, /RAM tiers disabled, unified memory/);
  const undecided = storeRows({ ...store, requested: "auto", mode: null });
  assert.equal(undecided[0].value, "auto: not decided yet");
  const older = storeRows({ ...store, mode: undefined, tier: "gpu" });  // a 0.1.0 server: "tier" only
  assert.equal(older[0].value, "gpu (asked ram_async)");
});

test("a batch's identical rows show as rows kept of rows put, the bytes saved and the check's cost", () => {
  const [store] = cudaPayload().stores;
  const dedup = { enabled: true, layers: 32, rows_put: 128, rows_kept: 32, saved_bytes: 6 * GiB, check_s: 0.0042 };
  const rows = rowsOf(buildReadout(cudaPayload({ stores: [{ ...store, dedup }] })));
  assert.equal(rows["KV cond/batch rows"].value, "32/128 rows kept \u00b7 6.00 GiB saved \u00b7 check 4.20 ms");
  assert.equal(batchRowsLine({ ...store, dedup: { ...dedup, layers: 0, rows_kept: 128, saved_bytes: 0 } }),
    "128/128 rows kept (rows differ) \u00b7 check 4.20 ms");
  assert.equal(batchRowsLine({ ...store, dedup: { ...dedup, enabled: false, layers: 0, rows_kept: 128 } }),
    "kept whole: check off");
  assert.equal(batchRowsLine({ ...store, dedup: { ...dedup, rows_put: 32 } }), null, "a batch of one: no row");
  assert.equal(batchRowsLine(store), null, "no figures: no row");
  assert.equal(rowsOf(buildReadout(cudaPayload()))["KV cond/batch rows"], undefined);
});

test("a closed store shows what it held, not an empty store", () => {
  const [store] = cudaPayload().stores;
  const closed = { ...store, closed: true, bytes: { device: 0, host_pinned: 0, host_pageable: 0, file: 0 },
    bytes_while_open: { device: 0, host_pinned: 0, host_pageable: 0, file: 3 * GiB } };
  const holds = storeRows(closed).find((r) => r.label === "holds");
  assert.equal(holds.value, "closed; held file 3.00 GiB");
});

test("Apple MPS shows current / driver of the recommended max, unified memory and swap", () => {
  const payload = cudaPayload({ memory: {
    v: 1, process: { rss: GiB, mps_current_allocated: 4 * GiB, mps_driver_allocated: 6 * GiB },
    device: { type: "mps", name: "Apple MPS", recommended_max: 16 * GiB, integrated: true },
    system: { ram_total: 32 * GiB, ram_available: 2 * GiB, swap_used: 3 * GiB, swap_total: 8 * GiB },
  } });
  const rows = rowsOf(buildReadout(payload));
  assert.equal(rows["memory/MPS"].value, "6.00 GiB of 16.0 GiB recommended max");
  assert.equal(rows["memory/MPS"].scope, "process");
  assert.match(rows["memory/memory"].value, /unified/);
  assert.equal(rows["memory/swap"].value, "3.00 GiB of 8.00 GiB (38%)");
  assert.equal(rows["memory/VRAM"], undefined);
  assert.match(readoutText(buildReadout(payload)), /\[this process\] KV on device 128 MiB \u00b7 allocated 4\.00 GiB \u00b7 driver 6\.00 GiB/);
});

test("a CPU device says it has no memory of its own", () => {
  const payload = cudaPayload();
  payload.memory.device = { type: "cpu", name: null, total: null, free: null, integrated: null };
  const rows = rowsOf(buildReadout(payload));
  assert.equal(rows["memory/device"].value, "cpu: no separate device memory");
  assert.equal(rows["memory/VRAM"], undefined);
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
  assert.ok(lines.includes("VRAM [whole device]: 16.0 GiB used of 24.0 GiB (67%)"));
  assert.ok(lines.includes("KV cache [this process]: 2.13 GiB in 1 store"));
  assert.equal(lines[0], "run: running \u00b7 7 forwards \u00b7 1.50 s");
});

test("stores are shown in the order the payload lists them (cond before uncond)", () => {
  const [cond] = cudaPayload().stores;
  const titles = buildReadout(cudaPayload({ stores: [cond, { ...cond, name: "uncond" }] })).map((s) => s.title);
  assert.deepEqual(titles.slice(-2), ["KV cond", "KV uncond"]);
});

test("compact readout: two lines, each the longest variant that fits", () => {
  const wide = buildCompact(cudaPayload());
  assert.deepEqual(wide, [
    "running \u00b7 7 forwards \u00b7 1.50 s \u00b7 VRAM 10.0 GiB of 24.0 GiB",
    "KV 2.13 GiB: device 128 MiB \u00b7 pinned 2.00 GiB \u00b7 wait 6.00 ms/step",
  ]);
  for (const n of [60, 40, 30, 20]) {
    const lines = buildCompact(cudaPayload(), { fits: (t) => t.length <= n });
    assert.equal(lines.length, 2);
    for (const line of lines) assert.ok(line.length <= n, `${n}: ${line}`);
  }
  assert.deepEqual(buildCompact(cudaPayload(), { fits: (t) => t.length <= 36 }), ["running \u00b7 VRAM 10.0 GiB of 24.0 GiB", "KV 2.13 GiB \u00b7 wait 6.00 ms/step"]);
  const tiny = buildCompact(cudaPayload(), { fits: () => false });
  assert.deepEqual(tiny, ["running", "KV 2.13 GiB"], "nothing fits: the shortest, which then wraps");
});

test("compact readout after the run, of another node's run, and before any", () => {
  const [store] = cudaPayload().stores;
  const closed = { ...store, closed: true, bytes: { device: 0, host_pinned: 0, host_pageable: 0, file: 0 },
    bytes_while_open: { device: 0, host_pinned: 0, host_pageable: 0, file: 3 * GiB } };
  const final = cudaPayload({ event: "final", run: { id: "r", active: false, forwards: 9, elapsed_s: 2 }, stores: [closed] });
  assert.equal(buildCompact(final)[1], "KV released, held 3.00 GiB: file 3.00 GiB \u00b7 wait 6.00 ms/step");
  const other = buildCompact(final, { own: false });
  assert.match(other[0], /^no run of this node yet/);
  assert.equal(other[1], "KV: \u2014", "another node's cache is not shown as this node's");
  assert.deepEqual(buildCompact(null), ["no data yet", ""]);
  assert.equal(buildCompact(cudaPayload({ stores: [] }))[1], "KV: no store yet");
});

test("a payload belongs to the Settings node that ran it", () => {
  const run = (node) => ({ run: { node } });
  assert.equal(isRunOf(run("12"), 12), true);
  assert.equal(isRunOf(run("5:12"), 12), true, "a node inside a subgraph");
  assert.equal(isRunOf(run("112"), 12), false);
  assert.equal(isRunOf(run(null), 12), false);
  assert.equal(isRunOf(run("kvo"), "kvo"), true);
});

test("a row's lead names its scope; a legend row has only the scope", () => {
  assert.equal(rowLead({ label: "RAM", scope: "system" }), "RAM [whole system]: ");
  assert.equal(rowLead({ label: "", scope: "process" }), "[this process] ");
  assert.equal(rowLead({ label: "run", scope: null }), "run: ");
  assert.equal(rowLead({ label: "", scope: null }), "");
});

test("readout: the server's prefix-reuse line is its own last section, nothing when absent", () => {
  const line = "reuse: 3 hits, 1 miss, 1 kept (14.2 MiB host)";
  const sections = buildReadout({ ...cudaPayload(), reuse: { on: true, line } });
  const last = sections[sections.length - 1];
  assert.equal(last.title, "reuse");
  assert.equal(last.rows.length, 1);
  assert.ok(JSON.stringify(last.rows[0]).includes(line));
  assert.ok(!buildReadout({ ...cudaPayload(), reuse: null }).some((sec) => sec.title === "reuse"));
});

test("a multi-GPU run shows each device with its memory and the KV its stores keep", () => {
  const device = (name, allocated, pinned) => ({
    device: name, stores: [`cond on ${name}`],
    memory: { process: { device_allocated: allocated }, device: { type: "cuda", total: 24 * GiB } },
    bytes: { device: 0, host_pinned: pinned, host_pageable: 0, file: 0 }, exposed_wait_s: 0.012,
  });
  const rows = rowsOf(buildReadout(cudaPayload({ devices: [device("cuda:0", 10 * GiB, 2 * GiB), device("cuda:1", 9 * GiB, GiB)] })));
  assert.equal(rows["devices/cuda:0"].value, "VRAM 10.0 GiB of 24.0 GiB \u00b7 KV pinned RAM 2.00 GiB in 1 store \u00b7 wait 12.0 ms");
  assert.equal(rows["devices/cuda:1"].value, "VRAM 9.00 GiB of 24.0 GiB \u00b7 KV pinned RAM 1.00 GiB in 1 store \u00b7 wait 12.0 ms");
  const one = rowsOf(buildReadout(cudaPayload({ devices: [device("cuda:0", 10 * GiB, 2 * GiB)] })));
  assert.equal(Object.keys(one).some((k) => k.startsWith("devices/")), false, "one device: the memory section says it all");
  const cpu = rowsOf(buildReadout(cudaPayload({ devices: [{ device: "cpu", memory: { device: { type: "cpu" } } }, { device: "cpu:1" }] })));
  assert.equal(cpu["devices/cpu"].value, "cpu: no separate device memory \u00b7 KV \u2014 in 0 stores \u00b7 wait \u2014");
  assert.equal(cpu["devices/cpu:1"].value, "\u2014: no separate device memory \u00b7 KV \u2014 in 0 stores \u00b7 wait \u2014");
});

test("the run's notes (a cache that stepped aside, the compiler turned off) show under its status", () => {
  const payload = cudaPayload();
  payload.run = { ...payload.run, notes: ["ComfyUI's compiler is off for this run: reason"] };
  const status = buildReadout(payload)[0];
  assert.deepEqual(status.rows.map((r) => [r.label, r.value]).slice(1),
                   [["note", "ComfyUI's compiler is off for this run: reason"]]);
  assert.equal(buildReadout(cudaPayload())[0].rows.length, 1, "no notes, no rows");
});

test("a growing cache (AR video) shows its tokens, bytes, what a step moved and the layers moved down", () => {
  const [store] = cudaPayload().stores;
  const growing = { tokens: 12480, capacity_tokens: 32760, committed_bytes: 2 * GiB, capacity_bytes: 5.5 * GiB,
    step_bytes: 1.2 * GiB, moves: ["layer 29 in pinned RAM -> in files at 12480 tokens: free RAM reached"] };
  const rows = rowsOf(buildReadout(cudaPayload({ stores: [{ ...store, growing }] })));
  assert.equal(rows["KV cond/grows"].value,
    "12480/32760 tokens \u00b7 2.00 GiB of 5.50 GiB \u00b7 moved 1.20 GiB/step \u00b7 1 layer moved to files");
  assert.equal(growingLine(store), null, "a fixed prefix: no row");
});

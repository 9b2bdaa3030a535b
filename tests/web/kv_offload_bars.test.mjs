// Unit tests of the readout's bars and timeline (pure arithmetic): `node --test tests/web/`.
import { test } from "node:test";
import assert from "node:assert/strict";

import {
  HISTORY_POINTS, isCapturing, kvHeldBytes, kvOpenBytes, memoryBars, recordPoint, stack, timelineGeometry,
  timelineLegend,
} from "../../web/kv_offload_bars.js";

const GiB = 2 ** 30;
const MiB = 2 ** 20;

function store(overrides = {}) {
  return { name: "cond", closed: false, bytes: { device: 1 * GiB, host_pinned: 2 * GiB, host_pageable: 0, file: 1 * GiB },
    bytes_while_open: null, ...overrides };
}

function payload(overrides = {}) {
  return {
    v: 1, event: "step", time: 0,
    run: { id: "r1", active: true, forwards: 3, elapsed_s: 1.0, marks: [] },
    memory: {
      v: 1,
      process: { rss: 8 * GiB, device_allocated: 10 * GiB, device_reserved: 12 * GiB },
      device: { type: "cuda", total: 40 * GiB, free: 20 * GiB },
      system: { ram_total: 64 * GiB, ram_available: 40 * GiB, swap_used: 1 * GiB, swap_total: 4 * GiB, cgroup_limit: null },
    },
    stores: [store()],
    ...overrides,
  };
}

const byId = (bars) => Object.fromEntries(bars.map((b) => [b.id, b]));
const widths = (bar) => Object.fromEntries(bar.segments.map((s) => [s.key, s.width]));

test("segments stack left to right and never leave the track", () => {
  const segs = stack([{ key: "a", bytes: 30 }, { key: "b", bytes: 0 }, { key: "c", bytes: 50 }, { key: "d", bytes: 40 }], 100);
  assert.deepEqual(segs.map((s) => [s.key, s.left, s.width]), [["a", 0, 30], ["c", 30, 50], ["d", 80, 20]],
    "an empty part draws nothing; an overshoot is clipped at the end of the track");
  assert.deepEqual(stack([{ key: "a", bytes: null }], 100), [], "unknown bytes draw nothing");
  assert.deepEqual(stack([{ key: "a", bytes: 5 }], null).map((s) => s.width), [0], "no total: no width, not a full bar");
});

test("the VRAM bar: the KV cache's device bytes, the rest of this process, its cache, others, free", () => {
  const vram = byId(memoryBars(payload())).vram;
  assert.equal(vram.scope, "device");
  assert.deepEqual(widths(vram), { "kv-device": 2.5, proc: 22.5, cache: 5, others: 20 });
  assert.deepEqual(vram.segments.map((s) => s.scope), ["process", "process", "process", "device"]);
  assert.equal(vram.value, "20.0 GiB used of 40.0 GiB (50%)");
  assert.deepEqual(vram.legend.map((l) => l.scope), ["process", "device"]);
  assert.deepEqual(vram.legend[1].items.map((i) => i.text), ["others 8.00 GiB", "free 20.0 GiB"]);
});

test("the RAM bar holds the KV cache's pinned and pageable bytes inside this process's RSS", () => {
  const ram = byId(memoryBars(payload())).ram;
  assert.deepEqual(widths(ram), { "kv-pinned": 3.1, proc: 9.4, others: 25 });
  assert.equal(ram.legend[0].items.map((i) => i.text).join(" | "), "KV pinned 2.00 GiB | RSS 8.00 GiB");
  // on a CPU (or unified memory) the "device" copy of the cache lives in RAM too
  const cpu = payload();
  cpu.memory.device = { type: "cpu" };
  const bars = byId(memoryBars(cpu));
  assert.equal(bars.vram, undefined);
  assert.deepEqual(Object.keys(widths(bars.ram)), ["kv-device", "kv-pinned", "proc", "others"]);
});

test("swap, cgroup and the KV cache's own bar", () => {
  const p = payload();
  p.memory.system.cgroup_limit = 32 * GiB;
  p.memory.system.cgroup_usage = 8 * GiB;
  const bars = byId(memoryBars(p));
  assert.deepEqual(widths(bars.swap), { swap: 25 });
  assert.deepEqual(widths(bars.cgroup), { others: 25 });
  assert.equal(bars.kv.value, "4.00 GiB in 1 store");
  assert.deepEqual(widths(bars.kv), { "kv-device": 25, "kv-pinned": 50, "kv-file": 25 });
  assert.equal(bars.kv.released, false);
  const noSwap = payload();
  noSwap.memory.system.swap_total = 0;
  assert.equal(byId(memoryBars(noSwap)).swap.value, "no swap");
});

test("after the run the KV bar shows what the cache held, marked released; the RAM bar no longer counts it", () => {
  const closed = store({ closed: true, bytes: { device: 0, host_pinned: 0, host_pageable: 0, file: 0 },
    bytes_while_open: { device: 0, host_pinned: 0, host_pageable: 0, file: 3 * GiB } });
  const p = payload({ event: "final", stores: [closed] });
  assert.deepEqual(kvOpenBytes(p), { device: 0, host_pinned: 0, host_pageable: 0, file: 0 });
  assert.equal(kvHeldBytes(p).file, 3 * GiB);
  const bars = byId(memoryBars(p));
  assert.equal(bars.kv.released, true);
  assert.equal(bars.kv.value, "released; held 3.00 GiB in 1 store");
  assert.equal(widths(bars.ram)["kv-pinned"], undefined);
  assert.equal(byId(memoryBars(payload({ stores: [] }))).kv.value, "none in this run");
});

test("unknown figures draw no segment and print a dash", () => {
  const p = payload();
  p.memory.process.device_reserved = null;
  p.memory.device.free = null;
  const vram = byId(memoryBars(p)).vram;
  assert.deepEqual(Object.keys(widths(vram)), ["kv-device", "proc"]);
  assert.match(vram.value, /^\u2014 used of 40\.0 GiB/);
});

test("the history follows one run: a new run id starts over, idle and stale payloads change nothing", () => {
  let h = recordPoint(null, payload());
  h = recordPoint(h, payload({ run: { id: "r1", active: true, elapsed_s: 2, marks: [{ what: "capture", start_s: 0.1, end_s: 0.5 }] } }));
  assert.deepEqual(h.points.map((p) => p.t), [1, 2]);
  assert.equal(h.points[1].kv, 4 * GiB);
  assert.equal(h.points[1].mem, 10 * GiB, "on CUDA the line follows this process's allocated VRAM");
  assert.equal(h.label, "VRAM allocated");
  assert.equal(recordPoint(h, payload({ run: { id: "r1", elapsed_s: 1.5 } })), h, "an older payload is ignored");
  assert.equal(recordPoint(h, { v: 1, event: "idle", run: { id: null } }), h);
  const next = recordPoint(h, payload({ run: { id: "r2", active: true, elapsed_s: 0 } }));
  assert.deepEqual(next.points.map((p) => p.t), [0]);
  assert.deepEqual(h.points.length, 2, "the old history object is left as it was");
});

test("a long run keeps a bounded history, first and last point included", () => {
  let h = null;
  for (let i = 0; i <= 3 * HISTORY_POINTS; i++) h = recordPoint(h, payload({ run: { id: "r", elapsed_s: i } }));
  assert.ok(h.points.length <= HISTORY_POINTS);
  assert.equal(h.points[0].t, 0);
  assert.equal(h.points[h.points.length - 1].t, 3 * HISTORY_POINTS);
});

test("timeline geometry: memory in the top lane, KV below, the capture span and the release line", () => {
  let h = null;
  const marks = [{ what: "capture", start_s: 1, end_s: 2 }];
  h = recordPoint(h, payload({ run: { id: "r", elapsed_s: 0, marks: [] }, stores: [] }));
  h = recordPoint(h, payload({ run: { id: "r", elapsed_s: 2, marks } }));
  h = recordPoint(h, payload({ event: "final", run: { id: "r", elapsed_s: 4,
    marks: [...marks, { what: "release", start_s: 4, end_s: 4 }] }, stores: [store({ closed: true })] }));
  const g = timelineGeometry(h, 200, 40);
  assert.equal(g.lane, 20);
  assert.equal(g.mem, "M0 1L100 1L200 1", "memory constant at its peak, on top");
  assert.equal(g.kvLine, "M0 39L100 22L200 39", "KV from nothing to its peak and back to nothing at the release");
  assert.match(g.kvArea, /Z$/);
  assert.deepEqual(g.marks, [{ what: "capture", x: 50, width: 50 }, { what: "release", x: 200, width: 0 }]);
  assert.deepEqual(timelineLegend(h).map((i) => i.text),
    ["VRAM allocated 10.0 GiB (peak 10.0 GiB)", "KV 0 B (peak 4.00 GiB)", "capture", "release"]);
  assert.deepEqual(timelineLegend(null).map((i) => i.text), ["no run yet"]);
  assert.equal(timelineGeometry(null, 200, 40).mem, "");
});

test("a payload is 'capturing' while a capture mark is open in an active run", () => {
  assert.equal(isCapturing(payload({ run: { active: true, marks: [{ what: "capture", start_s: 0, end_s: null }] } })), true);
  assert.equal(isCapturing(payload({ run: { active: true, marks: [{ what: "capture", start_s: 0, end_s: 1 }] } })), false);
  assert.equal(isCapturing(payload({ run: { active: false, marks: [{ what: "capture", start_s: 0, end_s: null }] } })), false);
  assert.equal(isCapturing(null), false);
});

test("on a CPU the timeline follows RSS", () => {
  const p = payload();
  p.memory.device = { type: "cpu" };
  const h = recordPoint(null, p);
  assert.equal(h.label, "RSS");
  assert.equal(h.points[0].mem, 8 * GiB);
  assert.ok(MiB > 0);
});

// Bars and the timeline of the KV Offload memory readout: which share of each memory is whose, and how device
// memory and the KV cache moved over the run. Pure arithmetic on `kv_offload.memory` payloads (version 1): no
// DOM, no ComfyUI, so `node --test` imports it. The widget draws exactly what these functions return.
//
// A bar is one memory (VRAM, MPS, RAM, swap, cgroup, the KV cache itself) split into stacked segments, left to
// right: the KV cache's share first, in the colour of where it lies (device / pinned / pageable / file), then
// the rest of this process, then other processes, then free (the empty track). Every segment carries its scope.

import { UNKNOWN, formatBytes, formatPercent, isKnown, sub, sumKnown } from "./kv_offload_units.js";

// Where a KV cache's bytes lie, fastest first (`offload_core/places.py`): payload key, segment key (its colour),
// name in legends, name in the readout's rows, name in the Settings node's compact line.
export const KV_PLACES = [
  { place: "device", key: "kv-device", name: "KV on device", row: "device", short: "device" },
  { place: "host_pinned", key: "kv-pinned", name: "KV pinned", row: "pinned RAM", short: "pinned" },
  { place: "host_pageable", key: "kv-pageable", name: "KV pageable", row: "RAM", short: "RAM" },
  { place: "file", key: "kv-file", name: "KV file", row: "file", short: "file" },
];

function stores(payload) {
  return Array.isArray(payload?.stores) ? payload.stores : [];
}

// Bytes per place held by the stores still open (a closed store holds nothing); null per place when unknown.
export function kvOpenBytes(payload) {
  const open = stores(payload).filter((s) => !s.closed);
  return Object.fromEntries(KV_PLACES.map(({ place }) => [place, open.length ? sumKnown(open.map((s) => s.bytes?.[place])) : 0]));
}

// Bytes per place the stores held while open: what a finished run's cache was made of.
export function kvHeldBytes(payload) {
  const all = stores(payload);
  const held = (s) => (s.closed ? s.bytes_while_open : s.bytes) || {};
  return Object.fromEntries(KV_PLACES.map(({ place }) => [place, all.length ? sumKnown(all.map((s) => held(s)[place])) : 0]));
}

export function kvTotal(bytes) {
  return sumKnown(KV_PLACES.map(({ place }) => bytes?.[place]));
}

// Stacked segments of `total`: each {key, label, bytes, scope, left, width} in percent of the track, clamped so
// the stack never leaves it (figures read a moment apart can add up to a little more than the total).
export function stack(parts, total) {
  let at = 0;
  return parts.filter((p) => isKnown(p.bytes) && p.bytes > 0).map((p) => {
    const pct = isKnown(total) && total > 0 ? (100 * p.bytes) / total : 0;
    const left = Math.min(100, at);
    at += pct;
    const right = Math.min(100, at);
    return { ...p, left: round1(left), width: round1(right - left) };
  });
}

function round1(x) {
  return Math.round(x * 10) / 10;
}

function part(key, label, bytes, scope) {
  return { key, label, bytes: isKnown(bytes) ? Math.max(0, bytes) : null, scope };
}

function legendItem(p) {
  return { key: p.key, text: `${p.label} ${formatBytes(p.bytes)}` };
}

// A bar: {id, title, scope, value, total, segments, legend: [{scope, items: [{key, text}]}]}.
function bar(id, title, scope, value, total, parts, legend) {
  return { id, title, scope, value, total: isKnown(total) ? total : null, segments: stack(parts, total), legend };
}

function kvParts(kv, places) {
  return KV_PLACES.filter(({ place }) => places.includes(place))
    .map(({ place, key, name }) => part(key, name, kv[place], "process"));
}

function shown(parts) {
  return parts.filter((p) => isKnown(p.bytes) && p.bytes > 0).map(legendItem);
}

function cudaBar(p, d, kv) {
  const used = sub(d.total, d.free);
  const kvDev = isKnown(kv.device) ? kv.device : 0;
  const mine = [
    ...kvParts(kv, ["device"]),
    part("proc", "allocated", sub(p.device_allocated, kvDev), "process"),
    part("cache", "cached", sub(p.device_reserved, p.device_allocated), "process"),
  ];
  const others = part("others", "others", sub(used, p.device_reserved), "device");
  return bar("vram", "VRAM", "device", `${formatBytes(used)} used of ${formatBytes(d.total)} (${formatPercent(used, d.total)})`,
    d.total, [...mine, others], [
      { scope: "process", items: [...shown(mine.slice(0, 1)), { key: "proc", text: `allocated ${formatBytes(p.device_allocated)}` },
        { key: "cache", text: `reserved ${formatBytes(p.device_reserved)}` }] },
      { scope: "device", items: [legendItem(others), { key: "free", text: `free ${formatBytes(d.free)}` }] },
    ]);
}

function mpsBar(p, d, kv) {
  const kvDev = isKnown(kv.device) ? kv.device : 0;
  const mine = [
    ...kvParts(kv, ["device"]),
    part("proc", "allocated", sub(p.mps_current_allocated, kvDev), "process"),
    part("cache", "driver", sub(p.mps_driver_allocated, p.mps_current_allocated), "process"),
  ];
  return bar("mps", "MPS", "process", `${formatBytes(p.mps_driver_allocated)} of ${formatBytes(d.recommended_max)} recommended max`,
    d.recommended_max, mine, [
      { scope: "process", items: [...shown(mine.slice(0, 1)), { key: "proc", text: `allocated ${formatBytes(p.mps_current_allocated)}` },
        { key: "cache", text: `driver ${formatBytes(p.mps_driver_allocated)}` }] },
    ]);
}

function ramBar(p, s, kv, deviceIsRam) {
  const places = deviceIsRam ? ["device", "host_pinned", "host_pageable"] : ["host_pinned", "host_pageable"];
  const kvParts_ = kvParts(kv, places);
  const kvRam = sumKnown(kvParts_.map((x) => x.bytes)) ?? 0;
  const used = sub(s.ram_total, s.ram_available);
  const mine = [...kvParts_, part("proc", "RSS", sub(p.rss, kvRam), "process")];
  const others = part("others", "others", sub(used, p.rss), "system");
  return bar("ram", "RAM", "system", `${formatBytes(used)} used of ${formatBytes(s.ram_total)} (${formatPercent(used, s.ram_total)})`,
    s.ram_total, [...mine, others], [
      { scope: "process", items: [...shown(kvParts_), { key: "proc", text: `RSS ${formatBytes(p.rss)}` }] },
      { scope: "system", items: [legendItem(others), { key: "free", text: `available ${formatBytes(s.ram_available)}` }] },
    ]);
}

function swapBar(s) {
  if (isKnown(s.swap_total) && s.swap_total === 0) return bar("swap", "swap", "system", "no swap", null, [], []);
  const value = isKnown(s.swap_used) ? `${formatBytes(s.swap_used)} of ${formatBytes(s.swap_total)} (${formatPercent(s.swap_used, s.swap_total)})` : UNKNOWN;
  return bar("swap", "swap", "system", value, s.swap_total, [part("swap", "used", s.swap_used, "system")], []);
}

function cgroupBar(s) {
  const value = `${formatBytes(s.cgroup_usage)} of ${formatBytes(s.cgroup_limit)} limit (${formatPercent(s.cgroup_usage, s.cgroup_limit)})`;
  return bar("cgroup", "cgroup", "system", value, s.cgroup_limit, [part("others", "used", s.cgroup_usage, "system")], []);
}

// The KV cache alone: where its bytes lie, of its own total. After the run: what it held, marked released.
function kvBar(payload) {
  const all = stores(payload);
  const released = all.length > 0 && all.every((s) => s.closed);
  const bytes = released ? kvHeldBytes(payload) : kvOpenBytes(payload);
  const total = kvTotal(bytes);
  const n = `${all.length} store${all.length === 1 ? "" : "s"}`;
  const value = !all.length ? "none in this run" : released ? `released; held ${formatBytes(total)} in ${n}` : `${formatBytes(total)} in ${n}`;
  const parts = kvParts(bytes, KV_PLACES.map((x) => x.place));
  const b = bar("kv", "KV cache", "process", value, total, parts, parts.some((x) => x.bytes > 0) ? [{ scope: "process", items: shown(parts) }] : []);
  b.released = released;
  return b;
}

// Every bar the payload has figures for, in reading order.
export function memoryBars(payload) {
  const m = payload?.memory || {};
  const p = m.process || {};
  const d = m.device || {};
  const s = m.system || {};
  const kv = kvOpenBytes(payload);
  const bars = [];
  if (d.type === "cuda") bars.push(cudaBar(p, d, kv));
  else if (d.type === "mps") bars.push(mpsBar(p, d, kv));
  bars.push(ramBar(p, s, kv, d.type !== "cuda"));
  bars.push(swapBar(s));
  if (isKnown(s.cgroup_limit)) bars.push(cgroupBar(s));
  bars.push(kvBar(payload));
  return bars;
}

// --- timeline ------------------------------------------------------------------------------------------------

export const HISTORY_POINTS = 400;

// The memory the timeline follows: the device's (this process) where there is one, else this process's RSS.
export function memorySeries(payload) {
  const p = payload?.memory?.process || {};
  const type = payload?.memory?.device?.type;
  if (type === "cuda") return { label: "VRAM allocated", bytes: p.device_allocated };
  if (type === "mps") return { label: "MPS allocated", bytes: p.mps_current_allocated };
  return { label: "RSS", bytes: p.rss };
}

// Whether the payload was taken while a capture step was still filling its stores.
export function isCapturing(payload) {
  const marks = payload?.run?.marks;
  return !!payload?.run?.active && Array.isArray(marks) && marks.some((m) => m.what === "capture" && !isKnown(m.end_s));
}

export function emptyHistory() {
  return { runId: null, label: null, points: [], marks: [] };
}

// The run's history with `payload` added: a new run starts a new history; idle and unknown payloads change
// nothing; a point never goes back in time. Returns a new object (the old one is left as it was).
export function recordPoint(history, payload) {
  const h = history || emptyHistory();
  const run = payload?.run;
  if (!payload || payload.v !== 1 || !run || run.id === null || run.id === undefined || !isKnown(run.elapsed_s)) return h;
  const fresh = h.runId !== run.id;
  let points = fresh ? [] : h.points.slice();
  const series = memorySeries(payload);
  const point = { t: run.elapsed_s, mem: isKnown(series.bytes) ? series.bytes : null, kv: kvTotal(kvOpenBytes(payload)) ?? 0,
    event: payload.event };
  const last = points[points.length - 1];
  if (last && point.t < last.t) return h;
  if (last && point.t === last.t) points[points.length - 1] = point;
  else points.push(point);
  if (points.length > HISTORY_POINTS) points = points.filter((_, i) => i % 2 === 0 || i === points.length - 1);
  return { runId: run.id, label: series.label, points, marks: Array.isArray(run.marks) ? run.marks.slice() : [] };
}

function pathOf(points, x, y, key) {
  let d = "";
  let pen = false;
  for (const p of points) {
    if (!isKnown(p[key])) {
      pen = false;
      continue;
    }
    d += `${pen ? "L" : "M"}${x(p.t)} ${y(p[key])}`;
    pen = true;
  }
  return d;
}

// SVG geometry of the timeline in a `width` x `height` box, in two lanes that share the time axis: the
// memory line on top, the KV cache's bytes as an area below (each lane from 0 to its own peak, which the
// legend states: the cache is often a small share of the memory and would vanish on a shared scale); the
// capture spans and the release line cross both lanes.
export function timelineGeometry(history, width, height) {
  const points = history?.points || [];
  const tMax = Math.max(1e-9, ...points.map((p) => p.t));
  const x = (t) => round1((width * t) / tMax);
  const lane = Math.floor(height / 2);
  const peak = (key) => Math.max(1, ...points.map((p) => p[key]).filter(isKnown));
  const yMem = (v) => round1(lane - 2 - ((lane - 3) * v) / peak("mem"));
  const yKv = (v) => round1(height - 1 - ((height - lane - 3) * v) / peak("kv"));
  const kvLine = pathOf(points, x, yKv, "kv");
  const kvPoints = points.filter((p) => isKnown(p.kv));
  const kvArea = kvLine && kvPoints.length > 1
    ? `${kvLine}L${x(kvPoints[kvPoints.length - 1].t)} ${height - 1}L${x(kvPoints[0].t)} ${height - 1}Z` : "";
  const marks = (history?.marks || []).filter((m) => isKnown(m.start_s)).map((m) => {
    const start = x(Math.min(m.start_s, tMax));
    const end = isKnown(m.end_s) ? x(Math.min(m.end_s, tMax)) : x(tMax);
    return { what: m.what, x: start, width: round1(Math.max(end - start, 0)) };
  });
  return { width, height, lane, tMax: points.length ? tMax : 0, mem: pathOf(points, x, yMem, "mem"), kvArea, kvLine, marks };
}

// The figures under the timeline: what the lines are, now and at their peak.
export function timelineLegend(history) {
  const points = history?.points || [];
  if (!points.length) return [{ key: "none", text: "no run yet" }];
  const last = points[points.length - 1];
  const peak = (key) => Math.max(...points.map((p) => p[key]).filter(isKnown));
  const items = [
    { key: "mem", text: `${history.label} ${formatBytes(last.mem)} (peak ${formatBytes(points.some((p) => isKnown(p.mem)) ? peak("mem") : null)})` },
    { key: "kv", text: `KV ${formatBytes(last.kv)} (peak ${formatBytes(peak("kv"))})` },
  ];
  for (const what of ["capture", "release"]) {
    if ((history.marks || []).some((m) => m.what === what)) items.push({ key: what, text: what });
  }
  return items;
}

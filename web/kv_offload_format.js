// Pure formatting for the KV Offload memory readout: units, percentages, bar widths and the rows the widget
// shows, computed from one `kv_offload.memory` payload (version 1). No DOM, no ComfyUI: `node --test` imports it.
//
// Every figure carries its scope, because a readout that mixes them lies: "process" (this ComfyUI process),
// "device" (the whole GPU, every process on it), "system" (the whole machine). Unknown values arrive as null
// and are shown as an em dash, never as 0.

export const PAYLOAD_VERSION = 1;
export const UNKNOWN = "\u2014";

const UNITS = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];

export function isKnown(x) {
  return typeof x === "number" && Number.isFinite(x);
}

// 1536 -> "1.50 KiB": three significant digits, binary units (what allocators and OS tools count in).
export function formatBytes(n) {
  if (!isKnown(n)) return UNKNOWN;
  const sign = n < 0 ? "-" : "";
  let v = Math.abs(n);
  let i = 0;
  while (v >= 1024 && i < UNITS.length - 1) {
    v /= 1024;
    i += 1;
  }
  if (i === 0) return `${sign}${Math.round(v)} B`;
  const digits = v >= 100 ? 0 : v >= 10 ? 1 : 2;
  // 1023.999 KiB would print as "1024 KiB": carry into the next unit instead.
  if (Number(v.toFixed(digits)) >= 1024 && i < UNITS.length - 1) return `${sign}1.00 ${UNITS[i + 1]}`;
  return `${sign}${v.toFixed(digits)} ${UNITS[i]}`;
}

export function formatRate(bytesPerSecond) {
  return isKnown(bytesPerSecond) ? `${formatBytes(bytesPerSecond)}/s` : UNKNOWN;
}

// Seconds -> "850 µs", "12.3 ms", "1.20 s".
export function formatDuration(s) {
  if (!isKnown(s)) return UNKNOWN;
  const a = Math.abs(s);
  if (a === 0) return "0 ms";
  if (a < 1e-3) return `${Math.round(s * 1e6)} \u00b5s`;
  if (a < 1) return `${(s * 1e3).toFixed(a < 0.01 ? 2 : a < 0.1 ? 1 : 0)} ms`;
  if (a < 60) return `${s.toFixed(2)} s`;
  return `${Math.floor(s / 60)} min ${Math.round(s % 60)} s`;
}

// part / whole as a whole percentage; over 100 % is shown as is (an honest overshoot, not a clamp).
export function formatPercent(part, whole) {
  if (!isKnown(part) || !isKnown(whole) || whole <= 0) return UNKNOWN;
  return `${Math.round((100 * part) / whole)}%`;
}

// Width of a bar in percent of its track: clamped to [0, 100], one decimal; null when unknown.
export function barWidth(part, whole) {
  if (!isKnown(part) || !isKnown(whole) || whole <= 0) return null;
  const pct = (100 * part) / whole;
  return Math.round(Math.min(100, Math.max(0, pct)) * 10) / 10;
}

// "3.20 GiB of 24.0 GiB (13%)"
export function formatOf(part, whole) {
  if (!isKnown(part)) return UNKNOWN;
  if (!isKnown(whole) || whole <= 0) return formatBytes(part);
  return `${formatBytes(part)} of ${formatBytes(whole)} (${formatPercent(part, whole)})`;
}

function sub(a, b) {
  return isKnown(a) && isKnown(b) ? a - b : null;
}

function row(label, value, scope, bar = null) {
  return { label, value, scope, bar };
}

export function statusLine(payload) {
  if (!payload || typeof payload !== "object") return "no data yet";
  if (payload.v !== PAYLOAD_VERSION) return `unsupported payload version ${payload.v}`;
  const run = payload.run || {};
  const parts = [];
  if (isKnown(run.forwards)) parts.push(`${run.forwards} forward${run.forwards === 1 ? "" : "s"}`);
  if (isKnown(run.elapsed_s)) parts.push(formatDuration(run.elapsed_s));
  const tail = parts.length ? ` \u00b7 ${parts.join(" \u00b7 ")}` : "";
  if (payload.event === "idle") return "idle: no run since start-up";
  return (run.active ? "running" : "last run finished") + tail;
}

export function deviceRows(memory) {
  const p = memory?.process || {};
  const d = memory?.device || {};
  const rows = [];
  if (d.type === "cuda") {
    rows.push(row("VRAM allocated", formatOf(p.device_allocated, d.total), "process", barWidth(p.device_allocated, d.total)));
    rows.push(row("VRAM reserved", formatOf(p.device_reserved, d.total), "process", barWidth(p.device_reserved, d.total)));
    const used = sub(d.total, d.free);
    rows.push(row("VRAM in use, all processes", formatOf(used, d.total), "device", barWidth(used, d.total)));
    rows.push(row("VRAM free", `${formatBytes(d.free)} of ${formatBytes(d.total)}`, "device"));
  } else if (d.type === "mps") {
    rows.push(row("MPS allocated", formatOf(p.mps_current_allocated, d.recommended_max), "process",
      barWidth(p.mps_current_allocated, d.recommended_max)));
    rows.push(row("MPS driver", formatOf(p.mps_driver_allocated, d.recommended_max), "process",
      barWidth(p.mps_driver_allocated, d.recommended_max)));
    rows.push(row("MPS recommended max", formatBytes(d.recommended_max), "device"));
  } else if (d.type) {
    rows.push(row("device", `${d.type}: no separate device memory`, "device"));
  } else {
    rows.push(row("device", UNKNOWN, "device"));
  }
  if (d.integrated === true) rows.push(row("memory", "unified: device and RAM are one pool", "device"));
  return rows;
}

export function hostRows(memory) {
  const p = memory?.process || {};
  const s = memory?.system || {};
  const rows = [
    row("RSS", formatOf(p.rss, s.ram_total), "process", barWidth(p.rss, s.ram_total)),
    row("RAM available", formatOf(s.ram_available, s.ram_total), "system", barWidth(sub(s.ram_total, s.ram_available), s.ram_total)),
    row("swap used", isKnown(s.swap_total) && s.swap_total === 0 ? "no swap" : formatOf(s.swap_used, s.swap_total),
      "system", barWidth(s.swap_used, s.swap_total)),
  ];
  if (isKnown(s.cgroup_limit)) {
    rows.push(row("cgroup", formatOf(s.cgroup_usage, s.cgroup_limit), "system", barWidth(s.cgroup_usage, s.cgroup_limit)));
  }
  return rows;
}

const PLACES = [["device", "device"], ["host_pinned", "pinned RAM"], ["host_pageable", "RAM"], ["file", "file"]];

// "pinned RAM 1.20 GiB · file 300 MiB": the places that hold something; "nothing" when all are 0.
export function formatPlaces(bytes) {
  if (!bytes || typeof bytes !== "object") return UNKNOWN;
  const held = PLACES.filter(([k]) => isKnown(bytes[k]) && bytes[k] > 0).map(([k, name]) => `${name} ${formatBytes(bytes[k])}`);
  if (held.length) return held.join(" \u00b7 ");
  return PLACES.some(([k]) => isKnown(bytes[k])) ? "nothing" : UNKNOWN;
}

export function tierLine(store) {
  if (!store.tier) return `${store.requested || "?"}: not decided yet`;
  return store.requested && store.requested !== store.tier ? `${store.tier} (asked ${store.requested})` : store.tier;
}

export function storeRows(store) {
  const rows = [row("tier", tierLine(store), "store")];
  if (store.reason && store.reason !== "requested") rows.push(row("why", store.reason, "store"));
  if (store.closed) {
    rows.push(row("holds", store.bytes_while_open ? `closed; held ${formatPlaces(store.bytes_while_open)}` : "closed", "store"));
  } else {
    rows.push(row("holds", formatPlaces(store.bytes), "store"));
  }
  const layers = isKnown(store.resident_layers) && isKnown(store.layers) ? ` \u00b7 ${store.resident_layers}/${store.layers} layers` : "";
  rows.push(row("on device", `${formatBytes(store.device_bytes)} (peak ${formatBytes(store.peak_device_bytes)})${layers}`, "store"));
  const t = store.transfers || {};
  const count = isKnown(t.count) ? `${t.count} loads, ${formatBytes(t.bytes)}` : UNKNOWN;
  rows.push(row("transfers", `${count} \u00b7 ${formatRate(store.bandwidth_bytes_per_s)}`, "store"));
  rows.push(row("exposed wait", `${formatDuration(store.exposed_wait_per_pass_s)}/step \u00b7 ${formatDuration(store.exposed_wait_s)} total`, "store"));
  if (store.pinned_fallback) rows.push(row("note", `pageable copies: ${store.pinned_fallback_reason || "pinning refused"}`, "store"));
  return rows;
}

// The whole readout as sections of rows: {title, rows: [{label, value, scope, bar}]}.
export function buildReadout(payload) {
  const sections = [{ title: "status", rows: [row("run", statusLine(payload), null)] }];
  if (!payload || payload.v !== PAYLOAD_VERSION) return sections;
  sections.push({ title: "device", rows: deviceRows(payload.memory) });
  sections.push({ title: "host", rows: hostRows(payload.memory) });
  const stores = Array.isArray(payload.stores) ? payload.stores : [];
  if (!stores.length) sections.push({ title: "KV cache", rows: [row("stores", "none in this run", null)] });
  for (const s of stores) sections.push({ title: `KV ${s.name || "store"}`, rows: storeRows(s) });
  return sections;
}

// A few short lines for the KV Offload Settings node.
export function buildCompact(payload) {
  const lines = [statusLine(payload)];
  if (!payload || payload.v !== PAYLOAD_VERSION) return lines;
  const m = payload.memory || {};
  const p = m.process || {};
  const d = m.device || {};
  const s = m.system || {};
  if (d.type === "cuda") lines.push(`VRAM ${formatBytes(p.device_allocated)} alloc \u00b7 ${formatBytes(d.free)} free of ${formatBytes(d.total)}`);
  if (d.type === "mps") lines.push(`MPS ${formatBytes(p.mps_current_allocated)} \u00b7 max ${formatBytes(d.recommended_max)}`);
  lines.push(`RAM RSS ${formatBytes(p.rss)} \u00b7 ${formatBytes(s.ram_available)} free \u00b7 swap ${formatBytes(s.swap_used)}`);
  for (const st of Array.isArray(payload.stores) ? payload.stores : []) {
    const held = st.closed ? `closed, held ${formatPlaces(st.bytes_while_open)}` : formatPlaces(st.bytes);
    lines.push(`${st.name || "KV"}: ${tierLine(st)} \u00b7 ${held} \u00b7 wait ${formatDuration(st.exposed_wait_per_pass_s)}/step`);
  }
  if (payload.reuse && payload.reuse.line) lines.push(payload.reuse.line);
  return lines;
}

export const SCOPE_NAMES = { process: "this process", device: "whole device", system: "whole system" };

// "VRAM free [whole device]: " -- the text before a row's value.
export function rowLead(r) {
  if (!r.label) return "";
  const scope = SCOPE_NAMES[r.scope];
  return `${r.label}${scope ? ` [${scope}]` : ""}: `;
}

// Plain text of a readout, one line per row: exactly the text content of the widget's rows.
export function readoutText(sections) {
  return sections.flatMap((sec) => sec.rows.map((r) => rowLead(r) + r.value)).join("\n");
}

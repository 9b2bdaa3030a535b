// Pure formatting for the KV Offload memory readout: the rows the widget shows, computed from one
// `kv_offload.memory` payload (version 1). No DOM, no ComfyUI: `node --test` imports it.
//
// Every figure carries its scope, because a readout that mixes them lies: "process" (this ComfyUI process),
// "device" (the whole GPU, every process on it), "system" (the whole machine). Unknown values arrive as null
// and are shown as an em dash, never as 0. Units live in kv_offload_units.js, bars and the timeline in
// kv_offload_bars.js; this module turns them into rows.

import { UNKNOWN, formatBytes, formatDuration, formatRate, isKnown } from "./kv_offload_units.js";
import { KV_PLACES, memoryBars } from "./kv_offload_bars.js";

export * from "./kv_offload_units.js";

export const PAYLOAD_VERSION = 1;

function row(label, value, scope, extra = {}) {
  return { label, value, scope, ...extra };
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

// What the bars cannot say about the device: that there is no separate device memory, or that it is RAM.
export function deviceNotes(memory) {
  const d = memory?.device || {};
  const rows = [];
  if (!d.type) rows.push(row("device", UNKNOWN, "device"));
  else if (d.type !== "cuda" && d.type !== "mps") rows.push(row("device", `${d.type}: no separate device memory`, "device"));
  if (d.integrated === true) rows.push(row("memory", "unified: device and RAM are one pool", "device"));
  return rows;
}

// The rows of one bar: a header row (title, scope, summary, the stacked segments), then one legend row per
// scope whose items carry the key of their colour.
export function barRows(bar) {
  const track = bar.total > 0 ? { bar: bar.id, segments: bar.segments, released: !!bar.released } : {};  // no swap: no track
  const head = row(bar.title, bar.value, bar.scope, track);
  const legend = bar.legend.filter((l) => l.items.length).map((l) =>
    row("", l.items.map((it) => it.text).join(" \u00b7 "), l.scope, { swatches: l.items }));
  return [head, ...legend];
}

// "pinned RAM 1.20 GiB · file 300 MiB": the places that hold something; "nothing" when all are 0.
export function formatPlaces(bytes) {
  if (!bytes || typeof bytes !== "object") return UNKNOWN;
  const held = KV_PLACES.filter(({ place }) => isKnown(bytes[place]) && bytes[place] > 0)
    .map(({ place, row }) => `${row} ${formatBytes(bytes[place])}`);
  if (held.length) return held.join(" \u00b7 ");
  return KV_PLACES.some(({ place }) => isKnown(bytes[place])) ? "nothing" : UNKNOWN;
}

// The mode a store runs in (`stats()["mode"]`; 0.1.0 sent it as "tier" only), and the one asked for.
export function modeLine(store) {
  const mode = store.mode ?? store.tier;
  if (!mode) return `${store.requested || "?"}: not decided yet`;
  return store.requested && store.requested !== mode ? `${mode} (asked ${store.requested})` : mode;
}

// Identical batch rows kept once (`stats()["dedup"]`): "1/4 rows kept · 96.0 MiB saved · check 1.20 ms"; null
// for a batch of one (nothing to share) or a store without the figures.
export function batchRowsLine(store) {
  const d = store.dedup;
  if (!d || typeof d !== "object" || !isKnown(d.rows_put) || !isKnown(d.rows_kept)) return null;
  if (isKnown(store.layers) && d.rows_put <= store.layers) return null;
  if (d.enabled === false) return "kept whole: check off";
  const kept = `${d.rows_kept}/${d.rows_put} rows kept`;
  const check = `check ${formatDuration(d.check_s)}`;
  if (!d.layers) return `${kept} (rows differ) \u00b7 ${check}`;
  return `${kept} \u00b7 ${formatBytes(d.saved_bytes)} saved \u00b7 ${check}`;
}

// One device of a multi-GPU run: "cuda:1: VRAM 10.0 GiB of 24.0 GiB · KV pinned RAM 2.00 GiB · wait 12.0 ms".
export function deviceRow(d) {
  const m = d.memory || {};
  const p = m.process || {};
  const dev = m.device || {};
  let memory = `${dev.type || UNKNOWN}: no separate device memory`;
  if (dev.type === "cuda") memory = `VRAM ${formatBytes(p.device_allocated)} of ${formatBytes(dev.total)}`;
  else if (dev.type === "mps") memory = `MPS ${formatBytes(p.mps_current_allocated)} of ${formatBytes(dev.recommended_max)}`;
  const stores = Array.isArray(d.stores) ? d.stores.length : 0;
  const kv = `KV ${formatPlaces(d.bytes)} in ${stores} store${stores === 1 ? "" : "s"}`;
  return row(d.device || "device", `${memory} · ${kv} · wait ${formatDuration(d.exposed_wait_s)}`, "process");
}

// A growing cache (autoregressive video, `stats()["growing"]`): "12480/32760 tokens · 2.10 GiB of 5.62 GiB ·
// moved 1.20 GiB/step · 1 layer moved to files"; null for a store of a fixed prefix.
export function growingLine(store) {
  const g = store.growing;
  if (!g || typeof g !== "object" || !isKnown(g.tokens) || !isKnown(g.capacity_tokens)) return null;
  const parts = [`${g.tokens}/${g.capacity_tokens} tokens`,
    `${formatBytes(g.committed_bytes)} of ${formatBytes(g.capacity_bytes)}`,
    `moved ${formatBytes(g.step_bytes)}/step`];
  const moves = Array.isArray(g.moves) ? g.moves.length : 0;
  if (moves) parts.push(`${moves} layer${moves === 1 ? "" : "s"} moved to files`);
  return parts.join(" \u00b7 ");
}

export function storeRows(store) {
  const rows = [row("mode", modeLine(store), "store")];
  if (store.reason && store.reason !== "requested") rows.push(row("why", store.reason, "store"));
  if (store.closed) {
    rows.push(row("holds", store.bytes_while_open ? `closed; held ${formatPlaces(store.bytes_while_open)}` : "closed", "store"));
  } else {
    rows.push(row("holds", formatPlaces(store.bytes), "store"));
  }
  const grows = growingLine(store);
  if (grows) rows.push(row("grows", grows, "store"));
  const rowsLine = batchRowsLine(store);
  if (rowsLine) rows.push(row("batch rows", rowsLine, "store"));
  const layers = isKnown(store.resident_layers) && isKnown(store.layers) ? ` \u00b7 ${store.resident_layers}/${store.layers} layers` : "";
  rows.push(row("on device", `${formatBytes(store.device_bytes)} (peak ${formatBytes(store.peak_device_bytes)})${layers}`, "store"));
  const t = store.transfers || {};
  const count = isKnown(t.count) ? `${t.count} loads, ${formatBytes(t.bytes)}` : UNKNOWN;
  rows.push(row("transfers", `${count} \u00b7 ${formatRate(store.bandwidth_bytes_per_s)}`, "store"));
  rows.push(row("exposed wait", `${formatDuration(store.exposed_wait_per_pass_s)}/step \u00b7 ${formatDuration(store.exposed_wait_s)} total`, "store"));
  if (store.pinned_fallback) rows.push(row("note", `pageable copies: ${store.pinned_fallback_reason || "pinning refused"}`, "store"));
  return rows;
}

// The whole readout as sections of rows: {title, rows: [{label, value, scope, ...}]}. The widget draws the
// timeline after the "memory" section (it needs the run's history, not one payload).
export function buildReadout(payload) {
  const sections = [{ title: "status", rows: [row("run", statusLine(payload), null)] }];
  if (!payload || payload.v !== PAYLOAD_VERSION) return sections;
  // What the run says of itself: the cache stepped aside, ComfyUI's compiler turned off for the run.
  for (const note of Array.isArray(payload.run?.notes) ? payload.run.notes : []) sections[0].rows.push(row("note", note, null));
  const memory = [...deviceNotes(payload.memory), ...memoryBars(payload).flatMap(barRows)];
  sections.push({ title: "memory", rows: memory });
  // Multi-GPU sampling: each device with its own memory and the KV its stores keep (rows under "devices").
  const devices = Array.isArray(payload.devices) ? payload.devices : [];
  if (devices.length > 1) sections.push({ title: "devices", rows: devices.map(deviceRow) });
  for (const s of Array.isArray(payload.stores) ? payload.stores : []) {
    sections.push({ title: `KV ${s.name || "store"}`, rows: storeRows(s) });
  }
  // Prefix reuse across runs: the server words the line (hits, misses, what is kept, or why it is off).
  if (payload.reuse && payload.reuse.line) sections.push({ title: "reuse", rows: [row("reuse", payload.reuse.line, null)] });
  return sections;
}

// --- compact readout (the Settings node): two lines, each the longest variant that fits -----------------------

function firstFitting(variants, fits) {
  return variants.find((v) => fits(v)) ?? variants[variants.length - 1];
}

function statusVariants(payload, own) {
  if (!own) return ["no run of this node yet", "no run yet"];
  const run = payload.run || {};
  if (payload.event === "idle") return ["idle: no run since start-up", "idle"];
  const state = run.active ? "running" : "finished";
  const variants = [statusLine(payload)];
  if (isKnown(run.forwards)) variants.push(`${state} \u00b7 ${run.forwards} fwd`);
  variants.push(state);
  return variants;
}

function memoryVariants(m) {
  const p = m.process || {};
  const d = m.device || {};
  if (d.type === "cuda") return [`VRAM ${formatBytes(p.device_allocated)} of ${formatBytes(d.total)}`, `VRAM ${formatBytes(p.device_allocated)}`];
  if (d.type === "mps") return [`MPS ${formatBytes(p.mps_current_allocated)} of ${formatBytes(d.recommended_max)}`, `MPS ${formatBytes(p.mps_current_allocated)}`];
  return [`RSS ${formatBytes(p.rss)} of ${formatBytes(m.system?.ram_total)}`, `RSS ${formatBytes(p.rss)}`];
}

function kvVariants(payload, own) {
  const stores = own && Array.isArray(payload.stores) ? payload.stores : [];
  if (!own) return ["KV: \u2014"];
  if (!stores.length) return [payload.run?.active ? "KV: no store yet" : "KV: no cache in this run", "KV: none"];
  const released = stores.every((s) => s.closed);
  const bytes = {};
  for (const s of stores) {
    const b = (released ? s.bytes_while_open : s.bytes) || {};
    for (const { place } of KV_PLACES) if (isKnown(b[place])) bytes[place] = (bytes[place] || 0) + b[place];
  }
  const total = Object.values(bytes).reduce((a, v) => a + v, 0);
  const where = KV_PLACES.filter(({ place }) => bytes[place] > 0)
    .map(({ place, short }) => `${short} ${formatBytes(bytes[place])}`).join(" \u00b7 ");
  const waits = stores.map((s) => s.exposed_wait_per_pass_s).filter(isKnown);
  const wait = waits.length ? `wait ${formatDuration(waits.reduce((a, v) => a + v, 0))}/step` : null;
  const lead = released ? `KV released, held ${formatBytes(total)}` : `KV ${formatBytes(total)}`;
  const variants = [];
  if (where && wait) variants.push(`${lead}: ${where} \u00b7 ${wait}`);
  if (where) variants.push(`${lead}: ${where}`);
  if (wait) variants.push(`${lead} \u00b7 ${wait}`);
  variants.push(released ? `KV held ${formatBytes(total)}` : lead);
  return variants;
}

// Two lines for the KV Offload Settings node: the run and its memory, then its KV cache. `fits(text)` says
// whether a line fits the node's width (the widget measures; tests count characters): each line is the
// longest variant that fits, else the shortest one (which then wraps). `own` false: the payload is another
// node's run, so only the memory is shown.
export function buildCompact(payload, { fits = () => true, own = true } = {}) {
  if (!payload || typeof payload !== "object" || payload.v !== PAYLOAD_VERSION) return [statusLine(payload), ""];
  const status = statusVariants(payload, own);
  const memory = memoryVariants(payload.memory || {});
  const first = [];
  for (const st of status) for (const mem of memory) first.push(`${st} \u00b7 ${mem}`);
  first.push(...status);
  first.sort((a, b) => b.length - a.length);
  return [firstFitting(first, fits), firstFitting(kvVariants(payload, own), fits)];
}

// Whether a payload is the run of the Settings node `nodeId` (a subgraph node's run id ends in ":<id>").
export function isRunOf(payload, nodeId) {
  const node = payload?.run?.node;
  if (node === null || node === undefined || nodeId === null || nodeId === undefined) return false;
  const id = String(nodeId);
  return node === id || node.endsWith(`:${id}`);
}

export const SCOPE_NAMES = { process: "this process", device: "whole device", system: "whole system" };

// "RSS [this process]: " -- the text before a row's value; "[whole device] " for a legend row (no label).
export function rowLead(r) {
  const scope = SCOPE_NAMES[r.scope];
  if (!r.label) return scope ? `[${scope}] ` : "";
  return `${r.label}${scope ? ` [${scope}]` : ""}: `;
}

// Plain text of a readout, one line per row: exactly the text content of the widget's rows.
export function readoutText(sections) {
  return sections.flatMap((sec) => sec.rows.map((r) => rowLead(r) + r.value)).join("\n");
}

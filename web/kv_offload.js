// KV Offload memory readout: the DOM widget of KV Memory Monitor, a compact one on KV Offload Settings, and
// a sidebar tab. Event-driven only: one subscription to `kv_offload.memory` (pushed by the server during runs,
// at most 4 a second, plus one final snapshot) and one fetch of `GET /kv_offload/stats` when the page loads.
// No timers, no polling. All text comes from the pure module `kv_offload_format.js`.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { buildCompact, buildReadout, rowLead } from "./kv_offload_format.js";

const EVENT = "kv_offload.memory";
const ROUTE = "/kv_offload/stats";
const MONITOR = "KVMemoryMonitor";
const SETTINGS = "KVOffloadSettings";
const ROW_PX = 17;

let latest = null;
const views = new Set(); // each: { render(payload) }; removed with its node

function publish(payload) {
  if (!payload || typeof payload !== "object") return;
  // A push can overtake the page-load fetch: keep whichever snapshot is newer.
  if (latest && typeof latest.time === "number" && typeof payload.time === "number" && payload.time < latest.time) return;
  latest = payload;
  for (const view of views) view.render(payload);
}

function injectStyle() {
  if (document.getElementById("kv-offload-style")) return;
  const style = document.createElement("style");
  style.id = "kv-offload-style";
  style.textContent = `
.kvo-readout { font: 11px/${ROW_PX - 2}px ui-monospace, monospace; color: var(--fg-color, #ddd);
  overflow: hidden auto; box-sizing: border-box; padding: 2px 4px; pointer-events: auto; }
.kvo-section { margin: 3px 0 1px; font-weight: bold; opacity: .8; }
.kvo-row { position: relative; white-space: nowrap; overflow: hidden; text-overflow: ellipsis; height: ${ROW_PX}px; }
.kvo-track { position: absolute; left: 0; right: 0; bottom: 1px; height: 2px; background: rgba(128,128,128,.25); }
.kvo-bar { height: 100%; background: var(--p-primary-color, #4a9eff); }
.kvo-scope { opacity: .6; }
.kvo-compact .kvo-row { height: ${ROW_PX - 3}px; }
.kvo-sidebar { padding: 8px; }
.kvo-sidebar .kvo-row { white-space: normal; height: auto; min-height: ${ROW_PX}px; padding-bottom: 3px; }`;
  document.head.appendChild(style);
}

function rowElement(r) {
  const el = document.createElement("div");
  el.className = "kvo-row";
  if (r.scope) el.dataset.scope = r.scope;
  // Text content of a row is exactly `rowLead(r) + r.value` (see readoutText), so tests can compare it.
  const lead = rowLead(r);
  const scopeAt = lead.indexOf(" [");
  const label = document.createElement("span");
  label.textContent = scopeAt >= 0 ? lead.slice(0, scopeAt) : lead;
  el.appendChild(label);
  if (scopeAt >= 0) {
    const scope = document.createElement("span");
    scope.className = "kvo-scope";
    scope.textContent = lead.slice(scopeAt);
    el.appendChild(scope);
  }
  const value = document.createElement("span");
  value.className = "kvo-value";
  value.textContent = r.value;
  el.appendChild(value);
  el.title = lead + r.value;
  if (r.bar !== null && r.bar !== undefined) {
    const track = document.createElement("div");
    track.className = "kvo-track";
    const bar = document.createElement("div");
    bar.className = "kvo-bar";
    bar.style.width = `${r.bar}%`;
    track.appendChild(bar);
    el.appendChild(track);
  }
  return el;
}

// Full readout into `root`; returns the number of lines drawn.
function renderFull(root, payload) {
  const sections = buildReadout(payload);
  const children = [];
  for (const sec of sections) {
    const head = document.createElement("div");
    head.className = "kvo-section";
    head.textContent = sec.title;
    children.push(head, ...sec.rows.map(rowElement));
  }
  root.replaceChildren(...children);
  return children.length;
}

function renderCompact(root, payload) {
  const lines = buildCompact(payload);
  root.replaceChildren(...lines.map((value) => rowElement({ label: "", value, scope: null, bar: null })));
  return lines.length;
}

function makeView(node, compact) {
  injectStyle();
  const root = document.createElement("div");
  root.className = compact ? "kvo-readout kvo-compact" : "kvo-readout";
  root.dataset.kvOffload = compact ? "compact" : "readout";
  let lines = compact ? 3 : 12;
  const widget = node.addDOMWidget(compact ? "kv_memory_compact" : "kv_memory", "kv_offload_readout", root, {
    serialize: false,
    hideOnZoom: false,
    getMinHeight: () => lines * ROW_PX + 8,
  });
  widget.serialize = false; // not an input: never written into the workflow or the prompt
  const view = {
    render(payload) {
      const before = lines;
      lines = (compact ? renderCompact : renderFull)(root, payload);
      root.dataset.event = payload?.event ?? "";
      root.dataset.time = String(payload?.time ?? "");
      if (lines > before) growToFit(node);
    },
  };
  views.add(view);
  const onRemoved = node.onRemoved;
  node.onRemoved = function () {
    views.delete(view);
    return onRemoved?.apply(this, arguments);
  };
  view.render(latest);
  return view;
}

function growToFit(node) {
  try {
    const want = node.computeSize();
    if (node.size[1] < want[1]) node.setSize([Math.max(node.size[0], want[0]), want[1]]);
    node.setDirtyCanvas?.(true, true);
  } catch (err) {
    console.debug("kv_offload: could not resize the readout node", err);
  }
}

function registerSidebar() {
  const manager = app.extensionManager;
  if (!manager?.registerSidebarTab) return;
  let view = null; // the open tab's view; the tab is re-rendered each time it is opened
  const close = () => {
    if (view) views.delete(view);
    view = null;
  };
  manager.registerSidebarTab({
    id: "kv_offload.memory",
    icon: "pi pi-server",
    title: "KV Memory",
    tooltip: "KV Offload: VRAM, RAM and KV cache readout",
    type: "custom",
    render(container) {
      close();
      injectStyle();
      const root = document.createElement("div");
      root.className = "kvo-readout kvo-sidebar";
      root.dataset.kvOffload = "sidebar";
      container.replaceChildren(root);
      view = { render: (payload) => renderFull(root, payload) };
      views.add(view);
      view.render(latest);
    },
    destroy: close,
  });
}

async function fetchSnapshot() {
  try {
    const res = await api.fetchApi(ROUTE, { cache: "no-store" });
    if (res.ok) publish(await res.json());
  } catch (err) {
    console.warn("kv_offload: could not read", ROUTE, err);
  }
}

app.registerExtension({
  name: "kv_offload.memory",
  async setup() {
    api.addEventListener(EVENT, (event) => publish(event.detail));
    registerSidebar();
    await fetchSnapshot();
  },
  nodeCreated(node) {
    if (node.comfyClass !== MONITOR && node.comfyClass !== SETTINGS) return;
    try {
      makeView(node, node.comfyClass === SETTINGS);
    } catch (err) {
      // A front-end API change must cost the readout, never the node (the Settings node still works).
      console.error("kv_offload: could not add the memory readout to", node.comfyClass, err);
    }
  },
});

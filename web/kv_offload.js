// KV Offload memory readout: the DOM widget of KV Memory Monitor, a two-line one on KV Offload Settings, and a
// sidebar tab. Event-driven only: one subscription to `kv_offload.memory` (pushed by the server during runs,
// at most 4 a second, plus one final snapshot) and one fetch of `GET /kv_offload/stats` when the page loads.
// No timers, no polling. Every text, bar width and timeline path comes from the pure modules
// (kv_offload_format.js, kv_offload_bars.js); this file only turns them into elements.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { buildCompact, buildReadout, formatBytes, isRunOf, rowLead, SCOPE_NAMES } from "./kv_offload_format.js";
import { isCapturing, recordPoint, timelineGeometry, timelineLegend } from "./kv_offload_bars.js";
import { STYLE } from "./kv_offload_style.js";

const EVENT = "kv_offload.memory";
const ROUTE = "/kv_offload/stats";
const MONITOR = "KVMemoryMonitor";
const SETTINGS = "KVOffloadSettings";
const MONITOR_MIN_WIDTH = 360; // px: the bars' legends fit in two lines, the timeline stays readable
const COMPACT_LINE_PX = 16;
const TIMELINE = { width: 300, height: 44 };
const SVG = "http://www.w3.org/2000/svg";

let latest = null;
let history = recordPoint(null, null); // the current (or last) run's points, shared by every view
const views = new Set(); // each: { render(payload) }; removed with its node

function publish(payload) {
  if (!payload || typeof payload !== "object") return;
  // A push can overtake the page-load fetch: keep whichever snapshot is newer.
  if (latest && typeof latest.time === "number" && typeof payload.time === "number" && payload.time < latest.time) return;
  latest = payload;
  history = recordPoint(history, payload);
  for (const view of views) view.render(payload);
}

function injectStyle() {
  if (document.getElementById("kv-offload-style")) return;
  const style = document.createElement("style");
  style.id = "kv-offload-style";
  style.textContent = STYLE;
  document.head.appendChild(style);
}

function el(tag, className, text) {
  const e = document.createElement(tag);
  if (className) e.className = className;
  if (text !== undefined) e.textContent = text;
  return e;
}

function swatch(key) {
  return el("i", `kvo-sw kvo-c-${key}`);
}

// One row; its text content is exactly `rowLead(r) + r.value` (see readoutText), so tests can compare it.
function rowElement(r) {
  const row = el("div", "kvo-row");
  row.dataset.row = r.bar ? "bar" : r.swatches ? "legend" : "text";
  const lead = rowLead(r);
  const scopeAt = lead.indexOf("[");
  if (r.label) row.appendChild(el("span", "kvo-label", scopeAt > 0 ? lead.slice(0, scopeAt) : lead));
  if (scopeAt >= 0) {
    const end = lead.indexOf("]") + 1;
    row.appendChild(el("span", "kvo-scope", lead.slice(r.label ? scopeAt : 0, end)));
    row.appendChild(document.createTextNode(lead.slice(end)));
  }
  if (r.swatches) {
    r.swatches.forEach((item, i) => {
      if (i) row.appendChild(document.createTextNode(" \u00b7 "));
      const span = el("span", "kvo-item");
      span.append(swatch(item.key), item.text);
      row.appendChild(span);
    });
  } else {
    row.appendChild(el("span", "kvo-value", r.value));
  }
  row.title = lead + r.value;
  if (r.segments) row.appendChild(stackElement(r));
  return row;
}

function stackElement(r) {
  const track = el("div", r.released ? "kvo-stack kvo-released" : "kvo-stack");
  track.dataset.bar = r.bar;
  for (const s of r.segments) {
    const seg = el("div", `kvo-seg kvo-c-${s.key}`);
    seg.style.left = `${s.left}%`;
    seg.style.width = `${s.width}%`;
    seg.dataset.key = s.key;
    seg.title = `${s.label} [${SCOPE_NAMES[s.scope] ?? s.scope}]: ${formatBytes(s.bytes)}`;
    track.appendChild(seg);
  }
  track.dataset.widths = r.segments.map((s) => `${s.key}:${s.width}`).join(" ");
  return track;
}

function svgElement(tag, attrs) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, String(v));
  return e;
}

function timelineElements() {
  const g = timelineGeometry(history, TIMELINE.width, TIMELINE.height);
  const svg = svgElement("svg", { class: "kvo-timeline", viewBox: `0 0 ${g.width} ${g.height}`, preserveAspectRatio: "none" });
  svg.dataset.points = String(history.points.length);
  for (const m of g.marks) {
    const w = Math.max(m.what === "release" ? 0 : m.width, 1.5); // a line at least, kept inside the box
    svg.appendChild(svgElement("rect", { class: `kvo-mark kvo-m-${m.what}`, x: Math.min(m.x, g.width - w), y: 0, width: w, height: g.height }));
  }
  svg.appendChild(svgElement("line", { class: "kvo-tl-lane", x1: 0, x2: g.width, y1: g.lane, y2: g.lane }));
  if (g.kvArea) svg.appendChild(svgElement("path", { class: "kvo-tl-kv", d: g.kvArea }));
  if (g.mem) svg.appendChild(svgElement("path", { class: "kvo-tl-mem", d: g.mem }));
  svg.dataset.d = `${g.mem}|${g.kvArea}`;
  const items = timelineLegend(history);
  const legend = rowElement({ label: "", value: items.map((i) => i.text).join(" \u00b7 "), scope: "process", swatches: items });
  legend.dataset.row = "timeline";
  return [el("div", "kvo-section", "timeline"), svg, legend];
}

// Full readout into `content`: the sections, with the timeline after the memory bars.
function renderFull(content, payload) {
  const children = [];
  for (const sec of buildReadout(payload)) {
    if (sec.title !== "status") children.push(el("div", "kvo-section", sec.title));
    children.push(...sec.rows.map(rowElement));
    if (sec.title === "memory") children.push(...timelineElements());
  }
  content.replaceChildren(...children);
}

let measureCtx = null;
function textFits(root) {
  const style = getComputedStyle(root);
  const width = root.clientWidth - parseFloat(style.paddingLeft || "0") - parseFloat(style.paddingRight || "0");
  measureCtx ??= document.createElement("canvas").getContext("2d");
  measureCtx.font = `${style.fontWeight} ${style.fontSize} ${style.fontFamily}`;
  return (text) => width <= 0 || measureCtx.measureText(text).width <= width - 2;
}

// The Settings node's two lines: its own run's latest payload (the memory alone until it has run).
function compactRenderer(node, root, content) {
  let own = null;
  return (payload) => {
    if (isRunOf(payload, node.id)) own = payload;
    const lines = buildCompact(own ?? payload, { fits: textFits(root), own: own !== null });
    content.replaceChildren(...lines.map((value) => rowElement({ label: "", value, scope: null })));
    root.dataset.own = String(own !== null);
  };
}

// Content height follows the width (rows wrap): keep the node tall enough; the compact lines are picked for
// the width, so a new width picks them again. No timer: the browser reports sizes.
function watchSize(node, widget, view, compact) {
  const { root, content, size } = view;
  let width = null;
  const observer = new ResizeObserver(() => {
    if (compact && latest && root.clientWidth !== width) {
      width = root.clientWidth;
      view.render(latest);
    }
    const h = content.offsetHeight;
    if (h > 0) size.content = h;
    if (h > 0 && widget.computedHeight > 0 && root.offsetHeight > 0) {
      const style = getComputedStyle(root);
      const padding = (parseFloat(style.paddingTop) || 0) + (parseFloat(style.paddingBottom) || 0);
      size.chrome = Math.max(size.chrome, Math.ceil(widget.computedHeight - root.clientHeight + padding));
    }
    growToFit(node); // only ever grows: a size the user chose is kept when it is big enough
  });
  observer.observe(content);
  if (compact) observer.observe(root);
  return observer;
}

function makeView(node, compact) {
  injectStyle();
  const root = el("div", compact ? "kvo-readout kvo-compact" : "kvo-readout");
  root.dataset.kvOffload = compact ? "compact" : "readout";
  const content = el("div", "kvo-content");
  root.appendChild(content);
  // content: its height until the browser has laid it out; chrome: the widget's height beyond its content
  const size = { content: compact ? 2 * COMPACT_LINE_PX : 300, chrome: 26 };
  const widget = node.addDOMWidget(compact ? "kv_memory_compact" : "kv_memory", "kv_offload_readout", root, {
    serialize: false,
    hideOnZoom: false,
    getMinHeight: () => size.content + size.chrome,
  });
  widget.serialize = false; // not an input: never written into the workflow or the prompt
  const draw = compact ? compactRenderer(node, root, content) : (payload) => renderFull(content, payload);
  const view = {
    root, content, size,
    render(payload) {
      draw(payload);
      root.dataset.event = payload?.event ?? "";
      root.dataset.time = String(payload?.time ?? "");
      root.dataset.capturing = String(isCapturing(payload));
    },
  };
  views.add(view);
  const observer = watchSize(node, widget, view, compact);
  const onRemoved = node.onRemoved;
  node.onRemoved = function () {
    views.delete(view);
    observer.disconnect();
    return onRemoved?.apply(this, arguments);
  };
  if (!compact) keepMinimumWidth(node);
  view.render(latest);
  return view;
}

function keepMinimumWidth(node) {
  const computeSize = node.computeSize;
  node.computeSize = function () {
    const size = computeSize.apply(this, arguments);
    size[0] = Math.max(size[0], MONITOR_MIN_WIDTH);
    return size;
  };
  if (node.size[0] < MONITOR_MIN_WIDTH) node.setSize([MONITOR_MIN_WIDTH, node.size[1]]);
}

function growToFit(node) {
  try {
    const want = node.computeSize();
    if (node.size[1] >= want[1] && node.size[0] >= want[0]) return;
    node.setSize([Math.max(node.size[0], want[0]), Math.max(node.size[1], want[1])]);
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
      const tab = el("div", "comfy-vue-side-bar-container kvo-tab");
      const header = el("div", "comfy-vue-side-bar-header kvo-tab-header");
      header.appendChild(el("span", "kvo-tab-title", "KV Memory"));
      const root = el("div", "kvo-readout kvo-sidebar");
      root.dataset.kvOffload = "sidebar";
      const content = el("div", "kvo-content");
      root.appendChild(content);
      tab.append(header, root);
      container.replaceChildren(tab);
      view = { render: (payload) => renderFull(content, payload) };
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

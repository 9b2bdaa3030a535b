// The memory readout's stylesheet (one <style> element, added once). Colours of the stacked segments: the KV
// cache by where it lies (device / pinned / pageable / file), then this process, its allocator's cache, other
// processes; free memory is the empty track. The theme's own variables are used where the front end has them.
export const STYLE = `
.kvo-readout { font: 12px/1.35 var(--p-font-family, system-ui, sans-serif); font-variant-numeric: tabular-nums;
  color: var(--fg-color, #ddd); overflow: hidden auto; box-sizing: border-box; padding: 2px 6px 4px;
  pointer-events: auto; }
.kvo-content { display: flow-root; }
.kvo-section { margin: 5px 0 1px; font-size: 10px; font-weight: 600; letter-spacing: .06em; text-transform: uppercase;
  opacity: .6; }
.kvo-row { position: relative; white-space: normal; overflow-wrap: anywhere; padding: 1px 0; }
.kvo-label { font-weight: 600; }
.kvo-scope { opacity: .55; font-size: 11px; }
.kvo-item { white-space: nowrap; }
.kvo-row[data-row="legend"], .kvo-row[data-row="timeline"] { font-size: 11px; opacity: .9; }
.kvo-sw { display: inline-block; width: 8px; height: 8px; border-radius: 2px; margin-right: 3px; vertical-align: baseline; }
.kvo-stack { position: relative; height: 8px; margin: 2px 0 1px; border-radius: 3px; overflow: hidden;
  background: rgba(128,128,128,.22); }
.kvo-seg { position: absolute; top: 0; bottom: 0; }
.kvo-released .kvo-seg { opacity: .35; }
.kvo-c-kv-device { background: #f59e0b; }
.kvo-c-kv-pinned { background: #ef4444; }
.kvo-c-kv-pageable { background: #d946ef; }
.kvo-c-kv-file { background: #14b8a6; }
.kvo-c-proc { background: #3b82f6; }
.kvo-c-cache { background: #93c5fd; }
.kvo-c-others { background: #9ca3af; }
.kvo-c-swap { background: #a78bfa; }
.kvo-c-free { background: transparent; box-shadow: inset 0 0 0 1px rgba(128,128,128,.6); }
.kvo-c-mem { background: #3b82f6; }
.kvo-c-kv { background: #f59e0b; }
.kvo-c-capture { background: rgba(245,158,11,.35); }
.kvo-c-release { background: #ef4444; }
.kvo-c-none { display: none; }
.kvo-timeline { display: block; width: 100%; height: 44px; margin: 2px 0; background: rgba(128,128,128,.12);
  border-radius: 3px; }
.kvo-tl-mem { fill: none; stroke: #3b82f6; stroke-width: 1.5px; vector-effect: non-scaling-stroke; }
.kvo-tl-kv { fill: rgba(245,158,11,.45); stroke: #f59e0b; stroke-width: 1px; vector-effect: non-scaling-stroke; }
.kvo-tl-lane { stroke: rgba(128,128,128,.35); stroke-width: 1px; vector-effect: non-scaling-stroke; }
.kvo-m-capture { fill: rgba(245,158,11,.22); }
.kvo-m-release { fill: #ef4444; }
.kvo-compact .kvo-row { padding: 0; line-height: 16px; }
.kvo-tab { display: flex; flex-direction: column; height: 100%; }
.kvo-tab-header { min-height: 4rem; display: flex; align-items: center; padding: 0 .75rem; box-sizing: border-box;
  border-bottom: 1px solid var(--p-panel-border-color, var(--border-color, rgba(128,128,128,.3))); }
.kvo-tab-title { font-weight: bold; }
.kvo-sidebar { padding: 8px 12px; flex: 1 1 auto; min-height: 0; }`;

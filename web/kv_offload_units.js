// Units of the KV Offload memory readout: bytes, durations, rates, percentages and bar widths. Pure: no DOM,
// no ComfyUI, so `node --test` imports it. Unknown values (null, NaN, a string) are shown as an em dash,
// never as 0.

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

export function sub(a, b) {
  return isKnown(a) && isKnown(b) ? a - b : null;
}

// Sum of the known numbers; null when none is known.
export function sumKnown(values) {
  const known = values.filter(isKnown);
  return known.length ? known.reduce((a, b) => a + b, 0) : null;
}

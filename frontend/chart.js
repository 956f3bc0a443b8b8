// A small hand-written SVG line chart: time on x, one value on y, a few series.

const NS = "http://www.w3.org/2000/svg";

function el(name, attrs = {}, text) {
  const node = document.createElementNS(NS, name);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = text;
  return node;
}

function niceMax(value) {
  if (!(value > 0)) return 1;
  const power = 10 ** Math.floor(Math.log10(value));
  for (const step of [1, 2, 2.5, 5, 10]) {
    if (step * power >= value) return step * power;
  }
  return 10 * power;
}

function clock(ms) {
  const d = new Date(ms);
  return d.toTimeString().slice(0, 8);
}

/**
 * Draw `series` ([{label, color, points: [[timeMs, value|null], ...]}]) into `svg`.
 * Null values break the line (unknown), they are not drawn as zero.
 */
export function lineChart(svg, series, { width = 720, height = 220, format = String,
  windowMs = 15 * 60 * 1000, now = Date.now() } = {}) {
  const pad = { left: 64, right: 32, top: 12, bottom: 28 };
  const w = width - pad.left - pad.right;
  const h = height - pad.top - pad.bottom;
  svg.replaceChildren();
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.setAttribute("role", "img");

  const t0 = now - windowMs;
  const values = series.flatMap((s) => s.points.filter(([t, v]) => t >= t0 && v != null)
    .map(([, v]) => v));
  const max = niceMax(Math.max(0, ...values));
  const x = (t) => pad.left + ((t - t0) / windowMs) * w;
  const y = (v) => pad.top + h - (v / max) * h;

  const grid = el("g", { class: "grid" });
  for (let i = 0; i <= 4; i++) {
    const v = (max * i) / 4;
    grid.append(el("line", { x1: pad.left, x2: pad.left + w, y1: y(v), y2: y(v) }));
    grid.append(el("text", { x: pad.left - 6, y: y(v) + 4, "text-anchor": "end" }, format(v)));
  }
  for (let i = 0; i <= 3; i++) {
    const t = t0 + (windowMs * i) / 3;
    grid.append(el("text", { x: x(t), y: height - 8, "text-anchor": "middle" }, clock(t)));
  }
  svg.append(grid);

  for (const s of series) {
    let d = "";
    let pen = false;
    let last = null;
    for (const [t, v] of s.points) {
      if (t < t0) continue;
      if (v == null) { pen = false; continue; }
      d += `${pen ? "L" : "M"}${x(t).toFixed(1)},${y(v).toFixed(1)}`;
      pen = true;
      last = [t, v];
    }
    svg.append(el("path", { d, fill: "none", stroke: s.color, "stroke-width": 2,
      class: "series", "data-series": s.label }));
    if (last) {
      svg.append(el("circle", { cx: x(last[0]), cy: y(last[1]), r: 3, fill: s.color }));
    }
  }
  if (!values.length) {
    svg.append(el("text", { x: pad.left + w / 2, y: pad.top + h / 2, "text-anchor": "middle",
      class: "empty" }, "no samples yet"));
  }
}

// forkpoint's local page: reads the JSON API of `forkpoint ui`, writes nothing.
// Every text from the repository goes through textContent, never innerHTML.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const ROW = 26, LANE = 18, PAGE = 300;
const COLORS = ["#3b6fd8", "#d8703b", "#2e9e5b", "#a23bd8", "#c9a400", "#d83b6f", "#3bb8d8", "#7a7a7a"];
const KIND_COLORS = {emergency: "#b3261e", restart: "#c9a400", pruned: "#ffffff", final: "#111111"};
const state = {rows: [], total: 0, lanes: 0, selected: null, branchColor: {}};

async function api(path) {
  const r = await fetch(path);
  const body = await r.json();
  if (!r.ok) throw new Error(body.error || r.statusText);
  return body;
}

function el(tag, attrs = {}, text = null, ns = null) {
  const e = ns ? document.createElementNS(ns, tag) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, String(v));
  if (text !== null) e.textContent = String(text);
  return e;
}

function colorOf(branch) {
  if (!(branch in state.branchColor)) {
    state.branchColor[branch] = COLORS[Object.keys(state.branchColor).length % COLORS.length];
  }
  return state.branchColor[branch];
}

function swatch(color) {
  const s = el("svg", {width: 12, height: 12, class: "swatch"}, null, SVG);
  s.appendChild(el("rect", {x: 0.5, y: 0.5, width: 11, height: 11, fill: color, stroke: "#1d2330"}, null, SVG));
  return s;
}

// ----------------------------------------------------------------- lineage
async function loadVersions(reset) {
  if (reset) state.rows = [];
  const page = await api(`/api/versions?offset=${state.rows.length}&limit=${PAGE}`);
  state.rows = state.rows.concat(page.versions);
  state.total = page.total;
  state.lanes = Math.max(state.lanes, page.lanes);
  drawDag();
  document.getElementById("more").hidden = state.rows.length >= state.total;
  document.getElementById("count").textContent = `${state.rows.length} of ${state.total} versions shown`;
}

function label(row) {
  const names = row.heads.map(h => h).concat(row.tags.map(t => `tag:${t}`));
  const metric = Object.entries(row.metrics).slice(0, 2).map(([k, v]) => `${k}=${typeof v === "number" ? v.toPrecision(4) : v}`);
  return [row.id.slice(0, 12), names.length ? `(${names.join(", ")})` : "", `step ${row.step}`, ...metric,
          row.kinds.join(" "), row.message].filter(Boolean).join("  ");
}

function drawDag() {
  const svg = document.getElementById("dag");
  svg.replaceChildren();
  const index = new Map(state.rows.map((r, i) => [r.id, i]));
  const width = (state.lanes + 1) * LANE + 640, height = state.rows.length * ROW + ROW;
  svg.setAttribute("width", width);
  svg.setAttribute("height", height);
  const x = lane => LANE / 2 + lane * LANE + 4, y = i => ROW / 2 + i * ROW + 4;
  const edges = el("g", {}, null, SVG), nodes = el("g", {}, null, SVG);
  svg.append(edges, nodes);
  state.rows.forEach((row, i) => {
    if (row.parent === null) return;
    const j = index.has(row.parent) ? index.get(row.parent) : state.rows.length;  // parent not loaded yet
    const p = index.has(row.parent) ? state.rows[j].lane : row.lane;
    const path = `M ${x(row.lane)} ${y(i)} L ${x(row.lane)} ${y(j) - ROW / 2} L ${x(p)} ${y(j)}`;
    edges.appendChild(el("path", {d: path, class: "edge", fill: "none", stroke: colorOf(row.branch),
                                  "stroke-width": 2, "data-child": row.id, "data-parent": row.parent}, null, SVG));
  });
  state.rows.forEach((row, i) => {
    const kind = row.kinds.find(k => k in KIND_COLORS);
    const circle = el("circle", {cx: x(row.lane), cy: y(i), r: 6, class: "node" + (row.id === state.selected ? " selected" : ""),
                                 fill: kind ? KIND_COLORS[kind] : colorOf(row.branch), "data-id": row.id,
                                 "data-branch": row.branch}, null, SVG);
    circle.appendChild(el("title", {}, `${row.branch} step ${row.step}`, SVG));
    circle.addEventListener("click", () => selectVersion(row.id));
    const text = el("text", {x: x(state.lanes) + 8, y: y(i) + 4, "data-id": row.id}, label(row), SVG);
    text.addEventListener("click", () => selectVersion(row.id));
    nodes.append(circle, text);
  });
  const legend = document.getElementById("legend-lineage");
  legend.replaceChildren();
  for (const [kind, color] of Object.entries(KIND_COLORS)) {
    const s = el("span");
    s.append(swatch(color), document.createTextNode(kind));
    legend.appendChild(s);
  }
}

function fmtBytes(n) {
  if (n === null || n === undefined) return "-";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return i === 0 ? `${n} B` : `${n.toFixed(1)} ${units[i]}`;
}

function table(rows) {
  const t = el("table");
  for (const [k, v] of rows) {
    const tr = el("tr");
    tr.append(el("th", {}, k), el("td", {}, v));
    t.appendChild(tr);
  }
  return t;
}

async function selectVersion(id) {
  state.selected = id;
  drawDag();
  const box = document.getElementById("detail");
  box.replaceChildren(el("p", {class: "hint"}, "loading…"));
  let v;
  try {
    v = await api(`/api/version/${encodeURIComponent(id)}`);
  } catch (e) {
    box.replaceChildren(el("p", {class: "error"}, e.message));
    return;
  }
  const when = new Date(v.time * 1000).toISOString().replace("T", " ").slice(0, 19);
  box.replaceChildren(el("h2", {}, v.id));
  box.appendChild(table([["branch", v.branch], ["step", v.step], ["time", when], ["message", v.message],
                         ["parents", v.parents.join(", ")], ["marks", v.kinds.join(", ")],
                         ["bytes", `logical ${fmtBytes(v.logical_bytes)}, newly stored ${fmtBytes(v.stored_bytes)}`],
                         ["tiers", v.tiers.map(t => `${t.url}${t.holds ? "" : " (not held now)"}`).join("; ")]]));
  const metrics = el("table", {id: "detail-metrics"});
  metrics.appendChild(el("caption", {}, "metrics"));
  for (const [k, val] of Object.entries(v.metrics)) {
    const tr = el("tr", {class: "metric", "data-name": k});
    tr.append(el("th", {}, k), el("td", {class: "num"}, val));
    metrics.appendChild(tr);
  }
  box.appendChild(metrics);
  box.appendChild(el("h3", {}, "meta"));
  box.appendChild(el("pre", {}, JSON.stringify(v.meta, null, 1)));
  box.appendChild(el("h3", {}, "environment"));
  box.appendChild(el("pre", {}, JSON.stringify(v.env, null, 1)));
  const leaves = el("table", {id: "detail-leaves"});
  leaves.appendChild(el("caption", {}, `${v.leaves.length} leaves`));
  for (const leaf of v.leaves.slice(0, 200)) {
    const tr = el("tr");
    tr.append(el("td", {}, leaf.path), el("td", {}, leaf.dtype), el("td", {}, leaf.shape.join("x")),
              el("td", {class: "num"}, fmtBytes(leaf.nbytes)), el("td", {}, leaf.codecs.join(",")));
    leaves.appendChild(tr);
  }
  box.appendChild(leaves);
}

// ----------------------------------------------------------------- metrics
async function loadMetricNames() {
  const {metrics} = await api("/api/metrics");
  const select = document.getElementById("metric-select");
  select.replaceChildren(...metrics.map(m => el("option", {value: m}, m)));
  const first = metrics.find(m => m === "loss") || metrics.find(m => m.includes("loss")) || metrics[0];
  if (first !== undefined) {
    select.value = first;
    drawChart(first);
  }
  else document.getElementById("chart-legend").textContent = "No version records a metric.";
}

async function drawChart(metric) {
  const data = await api(`/api/series?metric=${encodeURIComponent(metric)}`);
  const svg = document.getElementById("chart");
  svg.replaceChildren();
  const W = 900, H = 420, L = 60, R = 20, T = 20, B = 40;
  const logY = document.getElementById("log-y").checked;
  const usable = p => typeof p[1] === "number" && (!logY || p[1] > 0);
  const all = Object.values(data.branches).flatMap(b => b.points).filter(usable);
  if (!all.length) return;
  const f = logY ? Math.log10 : (v => v);
  const xs = all.map(p => p[0]), ys = all.map(p => f(p[1]));
  const [x0, x1] = [Math.min(...xs), Math.max(...xs)], [y0, y1] = [Math.min(...ys), Math.max(...ys)];
  const sx = s => L + (x1 === x0 ? 0.5 : (s - x0) / (x1 - x0)) * (W - L - R);
  const sy = v => H - B - (y1 === y0 ? 0.5 : (f(v) - y0) / (y1 - y0)) * (H - T - B);
  const top = logY ? 10 ** y1 : y1, bottom = logY ? 10 ** y0 : y0;
  svg.append(el("line", {x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#889"}, null, SVG),
             el("line", {x1: L, y1: T, x2: L, y2: H - B, stroke: "#889"}, null, SVG),
             el("text", {x: W / 2, y: H - 8, "text-anchor": "middle"}, "step", SVG),
             el("text", {x: L - 6, y: sy(top) + 4, "text-anchor": "end"}, top.toPrecision(4), SVG),
             el("text", {x: L - 6, y: sy(bottom) + 4, "text-anchor": "end"}, bottom.toPrecision(4), SVG),
             el("text", {x: sx(x0), y: H - B + 16, "text-anchor": "middle"}, x0, SVG),
             el("text", {x: sx(x1), y: H - B + 16, "text-anchor": "middle"}, x1, SVG));
  const legend = document.getElementById("chart-legend");
  legend.replaceChildren();
  for (const [branch, series] of Object.entries(data.branches)) {
    const pts = series.points.filter(usable);
    if (!pts.length) continue;
    const color = colorOf(branch);
    svg.appendChild(el("polyline", {points: pts.map(p => `${sx(p[0])},${sy(p[1])}`).join(" "), fill: "none",
                                    stroke: color, "stroke-width": 2, class: "series", "data-branch": branch,
                                    "data-points": pts.length}, null, SVG));
    if (series.fork) {
      const at = pts.find(p => p[0] === series.fork.step) || pts[0];
      const mark = el("circle", {cx: sx(at[0]), cy: sy(at[1]), r: 5, fill: "#fff", stroke: color, "stroke-width": 2,
                                 class: "fork-mark", "data-branch": branch}, null, SVG);
      mark.appendChild(el("title", {}, `${branch} forked from ${series.fork.from} at step ${series.fork.step}`, SVG));
      svg.appendChild(mark);
    }
    const s = el("span");
    s.append(swatch(color), document.createTextNode(series.fork ? `${branch} (forked from ${series.fork.from} at step ${series.fork.step})` : branch));
    legend.appendChild(s);
  }
}

// ----------------------------------------------------------------- diff
async function runDiff(event) {
  event.preventDefault();
  const a = document.getElementById("diff-a").value, b = document.getElementById("diff-b").value;
  const atol = document.getElementById("diff-atol").value || "0";
  const body = document.querySelector("#diff-table tbody"), error = document.getElementById("diff-error");
  body.replaceChildren();
  error.textContent = "";
  document.getElementById("divergence").textContent = "";
  let d;
  try {
    d = await api(`/api/diff?a=${encodeURIComponent(a)}&b=${encodeURIComponent(b)}`);
  } catch (e) {
    error.textContent = e.message;
    return;
  }
  for (const leaf of d.leaves) {
    const tr = el("tr", {"data-path": leaf.path, "data-status": leaf.status});
    const num = v => (v === null || v === undefined) ? "" : (typeof v === "number" ? v.toPrecision(4) : v);
    tr.append(el("td", {}, leaf.path), el("td", {class: `status-${leaf.status}`}, leaf.status),
              el("td", {class: "num"}, num(leaf.max_abs)), el("td", {class: "num"}, num(leaf.rel_l2)),
              el("td", {}, leaf.detail));
    body.appendChild(tr);
  }
  try {
    const div = await api(`/api/divergence?a=${encodeURIComponent(a)}&b=${encodeURIComponent(b)}&atol=${encodeURIComponent(atol)}`);
    document.getElementById("divergence").textContent = div.divergence === null
      ? `branches ${a} and ${b} never differ by more than ${atol}`
      : `branches ${a} and ${b} first differ at step ${div.divergence.step} (${div.divergence.paths.length} leaves, max |diff| ${div.divergence.max_abs})`;
  } catch (e) {
    document.getElementById("divergence").textContent = "first divergence: compare two branch names to see it";
  }
}

// ----------------------------------------------------------------- usage
async function loadUsage() {
  const du = await api("/api/du");
  const body = document.querySelector("#usage-table tbody");
  body.replaceChildren();
  for (const [name, b] of Object.entries(du.branches)) {
    const tr = el("tr", {"data-branch": name});
    tr.append(el("td", {}, name), el("td", {class: "num"}, b.versions), el("td", {class: "num"}, fmtBytes(b.logical_bytes)),
              el("td", {class: "num"}, fmtBytes(b.stored_bytes)), el("td", {class: "num"}, fmtBytes(b.held_bytes)),
              el("td", {class: "num"}, fmtBytes(b.exclusive_bytes)));
    body.appendChild(tr);
  }
  document.getElementById("usage-total").textContent = `objects on storage: ${fmtBytes(du.objects_bytes)}`;
}

// ----------------------------------------------------------------- views
const loaded = {};
function show(view) {
  for (const tab of document.querySelectorAll(".tab")) tab.classList.toggle("active", tab.dataset.view === view);
  for (const section of document.querySelectorAll(".view")) section.hidden = section.id !== `view-${view}`;
  if (!loaded[view]) {
    loaded[view] = true;
    ({metrics: loadMetricNames, usage: loadUsage})[view]?.();
  }
  document.body.dataset.view = view;
}

async function main() {
  const repo = await api("/api/repo");
  document.getElementById("repo-url").textContent = repo.url;
  Object.keys(repo.branches).sort().forEach(colorOf);
  for (const tab of document.querySelectorAll(".tab")) tab.addEventListener("click", () => show(tab.dataset.view));
  document.getElementById("more").addEventListener("click", () => loadVersions(false));
  const select = document.getElementById("metric-select");
  select.addEventListener("change", () => drawChart(select.value));
  document.getElementById("log-y").addEventListener("change", () => drawChart(select.value));
  document.getElementById("diff-form").addEventListener("submit", runDiff);
  await loadVersions(true);
  document.body.dataset.ready = "1";
}

main().catch(e => { document.body.dataset.error = e.message; });

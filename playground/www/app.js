// The playground page: reads the form, runs each chosen policy's replay in the WebAssembly module
// (kvsteer_playground, built with wasm-bindgen), and draws the table and the charts as inline SVG.
// Everything is served from the built folder: no network beyond the page's own origin.

import init, { run_replay, policies } from "./pkg/kvsteer_playground.js";

const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
  "#7f7f7f", "#bcbd22", "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd"];
const TRACES = { coding: "data/weka_slice.jsonl", mooncake: "data/mooncake_slice.jsonl" };
const DEFAULT_POLICIES = ["round_robin", "session_hash", "kv_load", "kv_time"];

const $ = (id) => document.getElementById(id);
const num = (id) => Number($(id).value);

function workloadKind() {
  return document.querySelector("input[name=workload]:checked").value;
}

/// The replay requests the form describes, one per checked policy (the same JSON the native
/// `playground-replay` takes).
export function requestsFromForm() {
  const kind = workloadKind();
  let workload;
  if (kind === "rl") {
    workload = { kind: "rl", steps: num("rl-steps"), turns: num("rl-turns"),
      concurrency: num("rl-concurrency"), scale: num("rl-scale") };
  } else if (kind === "coding") {
    workload = { kind: "coding", sessions: num("coding-sessions"),
      concurrency: num("coding-concurrency"), max_prompt_tokens: num("coding-max-prompt") };
  } else {
    workload = { kind: "mooncake", requests: num("mooncake-requests"), speed: num("mooncake-speed") };
  }
  const chosen = [...document.querySelectorAll("#policies input:checked")].map((e) => e.value);
  return chosen.map((policy) => ({
    workload,
    replicas: num("replicas"),
    kv_blocks_16: num("kv-blocks"),
    seed: num("seed"),
    routing: {
      policy,
      kv_load: {
        prefill_scale: num("k-prefill-scale"), overlap_credit: num("k-overlap"),
        active_request_weight: num("k-weight"), temperature: num("k-temperature"),
      },
    },
  }));
}

const traceCache = {};
async function traceFor(kind) {
  if (!TRACES[kind]) return "";
  if (!(kind in traceCache)) {
    const r = await fetch(TRACES[kind]);
    if (!r.ok) throw new Error(`${TRACES[kind]}: HTTP ${r.status}`);
    traceCache[kind] = await r.text();
  }
  return traceCache[kind];
}

const fmt = {
  ms: (v) => v.toFixed(1),
  s: (v) => v.toFixed(2),
  rate: (v) => v.toFixed(0),
  pct: (v) => (100 * v).toFixed(1) + "%",
  cv: (v) => (v === null || v === undefined ? "-" : v.toFixed(3)),
};

/// One table row. Each cell carries the exact number in data-value so a test can read both.
function summaryRow(r) {
  const cells = [
    ["policy", r.policy, r.policy],
    ["requests", String(r.requests), r.requests],
    ["ttft_p50", fmt.ms(r.ttft_ms.p50), r.ttft_ms.p50],
    ["ttft_p99", fmt.ms(r.ttft_ms.p99), r.ttft_ms.p99],
    ["tpot_p50", fmt.ms(r.tpot_ms.p50), r.tpot_ms.p50],
    ["session_e2e_p99", fmt.s(r.session_e2e_s.p99), r.session_e2e_s.p99],
    ["output_tokens_per_s", fmt.rate(r.output_tokens_per_s), r.output_tokens_per_s],
    ["hit_rate", fmt.pct(r.hit_rate), r.hit_rate],
    ["decode_cv", fmt.cv(r.decode_cv), r.decode_cv],
    ["requests_per_replica", r.requests_per_replica.join(" / "), r.requests_per_replica.join(",")],
  ];
  const tr = document.createElement("tr");
  tr.dataset.policy = r.policy;
  for (const [key, text, value] of cells) {
    const td = document.createElement("td");
    td.dataset.key = key;
    td.dataset.value = value === null ? "" : String(value);
    td.textContent = text;
    tr.appendChild(td);
  }
  return tr;
}

const SVG = "http://www.w3.org/2000/svg";
function el(name, attrs, parent) {
  const e = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (parent) parent.appendChild(e);
  return e;
}

/// A line chart: series = [{name, color, points: [[x, y], ...]}].
function lineChart(series, { width = 560, height = 260, xLabel = "", yLabel = "", logX = false } = {}) {
  const m = { l: 56, r: 10, t: 10, b: 36 };
  const svg = el("svg", { width, height, viewBox: `0 0 ${width} ${height}` });
  const all = series.flatMap((s) => s.points);
  const tx = (x) => (logX ? Math.log10(Math.max(x, 0.01)) : x);
  let x0 = Math.min(...all.map((p) => tx(p[0])));
  let x1 = Math.max(...all.map((p) => tx(p[0])));
  let y1 = Math.max(...all.map((p) => p[1]));
  if (!isFinite(x0) || x1 <= x0) { x0 = isFinite(x0) ? x0 - 1 : 0; x1 = x0 + 2; }
  if (!(y1 > 0)) y1 = 1;
  const X = (x) => m.l + ((tx(x) - x0) / (x1 - x0)) * (width - m.l - m.r);
  const Y = (y) => height - m.b - (y / y1) * (height - m.t - m.b);
  el("line", { x1: m.l, y1: height - m.b, x2: width - m.r, y2: height - m.b, stroke: "#888" }, svg);
  el("line", { x1: m.l, y1: m.t, x2: m.l, y2: height - m.b, stroke: "#888" }, svg);
  for (let i = 0; i <= 4; i++) {
    const yv = (y1 * i) / 4;
    const t = el("text", { x: m.l - 4, y: Y(yv) + 4, "text-anchor": "end", "font-size": 10 }, svg);
    t.textContent = yv >= 10 ? yv.toFixed(0) : yv.toFixed(2);
    const xv = x0 + ((x1 - x0) * i) / 4;
    const xt = el("text", { x: m.l + ((width - m.l - m.r) * i) / 4, y: height - m.b + 14,
      "text-anchor": "middle", "font-size": 10 }, svg);
    xt.textContent = logX ? Number(Math.pow(10, xv).toPrecision(2)) : xv.toFixed(xv >= 10 ? 0 : 1);
  }
  el("text", { x: width / 2, y: height - 4, "text-anchor": "middle", "font-size": 11 }, svg)
    .textContent = xLabel;
  el("text", { x: 12, y: height / 2, "font-size": 11, transform: `rotate(-90 12 ${height / 2})`,
    "text-anchor": "middle" }, svg).textContent = yLabel;
  for (const s of series) {
    if (!s.points.length) continue;
    const d = s.points.map((p, i) => `${i ? "L" : "M"}${X(p[0]).toFixed(1)},${Y(p[1]).toFixed(1)}`)
      .join("");
    el("path", { d, fill: "none", stroke: s.color, "stroke-width": 1.5 }, svg);
  }
  const wrap = document.createElement("div");
  wrap.appendChild(svg);
  const legend = document.createElement("div");
  legend.className = "legend";
  for (const s of series) {
    const span = document.createElement("span");
    span.style.color = s.color;
    span.textContent = "\u25A0 " + s.name;
    legend.appendChild(span);
  }
  wrap.appendChild(legend);
  return wrap;
}

function draw(results) {
  const tbody = $("summary").querySelector("tbody");
  tbody.replaceChildren(...results.map(summaryRow));
  $("ttft-cdf").replaceChildren(lineChart(
    results.map((r, i) => ({ name: r.policy, color: COLORS[i % COLORS.length],
      points: r.ttft_cdf })),
    { xLabel: "TTFT ms (log scale)", yLabel: "fraction of requests", logX: true }));
  const charts = results.map((r) => {
    const box = document.createElement("div");
    box.className = "decode";
    box.dataset.policy = r.policy;
    const h = document.createElement("h3");
    h.textContent = `${r.policy} (CV ${fmt.cv(r.decode_cv)})`;
    box.appendChild(h);
    const n = r.decode_series.length ? r.decode_series[0][1].length : 0;
    const series = [];
    for (let k = 0; k < n; k++) {
      series.push({ name: `replica ${k}`, color: COLORS[k % COLORS.length],
        points: r.decode_series.map(([t, v]) => [t, v[k] ?? 0]) });
    }
    box.appendChild(lineChart(series, { width: 420, height: 200, xLabel: "virtual time s",
      yLabel: "decode blocks" }));
    return box;
  });
  $("decode-charts").replaceChildren(...charts);
  $("results").hidden = false;
}

async function runAll(ev) {
  ev.preventDefault();
  const button = $("run");
  const status = $("status");
  button.disabled = true;
  status.className = "";
  const requests = requestsFromForm();
  const results = [];
  try {
    if (!requests.length) throw new Error("choose at least one policy");
    const trace = await traceFor(workloadKind());
    for (const [i, req] of requests.entries()) {
      status.textContent = `running ${req.routing.policy} (${i + 1}/${requests.length})...`;
      // Let the browser paint the status before the (synchronous) replay.
      await new Promise((r) => setTimeout(r, 0));
      const t0 = performance.now();
      const r = JSON.parse(run_replay(JSON.stringify(req), trace));
      r.wall_ms = performance.now() - t0;
      results.push(r);
      draw(results);
    }
    const wall = results.reduce((a, r) => a + r.wall_ms, 0);
    const virt = results.reduce((a, r) => a + r.virtual_s, 0);
    status.textContent = `done: ${results.length} policies, ${virt.toFixed(0)} s of virtual time in ` +
      `${(wall / 1000).toFixed(1)} s`;
    document.body.dataset.state = "done";
    window.kvsteerResults = results;
    window.kvsteerRequests = requests;
  } catch (e) {
    status.textContent = String(e);
    status.className = "error";
    document.body.dataset.state = "error";
  } finally {
    button.disabled = false;
  }
}

async function main() {
  await init();
  const box = $("policies");
  for (const p of policies().split(",")) {
    const label = document.createElement("label");
    const input = document.createElement("input");
    input.type = "checkbox";
    input.value = p;
    input.checked = DEFAULT_POLICIES.includes(p);
    label.append(input, " " + p);
    box.appendChild(label);
  }
  for (const radio of document.querySelectorAll("input[name=workload]")) {
    radio.addEventListener("change", () => {
      for (const d of document.querySelectorAll(".params")) d.hidden = d.dataset.for !== workloadKind();
    });
  }
  $("setup").addEventListener("submit", runAll);
  $("run").disabled = false;
  $("run").textContent = "run";
  document.body.dataset.state = "ready";
}

main().catch((e) => {
  $("status").textContent = "could not load the WebAssembly module: " + e;
  $("status").className = "error";
  document.body.dataset.state = "error";
});

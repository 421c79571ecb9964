// The on-call page: send a trace to POST /diagnose, then draw the diagnosis that the server
// kept (GET /diagnoses/{id}: the Diagnosis plus each trace's RPC call graph).
// Everything is built with DOM calls and textContent: trace data never becomes markup.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const NODE_W = 180, NODE_H = 46, GAP_X = 44, GAP_Y = 16, PAD = 14;

const $ = (id) => document.getElementById(id);
let current = null;  // the RecentDiagnosis shown

function el(tag, attrs = {}, text = null) {
  const node = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  if (text !== null) node.textContent = text;
  return node;
}

function ms(us) {
  return us >= 1000 ? `${(us / 1000).toFixed(1)} ms` : `${us.toFixed(0)} µs`;
}

// The API key (X-API-Key) is asked for once and kept in this tab's sessionStorage: the
// recent diagnoses and the model are shown only to those who hold it.
const KEY = "bmeg-api-key";

function authHeaders(extra = {}) {
  const key = sessionStorage.getItem(KEY);
  return key ? { ...extra, "X-API-Key": key } : extra;
}

function saveKey(event) {
  event.preventDefault();
  sessionStorage.setItem(KEY, $("api-key").value);
  $("api-key").value = "";
  loadModel();
  loadRecent();
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = !message;
}

async function failure(response) {
  try {
    const body = await response.json();
    return `${response.status}: ${typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail)}`;
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

// -- sending a trace ---------------------------------------------------------------------
async function payload() {
  const file = $("trace-file").files[0];
  if (file) {
    const bytes = new Uint8Array(await file.arrayBuffer());
    const first = String.fromCharCode(bytes.find((b) => b > 32) || 0);
    const json = first === "{" || first === "[";
    return { body: bytes, type: json ? "application/json" : "application/x-protobuf" };
  }
  const text = $("trace-text").value.trim();
  if (!text) throw new Error("paste a trace or choose a file first");
  return { body: text, type: "application/json" };
}

async function diagnose(event) {
  event.preventDefault();
  showError("");
  try {
    const { body, type } = await payload();
    const query = $("window").checked ? "?window=true" : "";
    const response = await fetch(`/diagnose${query}`, { method: "POST", body, headers: authHeaders({ "Content-Type": type }) });
    if (!response.ok) throw new Error(await failure(response));
    await openDiagnosis(response.headers.get("X-Diagnosis-Id"));
    loadRecent();
  } catch (error) {
    showError(error.message);
  }
}

async function openDiagnosis(id) {
  const response = await fetch(`/diagnoses/${encodeURIComponent(id)}`, { headers: authHeaders() });
  if (!response.ok) throw new Error(await failure(response));
  current = await response.json();
  const traces = current.diagnosis.traces;
  const first = traces.findIndex((t) => t.anomalous);
  renderPicker();
  showTrace(first >= 0 ? first : 0);
  $("result").hidden = false;
}

// -- recent diagnoses and the model ------------------------------------------------------
async function loadRecent() {
  const response = await fetch("/diagnoses/recent?limit=20", { headers: authHeaders() });
  $("key-needed").hidden = response.status !== 401;
  if (!response.ok) return;
  const list = $("recent");
  list.replaceChildren();
  for (const item of await response.json()) {
    const li = el("li", { "data-id": item.id });
    const when = new Date(item.received_at * 1000).toLocaleTimeString();
    li.append(el("span", {}, `${when} · ${item.traces} trace${item.traces === 1 ? "" : "s"} · `));
    li.append(el("span", { class: item.anomalous ? "anomalous" : "" }, `${item.anomalous} anomalous`));
    if (item.top_service) li.append(el("span", {}, ` · top: ${item.top_service}`));
    li.addEventListener("click", () => openDiagnosis(item.id).catch((e) => showError(e.message)));
    list.append(li);
  }
}

async function loadModel() {
  const response = await fetch("/models", { headers: authHeaders() });
  if (response.status === 401) {
    $("model-info").textContent = "model: enter the API key to see it";
    return;
  }
  const state = await response.json();
  $("model-info").textContent = state.model
    ? `model: ${state.model.version}`
    : `model: not loaded${state.error ? ` (${state.error})` : ""}`;
}

// -- one trace ---------------------------------------------------------------------------
function renderPicker() {
  const picker = $("trace-picker");
  picker.replaceChildren();
  const traces = current.diagnosis.traces;
  if (traces.length < 2) return;
  traces.forEach((trace, index) => {
    const button = el("button", { type: "button", class: trace.anomalous ? "anomalous" : "" }, trace.trace_id.slice(0, 12));
    button.title = `${trace.spans} spans, ${ms(trace.total_us)}${trace.anomalous ? ", anomalous" : ""}`;
    button.addEventListener("click", () => showTrace(index));
    picker.append(button);
  });
}

function showTrace(index) {
  const trace = current.diagnosis.traces[index];
  [...$("trace-picker").children].forEach((b, i) => b.classList.toggle("selected", i === index));
  renderVerdict(trace);
  const graph = current.graphs.find((g) => g.trace_id === trace.trace_id);
  renderGraph(graph, trace);
  renderRanking(trace);
  renderLatencies(trace);
  renderList($("mitigations"), trace.mitigations.map((m) => `${m.service}: ${m.action.replace("_", " ")} (${m.reason})`),
             trace.anomalous ? "no mitigation suggested by the model" : "none needed: the trace is not anomalous");
  renderList($("critical-path"), trace.critical_path.map((s) => `${s.service} / ${s.operation}: ${ms(s.exclusive_us)}`), "—");
  renderList($("warnings"), trace.warnings, "");
  $("warnings-section").hidden = trace.warnings.length === 0;
}

function renderVerdict(trace) {
  const verdict = $("verdict");
  verdict.className = `verdict ${trace.anomalous ? "anomalous" : "normal"}`;
  const flagged = trace.bottlenecks.filter((s) => s.bottleneck).map((s) => s.service);
  verdict.replaceChildren(
    el("strong", {}, trace.anomalous ? "Anomalous trace" : "Normal trace"),
    el("span", {}, ` · ${trace.trace_id} · ${trace.spans} spans · ${ms(trace.total_us)} end to end · ` +
      `score ${trace.anomaly_score.toFixed(2)} (threshold ${trace.threshold.toFixed(2)}, ${trace.model.toUpperCase()})` +
      ((trace.signs || []).length ? ` · above their thresholds: ${trace.signs.join(", ")}` : "")),
  );
  if (flagged.length) verdict.append(el("div", { id: "bottlenecks" }, `Bottleneck${flagged.length > 1 ? "s" : ""}: ${flagged.join(", ")}`));
}

function renderList(list, items, empty) {
  list.replaceChildren(...(items.length ? items : [empty]).filter((t) => t).map((t) => el("li", {}, t)));
}

function renderRanking(trace) {
  const body = $("ranking").querySelector("tbody");
  body.replaceChildren(...trace.bottlenecks.map((s) => scoreRow(s)));
  const ranking = current.diagnosis.ranking;
  const box = $("window-ranking");
  box.replaceChildren();
  if (ranking) {
    box.append(el("h2", {}, "Over the whole batch"));
    const table = el("table");
    table.append(...ranking.map((s) => scoreRow(s)));
    box.append(table);
  }
}

function scoreRow(score) {
  const row = el("tr", { class: score.bottleneck ? "bottleneck" : "" });
  const bar = el("div", { class: "bar" });
  bar.style.width = `${Math.round(score.score * 100)}px`;  // CSSOM, not a style attribute: the CSP allows no inline style
  const cell = el("td");
  cell.append(bar);
  row.append(el("td", {}, score.service), el("td", { class: "num" }, score.score.toFixed(2)), cell);
  return row;
}

function renderLatencies(trace) {
  const body = $("latencies").querySelector("tbody");
  body.replaceChildren(...trace.latencies.map((l) => {
    const ratio = l.ratio === null ? "—" : `${l.ratio.toFixed(1)}×`;
    const row = el("tr");
    row.append(el("td", {}, l.service), el("td", { class: "num" }, ms(l.latency_us)),
               el("td", { class: "num" }, l.baseline_us === null ? "—" : ms(l.baseline_us)),
               el("td", { class: `num ${l.ratio !== null && l.ratio >= 2 ? "ratio-high" : ""}` }, ratio));
    return row;
  }));
}

// -- the call graph: layered left to right by call depth ---------------------------------
function layout(graph) {
  const incoming = new Map(graph.nodes.map((n) => [n.id, 0]));
  const children = new Map(graph.nodes.map((n) => [n.id, []]));
  for (const e of graph.edges) {
    if (e.source === e.target) continue;
    incoming.set(e.target, incoming.get(e.target) + 1);
    children.get(e.source).push(e.target);
  }
  // Breadth-first from the roots; a node's column is the first depth it is reached at, so
  // a (repaired) cycle cannot loop forever.
  const depth = new Map();
  let frontier = graph.nodes.filter((n) => incoming.get(n.id) === 0).map((n) => n.id);
  if (!frontier.length && graph.nodes.length) frontier = [graph.nodes[0].id];
  for (let d = 0; frontier.length; d++) {
    frontier = frontier.filter((id) => !depth.has(id));
    frontier.forEach((id) => depth.set(id, d));
    frontier = frontier.flatMap((id) => children.get(id));
  }
  graph.nodes.forEach((n) => depth.has(n.id) || depth.set(n.id, 0));
  const columns = [];
  for (const n of graph.nodes) (columns[depth.get(n.id)] ||= []).push(n.id);
  const position = new Map();
  columns.forEach((ids, c) => ids.forEach((id, r) => position.set(id, {
    x: PAD + c * (NODE_W + GAP_X), y: PAD + r * (NODE_H + GAP_Y),
  })));
  const rows = Math.max(...columns.map((ids) => ids.length));
  return { position, width: 2 * PAD + columns.length * (NODE_W + GAP_X) - GAP_X, height: 2 * PAD + rows * (NODE_H + GAP_Y) - GAP_Y };
}

function renderGraph(graph, trace) {
  const box = $("graph");
  box.replaceChildren();
  if (!graph) {
    box.append(el("p", { class: "muted" }, "call graph not kept for this trace (only the first traces of a batch are)"));
    return;
  }
  const flagged = new Set(trace.bottlenecks.filter((s) => s.bottleneck).map((s) => s.service));
  const key = (service, operation) => `${service}\u0000${operation}`;
  const nodeOf = new Map(graph.nodes.map((n) => [key(n.span_service, n.operation), n.id]));
  const pathNodes = trace.critical_path.map((s) => nodeOf.get(key(s.service, s.operation))).filter((id) => id !== undefined);
  const pathEdges = new Set(pathNodes.slice(1).map((id, i) => `${pathNodes[i]}>${id}`));
  const { position, width, height } = layout(graph);
  // Scaled down to the panel's width when wider, never up.
  const svg = el("svg:svg", { viewBox: `0 0 ${width} ${height}`, role: "img", "aria-label": "call graph" });
  svg.style.maxWidth = `${width}px`;

  for (const e of graph.edges) {
    const from = position.get(e.source), to = position.get(e.target);
    const x1 = from.x + NODE_W, y1 = from.y + NODE_H / 2, x2 = to.x, y2 = to.y + NODE_H / 2;
    const bend = Math.max(30, Math.abs(x2 - x1) / 2);
    const onPath = pathEdges.has(`${e.source}>${e.target}`);
    svg.append(el("svg:path", { class: `edge${onPath ? " on-path" : ""}`, d: `M${x1},${y1} C${x1 + bend},${y1} ${x2 - bend},${y2} ${x2},${y2}` }));
    if (e.calls > 1) svg.append(el("svg:text", { class: "edge-label", x: (x1 + x2) / 2, y: (y1 + y2) / 2 - 4 }, `×${e.calls}`));
  }
  const onPath = new Set(pathNodes);
  for (const n of graph.nodes) {
    const { x, y } = position.get(n.id);
    const classes = ["node", flagged.has(n.service) ? "bottleneck" : "", onPath.has(n.id) ? "on-path" : ""].join(" ").trim();
    const g = el("svg:g", { class: classes, transform: `translate(${x},${y})`, "data-service": n.service });
    g.append(el("svg:title", {}, `${n.service} / ${n.span_service}: ${n.operation}\n${n.calls} call(s), ${ms(n.total_us)} in total`));
    g.append(el("svg:rect", { width: NODE_W, height: NODE_H, rx: 5 }));
    g.append(el("svg:text", { class: "service", x: 8, y: 17 }, clip(n.service, 26)));
    const caller = n.span_service === n.service ? "" : `${n.span_service}: `;
    g.append(el("svg:text", { class: "detail", x: 8, y: 34 }, clip(`${caller}${n.operation} · ${n.calls}× ${ms(n.total_us)}`, 30)));
    svg.append(g);
  }
  box.append(svg);
}

function clip(text, length) {
  return text.length > length ? `${text.slice(0, length - 1)}…` : text;
}

$("trace-form").addEventListener("submit", diagnose);
$("key-form").addEventListener("submit", saveKey);
$("refresh-recent").addEventListener("click", loadRecent);
loadModel();
loadRecent();

// hetd dashboard: reads the server-sent `state` events of /v1/dashboard/stream and fills the page.
// The charts arrive as SVG drawn by the daemon; everything a worker or policy names is inserted as
// text (textContent), never as markup. No library, nothing fetched from elsewhere.
"use strict";

const $ = (id) => document.getElementById(id);
const fmt = (v, d = 2) => (v === null || v === undefined ? "–" : Number(v).toFixed(d));
let knownPolicies = "";
let shownParams = "";

function cell(row, text, className) {
  const td = document.createElement("td");
  td.textContent = text;
  if (className) td.className = className;
  row.appendChild(td);
}

// A policy's parameters as a key/value list (one entry per parameter; values as JSON).
function showParams(params) {
  const list = $("policy-params");
  list.replaceChildren();
  for (const [key, value] of Object.entries(params || {})) {
    const item = document.createElement("div");
    const dt = document.createElement("dt");
    const dd = document.createElement("dd");
    dt.textContent = key;
    dd.textContent = JSON.stringify(value);
    item.append(dt, dd);
    list.appendChild(item);
  }
}

// A worker's local steps per push; with ADSP's time budget, that budget too.
function localSteps(w) {
  if (w.local_steps === null || w.local_steps === undefined) return "–";
  return w.local_time_s ? w.local_steps + " (" + fmt(w.local_time_s, 2) + " s)" : String(w.local_steps);
}

function render(doc) {
  const st = doc.status;
  const thr = st.throughput || {};
  $("version").textContent = st.version;
  const head = doc.headline || {label: "Accuracy", value: st.accuracy};
  $("accuracy-label").textContent = head.label;
  $("accuracy").textContent = head.value === null || head.value === undefined ? "–" : fmt(head.value, 4);
  $("updates").textContent = fmt(thr.updates_per_s, 1);
  $("mbps").textContent = fmt(thr.mb_in_per_s, 2) + " / " + fmt(thr.mb_out_per_s, 2);
  $("nworkers").textContent = st.workers;
  $("stage").textContent = st.stage;
  $("summary").textContent = "up " + Math.round(st.uptime_s) + " s, " + st.updates_applied + " updates applied";
  for (const name of ["accuracy", "updates", "bytes", "stages"]) {
    $("chart-" + name).innerHTML = doc.charts[name]; // SVG from the daemon, its text escaped there
  }
  const body = $("workers").tBodies[0];
  body.replaceChildren();
  for (const w of doc.workers) {
    const row = document.createElement("tr");
    const dev = [w.device.platform, w.device.kind].filter(Boolean).join(":") || "-";
    cell(row, w.worker);
    cell(row, w.name, "text");
    cell(row, dev, "text");
    cell(row, w.stage || "–", "text");
    cell(row, localSteps(w));
    cell(row, fmt(w.samples_per_s, 0));
    cell(row, w.batch_size);
    cell(row, fmt(100 * w.batch_share, 0) + "%");
    cell(row, fmt(w.staleness_mean, 2));
    cell(row, fmt(100 * w.idle_fraction, 0) + "%");
    cell(row, w.codec, "text");
    cell(row, fmt(w.bytes_in / 1e6, 1));
    cell(row, fmt(w.bytes_out / 1e6, 1));
    cell(row, w.refused);
    body.appendChild(row);
  }
  const pol = doc.policy;
  $("policy-name").textContent = pol.name;
  const shown = JSON.stringify(pol.params);
  if (shown !== shownParams) {
    shownParams = shown;
    showParams(pol.params);
  }
  const known = (pol.known || []).join(",");
  if (known !== knownPolicies) {
    knownPolicies = known;
    const select = $("swap-name");
    select.replaceChildren();
    for (const name of pol.known || []) {
      const opt = document.createElement("option");
      opt.value = name;
      opt.textContent = name;
      select.appendChild(opt);
    }
    select.value = pol.name;
  }
  const events = $("events");
  events.replaceChildren();
  for (const e of doc.events) {
    const li = document.createElement("li");
    const kind = document.createElement("span");
    kind.className = "kind";
    kind.textContent = fmt(e.t, 1) + " s " + e.kind;
    li.appendChild(kind);
    li.appendChild(document.createTextNode(" " + e.text));
    events.appendChild(li);
  }
  document.body.dataset.version = st.version;
}

function connect() {
  const source = new EventSource("/v1/dashboard/stream");
  source.addEventListener("open", () => {
    $("connection").textContent = "live";
    $("connection").className = "pill live";
  });
  source.addEventListener("state", (ev) => render(JSON.parse(ev.data)));
  source.addEventListener("error", () => {
    $("connection").textContent = "reconnecting…";
    $("connection").className = "pill down";
  });
}

async function swap(ev) {
  ev.preventDefault();
  const out = $("swap-result");
  let params;
  try {
    params = JSON.parse($("swap-params").value || "{}");
  } catch (err) {
    out.textContent = "parameters are not JSON: " + err.message;
    out.className = "result error";
    return;
  }
  out.textContent = "swapping…";
  out.className = "result";
  const reply = await fetch("/v1/policy", {
    method: "PUT",
    credentials: "same-origin",
    headers: { "Content-Type": "application/json", "X-Hetd-Dashboard": "1" },
    body: JSON.stringify({ name: $("swap-name").value, params: params }),
  });
  const body = await reply.json();
  if (reply.ok) {
    out.textContent = "now " + body.name + " " + JSON.stringify(body.params);
    out.className = "result ok";
    $("policy-name").textContent = body.name;
    shownParams = JSON.stringify(body.params);
    showParams(body.params);
  } else {
    out.textContent = "refused: " + body.message;
    out.className = "result error";
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("swap").addEventListener("submit", swap);
  connect();
});

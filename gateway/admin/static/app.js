// The status page: polls /admin/state (same origin, session cookie) every 2 s and draws it; actions POST to
// /admin/ui/actions/* with the page's CSRF token. No external assets, no inline script (the CSP forbids both).
"use strict";

const csrf = document.querySelector('meta[name="csrf-token"]').content;
const COLOURS = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7"];

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  for (const child of children) node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  return node;
}

function svg(tag, attrs = {}) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  return node;
}

function ringPicture(pool) {
  const picture = svg("svg", { class: "ring", viewBox: "-1.2 -1.2 2.4 2.4" });
  const ids = pool.replicas.map((r) => r.id);
  const point = (t, radius) => [radius * Math.sin(2 * Math.PI * t), -radius * Math.cos(2 * Math.PI * t)];
  for (const [start, end, replica] of pool.ring) {
    const [x1, y1] = point(start, 1), [x2, y2] = point(end, 1);
    const large = end - start > 0.5 ? 1 : 0;
    const arc = svg("path", { d: `M ${x1} ${y1} A 1 1 0 ${large} 1 ${x2} ${y2}`, fill: "none",
      stroke: COLOURS[ids.indexOf(replica) % COLOURS.length], "stroke-width": 0.18 });
    picture.append(arc);
  }
  for (const tenant of pool.tenants) {
    const [x, y] = point(tenant.position, 0.78);
    const dot = svg("circle", { cx: x, cy: y, r: 0.05, fill: COLOURS[ids.indexOf(tenant.home) % COLOURS.length] });
    dot.append(svg("title"));
    const placed = tenant.home === tenant.ring_home ? "" : ` (balanced; the ring alone: ${tenant.ring_home})`;
    dot.firstChild.textContent = `${tenant.id}: home ${tenant.home}${placed}`;
    picture.append(dot);
  }
  return picture;
}

function spark(values) {
  const picture = svg("svg", { class: "spark", viewBox: `0 0 ${Math.max(values.length - 1, 1)} 1`, preserveAspectRatio: "none" });
  const top = Math.max(...values, 1);
  const points = values.map((v, i) => `${i},${1 - v / top}`).join(" ");
  picture.append(svg("polyline", { points, fill: "none", stroke: "#4e79a7", "stroke-width": 0.08 }));
  return picture;
}

function button(label, action, body) {
  const node = el("button", { "data-action": action, "data-body": JSON.stringify(body) }, label);
  node.addEventListener("click", () => act(action, body));
  return node;
}

async function act(action, body) {
  const response = await fetch(`/admin/ui/actions/${action}`, {
    method: "POST", headers: { "Content-Type": "application/json", "X-CSRF-Token": csrf }, body: JSON.stringify(body),
  });
  const answer = await response.json();
  document.getElementById("message").textContent = response.ok ? `${action}: done` : answer.error.message;
  refresh();
}

function drawPools(state) {
  const box = document.getElementById("pools");
  box.replaceChildren();
  for (const [name, pool] of Object.entries(state.pools)) {
    const replicas = el("table", { class: "replicas", "data-pool": name },
      el("tr", {}, el("th", {}, "replica"), el("th", {}, "state"), el("th", {}, "in flight"),
        el("th", {}, "engine waiting / KV"), el("th", {}, "")));
    for (const r of pool.replicas) {
      const status = !r.up ? "down" : r.drained ? "drained" : r.ejected ? "ejected" : r.healthy ? "up" : "returning";
      const load = r.engine_load ? `${r.engine_load.waiting} / ${Math.round(100 * r.engine_load.kv_cache_usage)}%` : "-";
      const toggle = r.drained ? button("undrain", "undrain", { pool: name, replica: r.id })
                               : button("drain", "drain", { pool: name, replica: r.id });
      replicas.append(el("tr", { "data-replica": r.id }, el("td", {}, r.id),
        el("td", { class: status === "up" ? "up" : "down" }, status), el("td", {}, r.in_flight), el("td", {}, load),
        el("td", {}, toggle)));
    }
    const residency = el("table", { class: "residency", "data-pool": name });
    const head = el("tr", {}, el("th", {}, "residency"));
    for (const adapter of pool.adapters) {
      head.append(el("th", {}, adapter, " ", button("warm", "warm", { adapter }), button("unload", "unload", { adapter })));
    }
    residency.append(head);
    for (const r of pool.replicas) {
      const row = el("tr", { "data-replica": r.id }, el("th", {}, r.id));
      for (const adapter of pool.adapters) {
        const info = r.adapters[adapter];
        const loading = r.loading.includes(adapter);
        const kind = loading ? "loading" : info ? (info.pinned ? "pinned" : "resident") : "";
        const text = loading ? "loading" : info ? `${info.pinned ? "pinned" : "resident"}, idle ${Math.round(info.idle_s)} s` : "";
        row.append(el("td", { class: kind, "data-adapter": adapter }, text));
      }
      residency.append(row);
    }
    const tenants = el("table", { class: "tenants", "data-pool": name },
      el("tr", {}, el("th", {}, "tenant"), el("th", {}, "home"), el("th", {}, "replica set (why)"),
        el("th", {}, "goes to now"), el("th", {}, "predicted TTFT per replica")));
    for (const t of pool.tenants) {
      tenants.append(el("tr", { "data-tenant": t.id }, el("td", {}, t.id), el("td", {}, t.home),
        el("td", { class: "placement" }, placementText(t.placement)),
        el("td", { class: "now" }, t.now ?? "-"), el("td", { class: "predicted" }, predictedText(t.predicted))));
    }
    box.append(el("h3", {}, `${name} (${pool.policy}, working set ${pool.max_adapters})`),
      el("div", { class: "pool" }, ringPicture(pool), replicas, tenants), residency);
  }
}

// Where a tenant lives: "r1, r3 (hot: 40 req/s ...)", with the members still warming (make before break).
function placementText(placement) {
  if (!placement) return "-";
  const warming = placement.warming.length ? `; warming at ${placement.warming.join(", ")}` : "";
  return `${placement.replicas.join(", ")} (${placement.why}${warming})`;
}

// predicted_ttft's figures for one tenant, built here from the decision's numbers: "r1 52 ms (warm: queue 30 +
// regime 12 + affinity 10)" per candidate, fastest first.
function predictedText(predicted) {
  const rows = Object.entries(predicted || {}).sort((a, b) => a[1].total_ms - b[1].total_ms);
  if (!rows.length) return "-";
  return rows.map(([replica, p]) => {
    const parts = Object.entries(p.parts).map(([name, ms]) => `${name} ${Math.round(ms)}`).join(" + ");
    return `${replica} ${Math.round(p.total_ms)} ms (${p.regime}: ${parts})`;
  }).join("; ");
}

function drawAdapters(state) {
  const table = document.getElementById("adapters");
  table.replaceChildren(el("tr", {}, el("th", {}, "adapter"), el("th", {}, "requests / min"), el("th", {}, "last min"),
    el("th", {}, "TTFT p50"), el("th", {}, "TTFT p99"), el("th", {}, "cold loads (10 min)")));
  for (const [adapter, minutes] of Object.entries(state.adapters)) {
    const last = minutes[minutes.length - 1] || {};
    const cold = minutes.reduce((sum, m) => sum + m.cold_loads, 0);
    table.append(el("tr", {}, el("td", {}, adapter), el("td", {}, spark(minutes.map((m) => m.requests))),
      el("td", {}, last.requests ?? 0),
      el("td", {}, spark(minutes.map((m) => m.ttft_p50_ms || 0)), " ", last.ttft_p50_ms == null ? "-" : `${last.ttft_p50_ms} ms`),
      el("td", {}, spark(minutes.map((m) => m.ttft_p99_ms || 0)), " ", last.ttft_p99_ms == null ? "-" : `${last.ttft_p99_ms} ms`),
      el("td", {}, spark(minutes.map((m) => m.cold_loads)), " ", cold)));
  }
}

function drawDecisions(state) {
  const table = document.getElementById("decisions");
  table.replaceChildren(el("tr", {}, ...["time", "tenant", "adapter", "replica", "reasons", "status", "TTFT"].map((h) => el("th", {}, h))));
  for (const d of state.decisions.slice(0, 20)) {
    table.append(el("tr", {}, el("td", {}, new Date(d.at * 1000).toLocaleTimeString()), el("td", {}, d.tenant),
      el("td", {}, d.adapter), el("td", {}, d.replica), el("td", {}, d.reasons.join(" ")), el("td", {}, d.status),
      el("td", {}, d.ttft_ms == null ? "-" : `${d.ttft_ms} ms`)));
  }
}

async function refresh() {
  const response = await fetch("/admin/state", { credentials: "same-origin" });
  if (response.status === 401) { window.location = "/admin/ui"; return; }
  const state = await response.json();
  // serve --workers: the figures are every worker's (gateway/admin/merge.py); say which answered, which did not.
  const workers = state.workers
    ? ` · workers: ${state.workers.map((w) => w.worker).join(", ")}` +
      (state.missing_workers.length ? ` (not answering: ${state.missing_workers.join(", ")})` : "")
    : "";
  document.getElementById("store").textContent = `residency store: ${state.store}${workers}`;
  document.getElementById("updated").textContent = `updated ${new Date(state.at * 1000).toLocaleTimeString()}`;
  drawPools(state);
  drawAdapters(state);
  drawDecisions(state);
}

refresh();
setInterval(refresh, 2000);

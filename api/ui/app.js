// ringwatch's page: reads the REST API with the token its user typed (kept in this tab's
// sessionStorage) and draws the fleet, a node, the network, a series and preflight.
// Plain DOM, SVG and canvas; no build step. Each view marks the root element with
// data-drawn="<view>" once its content is on screen (what the tests and the benchmark wait for).
"use strict";

const TOKEN_KEY = "ringwatch.token";
const view = document.getElementById("view");
const tooltip = document.getElementById("tooltip");
const SVG_NS = "http://www.w3.org/2000/svg";

// ---- colour: cividis (dark blue to yellow), readable with every common colour-vision
// deficiency. A ratio (measured over expected busbw) of 0.4 or less is the darkest, 1.0
// the lightest; state is always shown by a glyph and text as well, never by colour alone.
const CIVIDIS = [[0, 32, 77], [65, 77, 107], [124, 123, 120], [188, 175, 111], [255, 234, 70]];
const RATIO_LO = 0.4, RATIO_HI = 1.0;
const NONE_COLOUR = "#e4e6ea";
const GLYPH = {degraded: "\u2715", suspect: "!", ok: "", unknown: "?", busy: "\u25cf"};
const STATE_TEXT = {degraded: "degraded (open finding)", suspect: "suspect (shares a degraded link)",
                    ok: "ok", unknown: "not probed yet", busy: "busy (a job holds it; last results kept)"};
// What holds a busy node, in one line: the job and its source, since when.
function occupiedText(o) {
  return o ? `${o.reason}${o.since ? `, since ${fmtTime(o.since)}` : ""}` : "";
}

function ratioRgb(ratio) {
  const t = Math.min(1, Math.max(0, (ratio - RATIO_LO) / (RATIO_HI - RATIO_LO))) * (CIVIDIS.length - 1);
  const i = Math.min(CIVIDIS.length - 2, Math.floor(t)), f = t - i;
  return CIVIDIS[i].map((c, k) => Math.round(c + (CIVIDIS[i + 1][k] - c) * f));
}
function ratioColour(ratio) {
  if (!isNumber(ratio)) return NONE_COLOUR;
  const [r, g, b] = ratioRgb(ratio);
  return `rgb(${r},${g},${b})`;
}
// Light cells carry dark glyphs, dark cells light ones.
function inkOn(ratio) { return isNumber(ratio) && ratio > 0.8 ? "#1d2330" : "#fff"; }

// ---- small DOM helpers (text goes in as text, never as HTML)
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "dataset") Object.assign(node.dataset, v);
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else if (k === "style") node.style.cssText = v;
    else node.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat(Infinity)) if (c !== null && c !== undefined) node.append(c.nodeType ? c : String(c));
  return node;
}
function svg(tag, attrs, ...children) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined) continue;
    // Through the CSSOM: the page's policy (style-src 'self') refuses style attributes.
    if (k === "style") node.style.cssText = v;
    else node.setAttribute(k, v);
  }
  for (const c of children.flat(Infinity)) if (c !== null && c !== undefined) node.append(c.nodeType ? c : String(c));
  return node;
}
// A stored record may hold anything where a number or a list belongs (a finding's detail is
// free-form JSON): what the page shows of one goes through these, so an odd value shows as
// text or "\u2013" and never throws.
const isNumber = (x) => typeof x === "number" && Number.isFinite(x);
const fmt = (x, d = 2) => (isNumber(x) ? x.toFixed(d) : "\u2013");
const asList = (x) => (Array.isArray(x) ? x : x === null || x === undefined || x === "" ? [] : [x]);
const listText = (x, sep = ",") => asList(x).map((v) => (v !== null && typeof v === "object" ? JSON.stringify(v) : String(v))).join(sep);
// ---- places, written as every text surface writes them (agents/places.py): node lists as
// Slurm host lists (node-[000-004,007]), GPU sets as ranges (GPUs 0-3,6), a node's GPUs
// (node-003 GPUs 2,5). Numbers as BigInt: a name's digits may be longer than a double holds.
const byText = (a, b) => (a < b ? -1 : a > b ? 1 : 0);
function nodeList(names) {
  const tails = [], plain = [];
  for (const name of new Set(asList(names).map(String))) {
    const m = /^(.*?)([0-9]+)$/.exec(name);
    if (m) tails.push([m[1], m[2]]); else plain.push(name);
  }
  // A number of a zero-padded width in use joins that width's run; the others are unpadded.
  const key = (prefix, width) => `${prefix}\u0000${width}`;
  const padded = new Set(tails.filter(([, d]) => d.length > 1 && d[0] === "0").map(([p, d]) => key(p, d.length)));
  const runs = new Map();
  for (const [prefix, d] of tails) {
    const width = padded.has(key(prefix, d.length)) ? d.length : 1;
    if (!runs.has(key(prefix, width))) runs.set(key(prefix, width), {prefix, width, numbers: []});
    runs.get(key(prefix, width)).numbers.push(BigInt(d));
  }
  const parts = [...runs.values()].map((r) => ({...r, numbers: [...r.numbers].sort(byText)}))
    .sort((a, b) => byText(a.prefix, b.prefix) || byText(a.numbers[0], b.numbers[0]))
    .map(({prefix, width, numbers}) => {
      const pad = (n) => n.toString().padStart(width, "0");
      const spans = [];
      let start = numbers[0], prev = numbers[0];
      for (const n of [...numbers.slice(1), null]) {
        if (n !== null && n === prev + 1n) { prev = n; continue; }
        spans.push(pad(start) + (prev !== start ? `-${pad(prev)}` : ""));
        if (n !== null) start = prev = n;
      }
      return spans.length === 1 && !spans[0].includes("-") ? prefix + spans[0] : `${prefix}[${spans.join(",")}]`;
    });
  return [...parts, ...plain.sort(byText)].join(",");
}
function gpuSet(values) {
  const list = asList(values);
  if (!list.every((v) => Number.isInteger(v))) return listText(list);
  const out = [];
  for (const i of [...new Set(list)].sort((a, b) => a - b)) {
    const last = out[out.length - 1];
    if (last && last[1] === i - 1) last[1] = i; else out.push([i, i]);
  }
  return out.map(([a, b]) => (a === b ? `${a}` : `${a}-${b}`)).join(",");
}
// A stored record's gpus that is not a list is shown as its text, after "GPUs".
const gpusText = (values) => (Array.isArray(values) && values.length === 1 ? "GPU" : "GPUs") +
  ` ${Array.isArray(values) ? gpuSet(values) : listText(values)}`;
function place(nodes, gpus) {
  const where = nodeList(nodes);
  return asList(gpus).length ? `${where} ${gpusText(Array.isArray(gpus) || isNumber(gpus) ? asList(gpus) : gpus)}` : where;
}
// Names as people count them (node-9 before node-10).
function countingOrder(a, b) {
  const pa = a.split(/([0-9]+)/), pb = b.split(/([0-9]+)/);
  for (let i = 0; i < Math.min(pa.length, pb.length); i++) {
    const c = i % 2 ? byText(BigInt(pa[i]), BigInt(pb[i])) || byText(pa[i], pb[i]) : byText(pa[i], pb[i]);
    if (c) return c;
  }
  return pa.length - pb.length;
}
// A group's members (NODE/LOCAL_INDEX) by the GPUs each node holds: node-[000-001] GPUs 0-1.
function membersText(members) {
  const byNode = new Map();
  for (const m of asList(members).map(String)) {
    const i = m.lastIndexOf("/"), local = m.slice(i + 1);
    if (i <= 0 || !/^[0-9]+$/.test(local)) { if (!byNode.has(m)) byNode.set(m, []); continue; }
    byNode.set(m.slice(0, i), [...(byNode.get(m.slice(0, i)) || []), Number(local)]);
  }
  const bySet = new Map();
  for (const node of [...byNode.keys()].sort(countingOrder)) {
    const set = [...new Set(byNode.get(node))].sort((a, b) => a - b);
    if (!bySet.has(set.join(","))) bySet.set(set.join(","), {gpus: set, nodes: []});
    bySet.get(set.join(",")).nodes.push(node);
  }
  return [...bySet.values()].map((s) => place(s.nodes, s.gpus)).join("; ");
}

// One record that cannot be drawn must not take its view down: it gets a row saying so.
function drawOr(draw, record, fallback) {
  try { return draw(record); } catch (err) {
    console.warn("a record could not be drawn in full", record, err);
    return fallback(record);
  }
}
const fmtTime = (t) => (t ? new Date(t).toLocaleString() : "\u2013");
function fmtBytes(n) {
  const units = ["B", "KiB", "MiB", "GiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${+n.toFixed(1)} ${units[i]}`;
}
function badge(state) {
  const cls = state === "degraded" ? "bad" : state === "ok" ? "good" : "suspect";
  return el("span", {class: `badge ${cls}`}, `${GLYPH[state] || "\u2713"} ${state}`);
}
// A link's status and, where the hysteresis explains it, why (GET /v1/links' ``standing``):
// a link slow in one cycle of the window is still ok, and says so with its count.
function linkBadge(link) {
  const state = link.status === "ok" ? "ok" : "degraded";
  const s = link.standing || {};
  const why = typeof s.text === "string" ? s.text : "";
  if (!why) return badge(state);
  const title = state === "ok"
    ? `Slow in ${s.bad} of the last ${s.window} cycles: a link turns degraded, and its fault opens an incident, at ${s.opens_at} of ${s.window}.`
    : `Degraded until ${s.closes_at} good cycles in a row.`;
  return el("span", {class: `badge ${state === "ok" ? "suspect" : "bad"} standing`, title},
            state === "ok" ? `${GLYPH.suspect} ${why}` : `${GLYPH.degraded} degraded, ${why}`);
}

// Numbers on hover: one tooltip for the page, fed by whatever is under the pointer.
function showTip(event, text) {
  tooltip.textContent = text;
  tooltip.hidden = false;
  const x = Math.min(event.clientX + 14, window.innerWidth - tooltip.offsetWidth - 8);
  tooltip.style.left = `${x}px`;
  tooltip.style.top = `${event.clientY + 14}px`;
}
function hideTip() { tooltip.hidden = true; }

function drawn(name) {
  document.documentElement.dataset.drawn = name;
  window.__ringwatchDrawnAt = performance.now();
}

// ---- the API
class Refused extends Error {}

async function api(path, options = {}) {
  const token = sessionStorage.getItem(TOKEN_KEY);
  const headers = {Authorization: `Bearer ${token}`, ...(options.body ? {"Content-Type": "application/json"} : {})};
  const resp = await fetch(path, {...options, headers});
  const body = resp.status === 204 ? null : await resp.json().catch(() => null);
  if (resp.status === 401) {
    sessionStorage.removeItem(TOKEN_KEY);
    throw new Refused((body && body.message) || "token refused");
  }
  if (!resp.ok) throw new Error((body && body.message) || `${resp.status} ${resp.statusText}`);
  return {status: resp.status, body};
}
const get = async (path) => (await api(path)).body;

// ---- login
function showLogin(message) {
  document.getElementById("login").hidden = false;
  for (const id of ["nav", "logout", "refresh"]) document.getElementById(id).hidden = true;
  document.getElementById("summary").textContent = "";
  document.getElementById("updated").textContent = "";
  clearTimeout(refreshTimer);
  document.getElementById("login-error").textContent = message || "";
  view.replaceChildren();
  drawn("login");
}

document.getElementById("login-form").addEventListener("submit", async (e) => {
  e.preventDefault();
  const input = document.getElementById("token");
  sessionStorage.setItem(TOKEN_KEY, input.value.trim());
  try {
    await get("/v1/health");
  } catch (err) {
    sessionStorage.removeItem(TOKEN_KEY);
    showLogin(err instanceof Refused ? `Token refused: ${err.message}` : `Cannot log in: ${err.message}`);
    return;
  }
  input.value = "";
  route();
});
document.getElementById("logout").addEventListener("click", () => {
  sessionStorage.removeItem(TOKEN_KEY);
  showLogin("Logged out.");
});

// ---- routing: #/fleet, #/node/NAME, #/network, #/series?group=KEY&op=OP, #/series?pair=A,B, #/preflight
// One route at a time: a navigation waits for a refresh in flight, so the view it draws is
// never replaced by an older one.
let routing = Promise.resolve();
function route(refresh = false) {
  routing = routing.then(() => drawRoute(refresh)).catch((err) => console.warn("a view failed", err))
    .then(() => { if (!refresh) scheduleRefresh(); });
  return routing;
}
// Listeners a view puts on the window go when the next view is drawn.
let viewListeners = new AbortController();

async function drawRoute(refresh) {
  hideTip();
  if (!sessionStorage.getItem(TOKEN_KEY)) return showLogin("");
  for (const id of ["nav", "logout", "refresh"]) document.getElementById(id).hidden = false;
  document.getElementById("login").hidden = true;
  const [path, query] = (location.hash.slice(1) || "/fleet").split("?");
  const params = new URLSearchParams(query || "");
  const parts = path.split("/").filter(Boolean);
  for (const a of document.querySelectorAll("[data-nav]")) a.classList.toggle("active", a.dataset.nav === parts[0]);
  if (!refresh) {
    delete document.documentElement.dataset.drawn;
    view.replaceChildren(el("p", {class: "muted"}, "Loading\u2026"));
  }
  try {
    refreshSummary();
    // A refresh leaves the preflight form as it is: it would lose what was typed, and
    // submitting it again could make a scheduler probe.
    if (refresh && parts[0] === "preflight") return updated(refresh);
    viewListeners.abort();
    viewListeners = new AbortController();
    if (parts[0] === "node" && parts[1]) await nodeView(decodeURIComponent(parts[1]));
    else if (parts[0] === "network") await networkView();
    else if (parts[0] === "series") await seriesView(params);
    else if (parts[0] === "preflight") preflightView();
    else await fleetView(params);
    updated(refresh);
  } catch (err) {
    if (err instanceof Refused) return showLogin(`Token refused: ${err.message}`);
    if (refresh) {  // the view on screen stays; the header says the refresh failed
      document.getElementById("updated").textContent = `refresh failed: ${err.message}`;
      return;
    }
    view.replaceChildren(el("p", {class: "error"}, `Could not load: ${err.message}`));
    drawn("error");
  }
}
window.addEventListener("hashchange", () => route());

// ---- auto-refresh: every REFRESH_S seconds while the box is ticked and the tab is shown,
// the view is read and drawn again in place (its filters, zoom, chosen link and range kept).
const REFRESH_S = 30;
const REFRESH_KEY = "ringwatch.refresh";
const autoRefresh = document.getElementById("auto-refresh");
autoRefresh.checked = sessionStorage.getItem(REFRESH_KEY) === "on";
autoRefresh.addEventListener("change", () => {
  sessionStorage.setItem(REFRESH_KEY, autoRefresh.checked ? "on" : "off");
  scheduleRefresh();
});
let refreshTimer = null;
function scheduleRefresh() {
  clearTimeout(refreshTimer);
  if (!autoRefresh.checked || !sessionStorage.getItem(TOKEN_KEY)) return;
  refreshTimer = setTimeout(async () => {
    if (!document.hidden) await route(true);
    scheduleRefresh();
  }, REFRESH_S * 1000);
}
function updated(refresh) {
  document.getElementById("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
  if (refresh) {
    const root = document.documentElement;
    root.dataset.refreshes = String(Number(root.dataset.refreshes || 0) + 1);
  }
}

async function refreshSummary() {
  try {
    const h = await get("/v1/health");
    const bad = h.links.degraded || 0;
    document.getElementById("summary").textContent =
      `${h.status === "degraded" ? "\u2715" : h.status === "healthy" ? "\u2713" : "?"} ${h.status} \u00b7 ` +
      `${h.nodes} nodes \u00b7 ${bad} degraded links \u00b7 ${h.open_findings} open findings`;
  } catch (err) { /* the view reports its own errors */ }
}

// Where a finding is: its node (or nodes) and GPUs, as every surface writes it.
function findingPlace(f) {
  const d = f.detail || {};
  return place(d.node ? [d.node] : f.nodes, asList(d.gpus).length ? d.gpus : d.gpu ?? []);
}
// A finding's figure: its headline's text, the same on every surface (docs/analysis.md,
// "The headline"); a record stored before findings had one shows its measured and expected.
// Its cause follows where one is known (the transport NCCL took, a NIC counter, the fabric
// state: docs/transport.md), as the CLI prints it.
function findingFigures(f) {
  const d = f.detail || f;
  const figure = bandwidthFigure(d);
  const cause = typeof d.cause === "string" && d.cause ? d.cause : "";
  return figure && cause ? `${figure}; ${cause}` : figure || cause;
}
function bandwidthFigure(d) {
  if (d.headline && typeof d.headline.text === "string") return d.headline.text;
  const measured = d.measured_gbs, expected = d.expected_gbs;
  if (measured === null || measured === undefined || expected === null || expected === undefined) return "";
  const ratio = isNumber(measured) && isNumber(expected) && expected !== 0 ? measured / expected : null;
  return `${fmt(measured)} of ${fmt(expected)} GB/s (${fmt(ratio)})`;
}
const kindText = (f) => `\u2715 ${(f && f.kind) ?? "?"}`;

function legend() {
  const ramp = el("canvas", {class: "ramp", width: 160, height: 12});
  const ctx = ramp.getContext("2d");
  for (let x = 0; x < 160; x++) { ctx.fillStyle = ratioColour(RATIO_LO + (RATIO_HI - RATIO_LO) * x / 159); ctx.fillRect(x, 0, 1, 12); }
  const sample = (state, ratio) => el("span", {class: "cell", dataset: {state},
    style: state === "unknown" ? "" : `background:${ratioColour(ratio)};color:${inkOn(ratio)}`}, GLYPH[state]);
  return el("div", {class: "legend"},
    el("span", {}, `measured / expected busbw: ${RATIO_LO} or less`), ramp, el("span", {}, `${RATIO_HI} or more`),
    el("span", {}, sample("degraded", 0.5), " degraded (open finding)"),
    el("span", {}, sample("suspect", 0.8), " suspect (shares a degraded link)"),
    el("span", {}, sample("ok", 1.0), " ok"),
    el("span", {}, sample("busy", 1.0), " busy (a job holds it)"),
    el("span", {}, sample("unknown", null), " not probed yet"));
}

// ---- the fleet: every node as a cell, filterable, with open incidents beside
// Up to this many nodes, each cell shows its node's name by default.
const NAMED_CELLS = 128;
async function fleetView(params) {
  const [states, open] = await Promise.all([get("/v1/fleet/nodes"), get("/v1/findings?status=open&limit=500")]);
  const nodes = states.nodes;
  const filterText = el("input", {type: "search", id: "filter", placeholder: "filter nodes (text or /regex/)",
                                  value: params.get("q") || ""});
  const filterState = el("select", {id: "filter-state"},
    ["all", "degraded", "suspect", "ok", "busy", "unknown"].map((s) => el("option", {value: s}, s)));
  filterState.value = params.get("state") || "all";
  const count = el("span", {class: "muted", id: "shown"});
  // Each cell's name written in it (a small fleet's default), or on hover only.
  const names = el("input", {type: "checkbox", id: "fleet-names"});
  names.checked = params.has("names") ? params.get("names") === "1" : nodes.length <= NAMED_CELLS;
  const grid = el("div", {class: "grid", id: "fleet-grid"});
  const byName = new Map(nodes.map((n) => [n.name, n]));

  const cells = nodes.map((n) => el("div", {
    class: "cell", role: "button", tabindex: "0", "aria-label": `${n.name}: ${STATE_TEXT[n.state]}`,
    dataset: {node: n.name, state: n.state},
    style: n.state === "unknown" ? "" : `background:${ratioColour(n.ratio)};color:${inkOn(n.ratio)}`,
  }, GLYPH[n.state]));
  grid.append(...cells);
  grid.addEventListener("click", (e) => {
    const cell = e.target.closest(".cell");
    if (cell) location.hash = `#/node/${encodeURIComponent(cell.dataset.node)}`;
  });
  grid.addEventListener("mousemove", (e) => {
    const cell = e.target.closest(".cell");
    if (!cell) return hideTip();
    const n = byName.get(cell.dataset.node);
    showTip(e, `${n.name} \u2014 ${STATE_TEXT[n.state]}\nratio ${fmt(n.ratio)} (NVLink ${fmt(n.nvlink_ratio)}, ` +
               `network ${fmt(n.net_ratio)})\n${n.links} links, ${n.degraded_links} degraded, ` +
               `${n.open_findings} open findings\nprofile ${n.profile || "\u2013"}, last probed ${fmtTime(n.last_probed_at)}` +
               (n.occupied ? `\n${occupiedText(n.occupied)}` : ""));
  });
  grid.addEventListener("mouseleave", hideTip);

  function applyFilter() {
    const text = filterText.value.trim(), state = filterState.value;
    let match = (name) => name.includes(text);
    if (text.length > 2 && text.startsWith("/") && text.endsWith("/")) {
      try { const re = new RegExp(text.slice(1, -1)); match = (name) => re.test(name); } catch (err) { /* typing */ }
    }
    let shown = 0;
    for (const cell of cells) {
      const ok = (state === "all" || cell.dataset.state === state) && match(cell.dataset.node);
      cell.hidden = !ok;
      shown += ok;
    }
    count.textContent = `${shown} of ${nodes.length} nodes`;
    grid.classList.toggle("named", names.checked);
    // The choices live in the address: a refresh, a bookmark or a link keeps them.
    const kept = new URLSearchParams({...(text ? {q: text} : {}), ...(state !== "all" ? {state} : {}),
                                      names: names.checked ? "1" : "0"});
    history.replaceState(null, "", `#/fleet?${kept}`);
  }
  filterText.addEventListener("input", applyFilter);
  filterState.addEventListener("change", applyFilter);
  names.addEventListener("change", applyFilter);
  applyFilter();

  const incident = (f) => el("li", {},
    el("div", {}, el("span", {class: "kind"}, kindText(f)), ` \u00b7 ${f.severity ?? "\u2013"}`),
    el("div", {}, asList(f.nodes).map((n) => [el("a", {href: `#/node/${encodeURIComponent(n)}`}, listText(n)), " "]),
       f.detail && asList(f.detail.gpus).length ? gpusText(f.detail.gpus) : ""),
    el("div", {class: "headline"}, findingFigures(f)),
    el("div", {class: "muted"}, `opened ${fmtTime(f.opened_at)}`));
  const unreadable = (f) => el("li", {}, el("span", {class: "kind"}, kindText(f)), " (this record could not be shown in full)");
  const list = el("ul", {class: "incidents", id: "incidents"}, open.length
    ? open.map((f) => drawOr(incident, f, unreadable)) : el("li", {class: "muted"}, "No open incidents."));
  const counts = {};
  for (const n of nodes) counts[n.state] = (counts[n.state] || 0) + 1;
  view.replaceChildren(el("div", {class: "layout"},
    el("section", {class: "card"},
      el("h2", {}, "Fleet"),
      el("p", {class: "muted"}, Object.entries(counts).map(([s, c]) => `${c} ${s}`).join(" \u00b7 ")),
      el("div", {class: "filters"}, filterText, filterState,
         el("label", {}, names, " names"), count),
      grid, legend()),
    el("aside", {class: "card"}, el("h2", {}, `Open incidents (${open.length})`), list)));
  drawn("fleet");
}

// ---- a node: its GPU x GPU NVLink heatmap, links, NICs, inventory and counters
// The link last picked on a node's page, and the series range last chosen: a refresh keeps them.
let pickedLink = null;
let seriesRange = "24h";

async function nodeView(name) {
  const q = encodeURIComponent(name);
  const [node, intra, pairs, inter, states] = await Promise.all([
    get(`/v1/nodes/${q}`), get(`/v1/links?node=${q}&scope=intra_node`), get(`/v1/links?node=${q}&scope=gpu_pair`),
    get(`/v1/links?node=${q}&scope=inter_node`), get("/v1/fleet/nodes")]);
  const state = states.nodes.find((n) => n.name === name) || {state: "unknown"};
  const links = [...intra, ...pairs, ...inter].sort((a, b) => (a.ratio ?? 9) - (b.ratio ?? 9));
  const gpus = Math.max(node.gpus.length, ...pairs.flatMap((l) => l.members.map((m) => +m.split("/").pop() + 1)), 0);
  const seriesBox = el("div", {id: "series-box"});
  const table = linksTable(links, (link, row) => {
    for (const r of table.querySelectorAll("tr.selected")) r.classList.remove("selected");
    row.classList.add("selected");
    pickedLink = {node: name, group: link.group_key, op: link.op};
    seriesPanel(seriesBox, link, states.degraded_ratio[node.backend]);
  });
  view.replaceChildren(
    el("section", {class: "card"},
      el("h2", {}, `Node ${name} `, badge(state.state)),
      el("p", {class: "muted"}, `profile ${node.profile || "\u2013"} \u00b7 backend ${node.backend || "\u2013"} \u00b7 ` +
         `${node.gpus.length} GPUs \u00b7 last probed ${fmtTime(node.last_probed_at)} \u00b7 duty cycle ` +
         `${node.duty_cycle === null ? "\u2013" : (node.duty_cycle * 100).toFixed(3) + " %"}` +
         (node.occupied ? ` \u00b7 busy: ${occupiedText(node.occupied)}`
          : node.skipped_reason ? ` \u00b7 skipped: ${node.skipped_reason}` : ""))),
    el("div", {class: "two"},
      el("section", {class: "card"}, el("h3", {}, "NVLink: GPU \u00d7 GPU busbw over expected, %"),
         gpuHeatmap(name, gpus, pairs, intra), legend()),
      el("section", {class: "card"}, el("h3", {}, "Links (worst first; click for the series)"), table)),
    el("section", {class: "card"}, el("h3", {}, "Series"), seriesBox),
    el("div", {class: "two"},
      el("section", {class: "card"}, el("h3", {}, "NICs"), nicsTable(node.nics)),
      el("section", {class: "card"}, el("h3", {}, "Inventory"), inventoryTable(node.gpus))),
    el("section", {class: "card"}, el("h3", {}, "NVML counters (newest first)"), countersTable(node.counters)));
  // The worst link's series at once: a click on a degraded node opens its series; drawn
  // again (a refresh), the link picked before.
  const picked = [...table.querySelectorAll("tr.link-row")].find((r) => pickedLink && pickedLink.node === name
    && r.dataset.group === pickedLink.group && r.dataset.op === pickedLink.op);
  const first = picked || table.querySelector("tr.link-row");
  if (first) first.click();
  else { seriesBox.append(el("p", {class: "muted"}, "No links probed yet.")); drawn("node"); }
}

function linksTable(links, onPick) {
  const body = el("tbody", {});
  const table = el("table", {id: "links"}, el("thead", {}, el("tr", {},
    ["scope", "members", "op", "status", "busbw GB/s", "expected", "ratio"].map((h) => el("th", {}, h)))), body);
  for (const l of links) {
    const row = el("tr", {class: "link-row", dataset: {group: l.group_key, op: l.op, status: l.status}},
      el("td", {}, l.scope), el("td", {}, membersText(l.members)), el("td", {}, l.op),
      el("td", {}, linkBadge(l)), el("td", {}, fmt(l.busbw_gbs)), el("td", {}, fmt(l.expected_gbs)),
      el("td", {style: `background:${ratioColour(l.ratio)};color:${inkOn(l.ratio)}`}, fmt(l.ratio)));
    row.addEventListener("click", () => onPick(l, row));
    body.append(row);
  }
  if (!links.length) body.append(el("tr", {}, el("td", {colspan: 7, class: "muted"}, "none")));
  return table;
}

function gpuHeatmap(name, gpus, pairs, intra) {
  const cell = 34, pad = 28, size = pad + gpus * cell;
  const ratio = new Map(), status = new Map();
  for (const l of pairs) {
    const [a, b] = l.members.map((m) => +m.split("/").pop());
    for (const k of [`${a},${b}`, `${b},${a}`]) {
      if (!ratio.has(k) || (l.ratio ?? 9) < ratio.get(k)) ratio.set(k, l.ratio);
      if (l.status !== "ok") status.set(k, "degraded");
    }
  }
  const box = el("div", {});
  if (!gpus) return el("p", {class: "muted"}, "No GPUs reported.");
  const s = svg("svg", {width: size, height: size, id: "gpu-heatmap", role: "img",
                        "aria-label": `GPU by GPU busbw over expected on ${name}`});
  for (let i = 0; i < gpus; i++) {
    s.append(svg("text", {x: pad + i * cell + cell / 2, y: 18, "text-anchor": "middle"}, i));
    s.append(svg("text", {x: 18, y: pad + i * cell + cell / 2 + 4, "text-anchor": "end"}, i));
    for (let j = 0; j < gpus; j++) {
      const k = `${i},${j}`, x = pad + j * cell, y = pad + i * cell;
      if (i === j) { s.append(svg("rect", {x, y, width: cell - 2, height: cell - 2, fill: "#fff", stroke: "#d6dae1"})); continue; }
      const probed = ratio.has(k), r = ratio.get(k), bad = status.get(k) === "degraded";
      const rect = svg("rect", {x, y, width: cell - 2, height: cell - 2, fill: probed ? ratioColour(r) : NONE_COLOUR,
                                stroke: bad ? "#1d2330" : "none", "stroke-width": 2, "data-pair": k,
                                "data-status": probed ? (bad ? "degraded" : "ok") : "unprobed"});
      rect.addEventListener("mousemove", (e) => showTip(e, probed
        ? `${name} GPU ${i} \u2194 GPU ${j}\nratio ${fmt(r)}${bad ? " \u2014 degraded" : ""}`
        : `${name} GPU ${i} \u2194 GPU ${j}\nnot probed as a pair (only when the node is suspect)`));
      rect.addEventListener("mouseleave", hideTip);
      s.append(rect);
      const glyph = bad ? GLYPH.degraded : probed && r !== null ? String(Math.round(r * 100)) : "";
      if (glyph) s.append(svg("text", {x: x + cell / 2 - 1, y: y + cell / 2 + 3, "text-anchor": "middle",
                                       style: `fill:${inkOn(r)};pointer-events:none`}, glyph));
    }
  }
  box.append(s);
  const whole = intra.map((l) => `${l.op} ${fmt(l.ratio)} (${l.status})`).join(", ");
  box.append(el("p", {class: "muted"}, `Whole-node groups: ${whole || "none"}. ` +
    `${pairs.length ? "" : "No GPU pair probed: pairs are probed when a node is suspect."}`));
  return box;
}

function nicsTable(nics) {
  if (!nics || !nics.length) return el("p", {class: "muted"}, "No NICs reported (the nccl backend reads them on each node's first rank).");
  const cols = [...new Set(nics.flatMap((n) => Object.keys(n)))];
  return el("table", {id: "nics"}, el("thead", {}, el("tr", {}, cols.map((c) => el("th", {}, c)))),
    el("tbody", {}, nics.map((n) => el("tr", {}, cols.map((c) => el("td", {}, n[c] ?? "\u2013"))))));
}
function inventoryTable(gpus) {
  return el("table", {id: "inventory"}, el("thead", {}, el("tr", {},
    ["GPU", "name", "UUID", "PCI", "NUMA", "telemetry"].map((h) => el("th", {}, h)))),
    el("tbody", {}, gpus.map((g) => el("tr", {}, el("td", {}, g.local_index), el("td", {}, g.name ?? "\u2013"),
      el("td", {}, g.uuid ?? "\u2013"), el("td", {}, g.pci_bus_id ?? "\u2013"), el("td", {}, g.numa_node ?? "\u2013"),
      el("td", {}, el("details", {}, el("summary", {}, `${Object.keys(g.telemetry || {}).length} fields`),
                      el("pre", {}, JSON.stringify(g.telemetry, null, 1))))))));
}
function countersTable(counters) {
  if (!counters.length) return el("p", {class: "muted"}, "No counter rose in a stored cycle.");
  const skip = new Set(["time", "local_index"]);
  const cols = [...new Set(counters.flatMap((c) => Object.keys(c).filter((k) => !skip.has(k))))].slice(0, 8);
  return el("table", {id: "counters"}, el("thead", {}, el("tr", {}, ["time", "GPU", ...cols].map((c) => el("th", {}, c)))),
    el("tbody", {}, counters.map((c) => el("tr", {}, el("td", {}, fmtTime(c.time)), el("td", {}, c.local_index),
      cols.map((k) => el("td", {}, typeof c[k] === "object" ? JSON.stringify(c[k]) : c[k] ?? "\u2013"))))));
}

// ---- a link or group: busbw over a chosen range, the expected band and incidents marked
const RANGES = {"1h": 3600, "6h": 6 * 3600, "24h": 86400, "7d": 7 * 86400, "30d": 30 * 86400};

async function seriesPanel(box, link, degradedRatio, range = seriesRange) {
  const since = new Date(Date.now() - RANGES[range] * 1000).toISOString();
  const q = new URLSearchParams({group: link.group_key, op: link.op, size_bytes: link.size_bytes, since});
  const [series, findings] = await Promise.all([get(`/v1/series?${q}`), get("/v1/findings?limit=500")]);
  const nodes = new Set(link.nodes);
  const incidents = findings.filter((f) => asList(f.nodes).some((n) => nodes.has(n)));
  const picker = el("select", {id: "range"}, Object.keys(RANGES).map((r) => el("option", {value: r}, `last ${r}`)));
  picker.value = range;
  picker.addEventListener("change", () => { seriesRange = picker.value; seriesPanel(box, link, degradedRatio, picker.value); });
  box.replaceChildren(
    el("div", {class: "filters"}, el("strong", {}, `${link.scope} ${link.op} `), membersText(link.members),
       linkBadge(link), el("span", {class: "muted"}, `at ${fmtBytes(link.size_bytes)}`), picker,
       el("a", {href: `#/series?group=${encodeURIComponent(link.group_key)}&op=${encodeURIComponent(link.op)}`}, "open on its own")),
    seriesChart(series.points, link, degradedRatio ?? 0.7, incidents, Date.parse(since)),
    el("p", {class: "muted"}, `${series.points.length} points (${series.resolution}); band: expected ` +
       `${fmt(link.expected_gbs)} GB/s down to the degraded threshold (\u00d7${degradedRatio ?? 0.7}); ` +
       `${incidents.length} incident(s) on its nodes marked.`));
  drawn("series");
}

function seriesChart(points, link, degradedRatio, incidents, since) {
  const W = 760, H = 260, L = 52, R = 12, T = 12, B = 28;
  // Drawn in W x H units, shrunk to a narrower card (.chart's max-width).
  const s = svg("svg", {width: W, height: H, viewBox: `0 0 ${W} ${H}`, class: "chart", id: "series-chart", "data-points": points.length, role: "img",
                        "aria-label": `busbw series of ${link.group_key}`});
  if (!points.length) {
    s.append(svg("text", {x: W / 2, y: H / 2, "text-anchor": "middle"}, "no points in this range"));
    return s;
  }
  // The time axis spans the points (a little margin each side), not the whole range
  // asked: a few hours of points in a 30-day range stay readable.
  const times = points.map((p) => Date.parse(p.time));
  const first = Math.max(since, Math.min(...times)), last = Math.max(...times);
  const margin = Math.max(60_000, (last - first) * 0.05);
  const t0 = first - margin, t1 = last + margin;
  const expected = link.expected_gbs;
  const ymax = Math.max(...points.map((p) => p.busbw_max ?? p.busbw_gbs), expected || 0) * 1.1 || 1;
  const x = (t) => L + (W - L - R) * (t - t0) / Math.max(1, t1 - t0);
  const y = (v) => T + (H - T - B) * (1 - v / ymax);
  for (const f of incidents) {
    const a = Math.max(t0, Date.parse(f.opened_at)), b = Math.min(t1, f.resolved_at ? Date.parse(f.resolved_at) : t1);
    if (a > t1 || b < t0) continue;
    const g = svg("g", {class: "incident-group"},
      svg("rect", {class: "incident", x: x(a), y: T, width: Math.max(2, x(b) - x(a)), height: H - T - B}),
      svg("line", {class: "incident-mark", x1: x(a), x2: x(a), y1: T, y2: H - B}),
      svg("text", {x: x(a) + 3, y: T + 10}, `\u2715 ${f.kind}`));
    g.addEventListener("mousemove", (e) => showTip(e, `${f.kind} (${f.status})\nopened ${fmtTime(f.opened_at)}` +
      (f.resolved_at ? `\nresolved ${fmtTime(f.resolved_at)}` : "")));
    g.addEventListener("mouseleave", hideTip);
    s.append(g);
  }
  if (expected) {
    s.append(svg("rect", {class: "band", x: L, width: W - L - R, y: y(expected), height: y(expected * degradedRatio) - y(expected)}));
    s.append(svg("line", {class: "expected", x1: L, x2: W - R, y1: y(expected), y2: y(expected)}));
  }
  for (let i = 0; i <= 4; i++) {
    const v = ymax * i / 4;
    s.append(svg("line", {class: "axis", x1: L - 4, x2: L, y1: y(v), y2: y(v)}),
             svg("text", {x: L - 6, y: y(v) + 4, "text-anchor": "end"}, fmt(v, 0)));
  }
  s.append(svg("text", {x: 4, y: T + 10}, "GB/s"), svg("line", {class: "axis", x1: L, x2: L, y1: T, y2: H - B}),
           svg("line", {class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B}),
           svg("text", {x: L, y: H - 8}, fmtTime(t0)), svg("text", {x: W - R, y: H - 8, "text-anchor": "end"}, fmtTime(t1)));
  const pts = points.map((p) => [x(Date.parse(p.time)), y(p.busbw_gbs)]);
  s.append(svg("polyline", {class: "line", points: pts.map((p) => p.join(",")).join(" ")}));
  points.forEach((p, i) => {
    const low = expected && p.busbw_gbs < expected * degradedRatio;
    const [cx, cy] = pts[i];
    // Below the band: a cross, not only a darker dot.
    const mark = low
      ? svg("path", {d: `M${cx - 4},${cy - 4}L${cx + 4},${cy + 4}M${cx - 4},${cy + 4}L${cx + 4},${cy - 4}`,
                     stroke: "#00204d", "stroke-width": 2.5, class: "point low"})
      : svg("circle", {cx, cy, r: 3, fill: "#bcaf6f", stroke: "#414d6b", class: "point"});
    const hit = svg("circle", {cx, cy, r: 7, fill: "transparent"});
    hit.addEventListener("mousemove", (e) => showTip(e, `${fmtTime(p.time)}\nbusbw ${fmt(p.busbw_gbs)} GB/s` +
      (expected ? ` (${fmt(p.busbw_gbs / expected)} of expected)` : "") + `\n${p.op} at ${fmtBytes(p.size_bytes)}` +
      (p.count ? `, ${p.count} probes, ${fmt(p.busbw_min)}\u2013${fmt(p.busbw_max)}` : "")));
    hit.addEventListener("mouseleave", hideTip);
    s.append(mark, hit);
  });
  return s;
}

async function seriesView(params) {
  let link;
  if (params.get("pair")) {
    const [a, b] = params.get("pair").split(",");
    const links = await get(`/v1/links?node=${encodeURIComponent(a)}&scope=inter_node`);
    const found = links.filter((l) => l.nodes.length === 2 && l.nodes.includes(b)).sort((p, q) => (p.ratio ?? 9) - (q.ratio ?? 9));
    link = found[0];
    if (!link) throw new Error(`no probed link between ${a} and ${b}`);
  } else {
    const group = params.get("group"), op = params.get("op");
    const series = await get(`/v1/series?${new URLSearchParams({group, op, limit: 1})}`);
    const first = series.members[0].slice(0, series.members[0].lastIndexOf("/"));
    const links = await get(`/v1/links?node=${encodeURIComponent(first)}`);
    link = links.find((l) => l.group_key === group && l.op === op);
    if (!link) throw new Error(`no link ${group} ${op}`);
  }
  const states = await get("/v1/fleet/nodes");
  const backend = (states.nodes.find((n) => n.name === link.nodes[0]) || {}).backend;
  const box = el("div", {id: "series-box"});
  view.replaceChildren(el("section", {class: "card"}, el("h2", {}, "Series"),
    el("p", {}, link.nodes.slice(0, 8).map((n) => [el("a", {href: `#/node/${encodeURIComponent(n)}`}, n), " "])), box));
  await seriesPanel(box, link, states.degraded_ratio[backend]);
}

// ---- the network: node x node, the pairs probed and which were not yet, zoomable
// Axis labels: the least pixels a label takes, and the steps between labelled nodes.
const AXIS_LABEL_PX = 13;
const AXIS_STEPS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000];
let networkZoom = null;
async function networkView() {
  const data = await get("/v1/fleet/pairs");
  const n = data.nodes.length;
  // One byte per pair, upper triangle row by row (GET /v1/fleet/pairs): 0 not probed,
  // 0x80 degraded, low seven bits 1 + ratio in hundredths (127: no ratio).
  const raw = atob(data.cells);
  const cells = new Uint8Array(raw.length);
  for (let k = 0; k < raw.length; k++) cells[k] = raw.charCodeAt(k);
  const ratioOf = (b) => ((b & 0x7f) === 127 ? null : ((b & 0x7f) - 1) / 100);
  function pairAt(r, c) {
    if (r === c || r < 0 || c < 0 || r >= n || c >= n) return null;
    const i = Math.min(r, c), j = Math.max(r, c);
    const b = cells[i * n - i * (i + 1) / 2 + (j - i - 1)];
    return b ? [ratioOf(b), (b & 0x80) !== 0] : null;
  }
  // One pixel per pair in an offscreen image; the view scales a window of it.
  const img = document.createElement("canvas");
  img.width = img.height = Math.max(1, n);
  const ictx = img.getContext("2d");
  const pixels = ictx.createImageData(Math.max(1, n), Math.max(1, n));
  const px32 = new Uint32Array(pixels.data.buffer);
  const abgr = ([r, g, b]) => ((255 << 24) | (b << 16) | (g << 8) | r) >>> 0;  // little-endian RGBA
  const palette = new Uint32Array(128);
  for (let q = 1; q < 128; q++) palette[q] = abgr(ratioRgb(q === 127 ? RATIO_HI : (q - 1) / 100));
  const none = abgr([228, 230, 234]), white = abgr([255, 255, 255]);
  const degraded = [];
  let probed = 0;
  for (let i = 0, k = 0; i < n; i++) {
    px32[i * n + i] = white;
    for (let j = i + 1; j < n; j++, k++) {
      const b = cells[k];
      const colour = b ? palette[b & 0x7f] : none;
      px32[i * n + j] = colour;
      px32[j * n + i] = colour;
      if (b) probed++;
      if (b & 0x80) degraded.push([i, j, ratioOf(b)]);
    }
  }
  ictx.putImageData(pixels, 0, 0);

  // Sized to the card it sits in once it is on the page (below), so the page fits its window.
  let SIZE = 300;
  const canvas = el("canvas", {class: "matrix", id: "network-matrix", width: SIZE, height: SIZE});
  const ctx = canvas.getContext("2d");
  // The window shown: first column, row, and how many; a refresh of the same fleet keeps it.
  let z = networkZoom && networkZoom.n === n ? networkZoom.z : {x: 0, y: 0, span: Math.max(1, n)};
  // Node names on both axes, as many as fit: every step-th node, the step a round number.
  const rowAxis = el("div", {class: "axis-rows", id: "matrix-rows"});
  const colAxis = el("div", {class: "axis-cols", id: "matrix-cols"});
  function drawAxes() {
    const px = SIZE / z.span;
    const step = AXIS_STEPS.find((s) => s * px >= AXIS_LABEL_PX) || Math.ceil(AXIS_LABEL_PX / px);
    const rows = [], cols = [];
    for (let i = Math.ceil(z.y / step) * step; i < Math.min(n, z.y + z.span); i += step) {
      rows.push(el("span", {title: data.nodes[i], dataset: {index: i}, style: `top:${(i - z.y + 0.5) * px}px`}, data.nodes[i]));
    }
    for (let i = Math.ceil(z.x / step) * step; i < Math.min(n, z.x + z.span); i += step) {
      cols.push(el("span", {title: data.nodes[i], dataset: {index: i}, style: `left:${(i - z.x + 0.5) * px}px`}, data.nodes[i]));
    }
    rowAxis.replaceChildren(...rows);
    colAxis.replaceChildren(...cols);
    rowAxis.dataset.step = colAxis.dataset.step = String(step);
  }
  function draw() {
    networkZoom = {n, z};
    drawAxes();
    ctx.imageSmoothingEnabled = false;
    ctx.clearRect(0, 0, SIZE, SIZE);
    ctx.drawImage(img, z.x, z.y, z.span, z.span, 0, 0, SIZE, SIZE);
    const px = SIZE / z.span;
    // Degraded pairs: a ring (shape, not only colour), at every zoom.
    for (const [i, j] of degraded) for (const [r, c] of [[i, j], [j, i]]) {
      if (c < z.x || c >= z.x + z.span || r < z.y || r >= z.y + z.span) continue;
      for (const [colour, width] of [["#fff", 4], ["#1d2330", 2]]) {
        ctx.strokeStyle = colour; ctx.lineWidth = width;
        ctx.beginPath();
        ctx.arc((c - z.x + 0.5) * px, (r - z.y + 0.5) * px, Math.max(5, px * 0.3), 0, 2 * Math.PI);
        ctx.stroke();
      }
    }
    if (px >= 14) {  // close enough to read: the ratio in each probed cell
      ctx.font = `${Math.min(12, px / 3)}px system-ui`; ctx.textAlign = "center";
      for (let r = Math.floor(z.y); r < Math.min(n, z.y + z.span); r++) for (let c = Math.floor(z.x); c < Math.min(n, z.x + z.span); c++) {
        const found = pairAt(r, c);
        if (!found) continue;
        ctx.fillStyle = inkOn(found[0]);
        ctx.fillText(found[1] ? GLYPH.degraded : fmt(found[0]), (c - z.x + 0.5) * px, (r - z.y + 0.5) * px + 4);
      }
    }
    zoomText.textContent = `showing ${Math.round(z.span)} \u00d7 ${Math.round(z.span)} nodes`;
  }
  const at = (e) => {
    const rect = canvas.getBoundingClientRect(), px = SIZE / z.span;
    return [Math.floor(z.y + (e.clientY - rect.top) / px), Math.floor(z.x + (e.clientX - rect.left) / px)];
  };
  function zoom(factor, cx = z.x + z.span / 2, cy = z.y + z.span / 2) {
    const span = Math.min(n, Math.max(4, z.span * factor));
    z = {span, x: Math.min(n - span, Math.max(0, cx - (cx - z.x) * span / z.span)),
         y: Math.min(n - span, Math.max(0, cy - (cy - z.y) * span / z.span))};
    draw();
  }
  canvas.addEventListener("wheel", (e) => {
    e.preventDefault();
    const [r, c] = at(e);
    zoom(e.deltaY < 0 ? 0.5 : 2, c, r);
  }, {passive: false});
  let drag = null;
  canvas.addEventListener("mousedown", (e) => { drag = {x: e.clientX, y: e.clientY, z: {...z}, moved: false}; });
  window.addEventListener("mouseup", () => { setTimeout(() => { drag = null; }, 0); }, {signal: viewListeners.signal});
  canvas.addEventListener("mousemove", (e) => {
    if (drag && (e.buttons & 1)) {
      const px = SIZE / z.span, dx = (e.clientX - drag.x) / px, dy = (e.clientY - drag.y) / px;
      if (Math.abs(dx) + Math.abs(dy) > 0.5) drag.moved = true;
      z = {...z, x: Math.min(n - z.span, Math.max(0, drag.z.x - dx)), y: Math.min(n - z.span, Math.max(0, drag.z.y - dy))};
      draw();
      return;
    }
    const [r, c] = at(e);
    if (r < 0 || c < 0 || r >= n || c >= n) return hideTip();
    const found = pairAt(r, c);
    showTip(e, `${data.nodes[r]} \u2194 ${data.nodes[c]}\n` + (r === c ? "same node" : found
      ? `ratio ${fmt(found[0])}${found[1] ? " \u2014 degraded" : ""}\nclick for its series` : "not probed as a pair yet"));
  });
  canvas.addEventListener("mouseleave", hideTip);
  canvas.addEventListener("click", (e) => {
    if (drag && drag.moved) return;
    const [r, c] = at(e);
    if (pairAt(r, c))
      location.hash = `#/series?pair=${encodeURIComponent(data.nodes[r])},${encodeURIComponent(data.nodes[c])}`;
  });
  const zoomText = el("span", {class: "muted", id: "zoom"});
  const total = n * (n - 1) / 2;
  view.replaceChildren(el("div", {class: "layout"},
    el("section", {class: "card"}, el("h2", {}, "Network: node \u00d7 node"),
      el("p", {class: "muted", id: "coverage"}, `${n} nodes \u00b7 ${probed} of ${total} pairs probed ` +
         `(${total ? (100 * probed / total).toFixed(1) : 0} %) \u00b7 ${degraded.length} degraded; ` +
         "grey: not probed as a pair yet. Wheel or buttons to zoom, drag to pan."),
      el("div", {class: "filters"}, el("button", {type: "button", onclick: () => zoom(0.5)}, "zoom in"),
         el("button", {type: "button", onclick: () => zoom(2)}, "zoom out"),
         el("button", {type: "button", onclick: () => { z = {x: 0, y: 0, span: Math.max(1, n)}; draw(); }}, "whole fleet"), zoomText),
      el("div", {class: "matrix-frame"}, el("div", {}), colAxis, rowAxis, canvas), legend()),
    el("aside", {class: "card"}, el("h2", {}, `Degraded pairs (${degraded.length})`),
      el("ul", {class: "incidents", id: "degraded-pairs"}, degraded.length ? degraded.slice(0, 200).map(([i, j, r]) => el("li", {},
        el("a", {href: `#/series?pair=${encodeURIComponent(data.nodes[i])},${encodeURIComponent(data.nodes[j])}`},
           `\u2715 ${data.nodes[i]} \u2194 ${data.nodes[j]}`), ` ratio ${fmt(r)}`)) : el("li", {class: "muted"}, "none")))));
  // The map takes the card's width (at most 800 px), less the row labels.
  const card = canvas.closest(".card"), pad = getComputedStyle(card);
  SIZE = Math.max(160, Math.min(800, Math.floor(card.clientWidth - parseFloat(pad.paddingLeft) -
                                               parseFloat(pad.paddingRight) - rowAxis.offsetWidth)));
  canvas.width = canvas.height = SIZE;
  draw();
  drawn("network");
}

// ---- preflight: nodes or a hostfile, a profile, and the verdict
function hostfileNodes(text) {
  // One host per line ("host slots=8", "host:8" or "host"); # starts a comment.
  return text.split("\n").map((l) => l.replace(/#.*/, "").trim()).filter(Boolean)
    .map((l) => l.split(/\s+/)[0].split(":")[0]);
}

// Node names or Slurm host lists (node-[000-004],gpu[1-2]b): split at spaces, lines and the
// commas outside brackets; the API expands each host list by the command line's rules.
function nodeItems(text) {
  const items = [];
  let depth = 0, item = "";
  for (const c of text) {
    if (c === "[") depth++;
    else if (c === "]") depth--;
    if (depth <= 0 && (c === "," || /\s/.test(c))) {
      if (item) items.push(item);
      item = "";
    } else item += c;
  }
  if (item) items.push(item);
  return items;
}

function preflightView() {
  const nodes = el("textarea", {id: "pf-nodes", placeholder: "node-000, node-001 \u2026 or node-[000-015] (commas, spaces or lines)"});
  const hostfile = el("input", {type: "file", id: "pf-hostfile"});
  hostfile.addEventListener("change", async () => {
    const file = hostfile.files[0];
    if (file) nodes.value = hostfileNodes(await file.text()).join("\n");
  });
  const profile = el("select", {id: "pf-profile"}, ["", "ddp", "fsdp", "moe", "pipeline"].map((p) =>
    el("option", {value: p}, p || "none (fabric check only)")));
  const maxAge = el("input", {type: "number", id: "pf-max-age", value: 900, min: 1});
  const confirm = el("input", {type: "checkbox", id: "pf-confirm"});
  const out = el("div", {id: "verdict"});
  const form = el("form", {class: "preflight", id: "preflight-form"},
    el("label", {for: "pf-nodes"}, "Nodes"), nodes,
    el("label", {for: "pf-hostfile"}, "or a hostfile"), hostfile,
    el("label", {for: "pf-profile"}, "Profile"), profile,
    el("label", {for: "pf-max-age"}, "Max age (s)"), maxAge,
    el("label", {for: "pf-confirm"}, "Re-probe if unhealthy"), confirm,
    el("span", {}), el("button", {type: "submit"}, "Check"));
  form.addEventListener("submit", async (e) => {
    e.preventDefault();
    const list = [...new Set((nodes.value.includes("\n") && /slots|:/.test(nodes.value)
      ? hostfileNodes(nodes.value) : nodeItems(nodes.value)).filter(Boolean))];
    const body = {nodes: list, max_age_s: +maxAge.value, confirm: confirm.checked};
    if (profile.value) body.profile = profile.value;
    const named = list.some((i) => i.includes("[")) ? list.join(", ").slice(0, 200) : `${list.length} node(s)`;
    out.replaceChildren(el("p", {class: "muted"}, `Checking ${named}\u2026`));
    try {
      let {status, body: v} = await api("/v1/preflight?wait=5", {method: "POST", body: JSON.stringify(body)});
      while (status === 202) {
        out.replaceChildren(el("p", {class: "muted", id: "pf-waiting"}, `Request ${v.id}: ${v.status}, waiting for a scheduler to probe\u2026`));
        await new Promise((r) => setTimeout(r, 2000));
        ({status, body: v} = await api(`/v1/preflight/${v.id}`));
      }
      out.replaceChildren(verdictCard(v));
    } catch (err) {
      if (err instanceof Refused) return showLogin(`Token refused: ${err.message}`);
      out.replaceChildren(el("p", {class: "error", id: "pf-error"}, `Preflight refused: ${err.message}`));
    }
    drawn("verdict");
  });
  view.replaceChildren(el("section", {class: "card"}, el("h2", {}, "Preflight"),
    el("p", {class: "muted"}, "May a job launch on these nodes? Answered at once from fresh results, " +
       "or after a scheduler probes them (always, with a profile)."), form), out);
  drawn("preflight");
}

function verdictCard(v) {
  if (v.status === "failed" || v.error) return el("section", {class: "card"}, el("p", {class: "error"}, `Failed: ${v.error}`));
  const healthy = v.healthy;
  const row = (f) => el("tr", {}, el("td", {}, f.kind), el("td", {}, findingPlace({detail: f, nodes: f.nodes})),
    el("td", {}, f.severity || "\u2013"), el("td", {class: "headline"}, findingFigures(f)));
  const unreadable = (f) => el("tr", {}, el("td", {}, kindText(f)), el("td", {colspan: 3}, "could not be shown in full"));
  const rows = asList(v.findings).map((f) => drawOr(row, f, unreadable));
  return el("section", {class: "card", id: "verdict-card", "data-healthy": String(healthy)},
    el("div", {class: `badge verdict ${healthy ? "good" : "bad"}`}, healthy ? "\u2713 healthy: may launch" : "\u2715 unhealthy"),
    el("p", {}, `${v.nodes_checked ?? "?"} node(s) checked \u00b7 source ${v.source || "\u2013"} \u00b7 backend ${v.backend || "\u2013"}` +
       (v.rounds !== undefined ? ` \u00b7 ${v.rounds} rounds` : "")),
    el("p", {id: "pf-exclude"}, asList(v.exclude).length ? `Exclude: ${nodeList(v.exclude)}` : "Exclude: none"),
    rows.length ? el("table", {}, el("thead", {}, el("tr", {}, ["finding", "where", "severity", "busbw"].map((h) => el("th", {}, h)))),
                     el("tbody", {}, rows)) : el("p", {class: "muted"}, "No findings."),
    v.workload ? el("details", {}, el("summary", {}, `workload: ${v.workload.profile}`), el("pre", {}, JSON.stringify(v.workload, null, 1))) : null);
}

route();

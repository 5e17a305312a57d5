// The operator's console. Plain JavaScript, no build step, nothing fetched from elsewhere.
// Every call goes to /admin/* on this origin with the administrator key as a bearer token;
// the key lives in this tab's sessionStorage only. Everything the API returns is shown with
// textContent (agents and tenants name things; none of it is ever parsed as HTML).
"use strict";

const KEY = "hivenet-console-admin-key";
const POLL_MS = 5000;
const CALL_MS = 15000; // an admin call with no answer by then is abandoned, and said so
const state = { view: "fleet", timer: null, stream: null, requestsBefore: null, requestsAt: null,
  ledgerBefore: null, ledgerTenant: null, pending: null, loading: new Set() };

const $ = (id) => document.getElementById(id);

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (name === "text") node.textContent = String(value);
    else if (name === "className") node.className = value;
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function show(id, message) {
  const node = $(id);
  node.textContent = message || "";
  node.hidden = !message;
}

// -- the API --------------------------------------------------------------------------------

class ApiFailure extends Error {
  constructor(status, body) {
    super(describe(status, body));
    this.status = status;
    this.body = body;
  }
}

// The API's own words: {"error": "..."} or the envelope {"error": {"message", "code"}}.
function describe(status, body) {
  const error = body && body.error;
  if (typeof error === "string") return `${status}: ${error}`;
  if (error && typeof error === "object") {
    const code = error.code ? ` (${error.code})` : "";
    return `${status}${code}: ${error.message || JSON.stringify(error)}`;
  }
  return `${status}: ${body && body.raw ? body.raw.slice(0, 300) : "no answer"}`;
}

async function api(method, path, body, type) {
  const key = sessionStorage.getItem(KEY);
  const headers = { Authorization: `Bearer ${key || ""}` };
  if (body !== undefined) headers["Content-Type"] = type || "application/json";
  let answer;
  let text;
  const abort = new AbortController();
  const timer = setTimeout(() => abort.abort(), CALL_MS);
  try {
    answer = await fetch(path, { method, headers, body, cache: "no-store",
      credentials: "omit", redirect: "error", signal: abort.signal });
    text = await answer.text();
  } catch (error) {
    const why = abort.signal.aborted ? `no answer within ${CALL_MS / 1000} s` : error.message;
    throw new ApiFailure(0, { raw: `the router did not answer (${why})` });
  } finally {
    clearTimeout(timer);
  }
  // Signed out while the call was out: what it brought is shown nowhere.
  if (!sessionStorage.getItem(KEY)) throw new ApiFailure(0, { raw: "signed out" });
  let parsed;
  try { parsed = text ? JSON.parse(text) : {}; } catch (error) { parsed = { raw: text }; }
  if (answer.status === 401) signOut("Refused: " + describe(401, parsed));
  if (!answer.ok) throw new ApiFailure(answer.status, parsed);
  return parsed;
}

// -- signing in and out ---------------------------------------------------------------------

async function signIn(event) {
  event.preventDefault();
  const input = $("admin-key");
  const key = input.value;
  input.value = "";
  if (!key) return;
  show("signin-error", "");
  sessionStorage.setItem(KEY, key);
  try {
    await api("GET", "/admin/health");
  } catch (error) {
    signOut("Refused: " + error.message);
    return;
  }
  enter();
}

function enter() {
  $("signin").hidden = true;
  $("tabs").hidden = false;
  $("signout").hidden = false;
  select(state.view);
  follow();
}

function signOut(message) {
  sessionStorage.removeItem(KEY);
  state.requestsAt = null;
  if (state.stream) state.stream.abort();
  state.stream = null;
  clearInterval(state.timer);
  state.timer = null;
  for (const view of document.querySelectorAll(".view")) view.hidden = true;
  for (const id of ["fleet-table", "models-table", "keys-table", "usage-table", "requests-table",
    "ledger-table"]) {
    $(id).tBodies[0].replaceChildren();
  }
  for (const id of ["policies-list", "site-body", "refusals", "traffic-summary", "traffic-minutes",
    "traffic-errors", "wallet-balance", "keys-mode", "fleet-summary", "credit-result"]) {
    $(id).replaceChildren();
  }
  state.ledgerTenant = null;
  $("wallet").hidden = true;
  $("tabs").hidden = true;
  $("signout").hidden = true;
  $("signin").hidden = false;
  show("signin-error", typeof message === "string" ? message : "");
  $("admin-key").focus();
}

// -- views ----------------------------------------------------------------------------------

const VIEWS = {
  fleet: loadFleet, policies: loadPolicies, tenants: loadTenants, traffic: loadTraffic,
  site: loadSite,
};

function select(view) {
  state.view = view;
  for (const tab of document.querySelectorAll(".tab")) {
    if (tab.dataset.view === view) tab.setAttribute("aria-current", "page");
    else tab.removeAttribute("aria-current");
  }
  for (const section of document.querySelectorAll(".view")) {
    section.hidden = section.id !== `view-${view}`;
  }
  refresh();
  clearInterval(state.timer);
  state.timer = null;
  if (!document.hidden) {
    state.timer = setInterval(() => { if (view !== "policies") refresh(); }, POLL_MS);
  }
}

// A hidden tab polls nothing; shown again, its view is read at once and polled again.
document.addEventListener("visibilitychange", () => {
  if (!sessionStorage.getItem(KEY) || $("tabs").hidden) return;
  if (document.hidden) {
    clearInterval(state.timer);
    state.timer = null;
  } else {
    select(state.view);
  }
});

// One read at a time per view: a slow view never holds another back.
async function refresh() {
  const view = state.view;
  if (state.loading.has(view) || document.hidden || !sessionStorage.getItem(KEY)) return;
  state.loading.add(view);
  try {
    await VIEWS[view]();
    show(`${view}-error`, "");
  } catch (error) {
    if (sessionStorage.getItem(KEY)) show(`${view}-error`, error.message);
  } finally {
    state.loading.delete(view);
  }
}

// -- fleet ----------------------------------------------------------------------------------

function pill(text, kind) { return el("span", { className: `pill ${kind}`, text }); }

function ms(value) { return value === null || value === undefined ? "–" : `${Math.round(value)} ms`; }

function percent(value) {
  return value === null || value === undefined ? "–" : `${Math.round(value * 100)}%`;
}

function agentRow(agent) {
  const meta = agent.metadata || {};
  const health = agent.health || {};
  const engine = agent.engine || {};
  const breaker = (agent.breaker && agent.breaker.state) || "–";
  const where = [meta.region, ...(meta.tags || [])].filter(Boolean).join(", ") || "–";
  const healthPill = !health.connected ? pill("disconnected", "bad")
    : health.process_healthy && health.backend_healthy ? pill("healthy", "good")
    : pill("unhealthy", "bad");
  const draining = health.draining;
  const action = el("button", { type: "button", className: "secondary drain",
    "data-peer": agent.peer_id, "data-drain": draining ? "undrain" : "drain",
    text: draining ? "Undrain" : "Drain" });
  return el("tr", { "data-peer": agent.peer_id },
    el("td", { className: "mono peer", text: agent.peer_id }),
    el("td", { className: "model", text: meta.model }),
    el("td", { text: `${meta.engine || ""} ${meta.version || ""}`.trim() }),
    el("td", { text: where }),
    el("td", { className: "health" }, healthPill),
    el("td", { className: "drain-state" },
      health.stopping ? pill("stopping", "warn")
        : draining ? pill("draining", "warn") : pill("in pool", "good")),
    el("td", { className: "inflight", text: `${agent.active_requests} / ${agent.capacity}` }),
    el("td", { text: ms(agent.universal && agent.universal.srtt_ms) }),
    el("td", { text: percent(engine.kv_cache_utilization) }),
    el("td", { className: "breaker" },
      pill(breaker, breaker === "closed" ? "good" : breaker === "–" ? "" : "bad")),
    el("td", {}, action));
}

async function loadFleet() {
  const table = await api("GET", "/admin/routing-table");
  const agents = (table.agents || []).slice().sort((a, b) => a.peer_id < b.peer_id ? -1 : 1);
  // The table is redrawn at each change: a keyboard user's focus stays on the same button.
  const focused = document.activeElement;
  const peer = focused && focused.matches("button.drain") ? focused.dataset.peer : null;
  $("fleet-table").tBodies[0].replaceChildren(...agents.map(agentRow));
  if (peer !== null) {
    const again = [...document.querySelectorAll("button.drain")].find((b) => b.dataset.peer === peer);
    if (again) again.focus();
  }
  $("fleet-empty").hidden = agents.length > 0;
  const up = agents.filter((a) => a.health && a.health.eligible).length;
  $("fleet-summary").textContent = `${agents.length} agents, ${up} taking requests`;
}

function askDrain(button) {
  const peer = button.dataset.peer;
  const verb = button.dataset.drain;
  state.pending = { peer, verb, button };
  $("confirm-text").textContent = verb === "drain"
    ? `Drain ${peer}? It takes no new requests; those in flight finish.`
    : `Undrain ${peer}? It goes back into the pool.`;
  $("confirm-yes").textContent = verb === "drain" ? "Drain" : "Undrain";
  $("confirm").showModal();
  $("confirm-no").focus();
}

async function confirmed() {
  const pending = state.pending;
  $("confirm").close();
  state.pending = null;
  if (!pending) return;
  try {
    await api("POST", `/admin/agents/${encodeURIComponent(pending.peer)}/${pending.verb}`);
    await loadFleet();
    show("fleet-error", "");
  } catch (error) {
    show("fleet-error", error.message);
  }
}

// The registration stream: server-sent events read through fetch (an EventSource cannot
// send the key). Each change reloads the table; polling covers what the stream does not
// announce (requests in flight, SRTT).
async function follow() {
  if (state.stream) return;
  const controller = new AbortController();
  state.stream = controller;
  const live = $("fleet-live");
  try {
    const answer = await fetch("/admin/registration-stream", { cache: "no-store",
      credentials: "omit", signal: controller.signal,
      headers: { Authorization: `Bearer ${sessionStorage.getItem(KEY) || ""}` } });
    if (!answer.ok || !answer.body) throw new Error(`status ${answer.status}`);
    live.textContent = "(live)";
    const reader = answer.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        if (event.startsWith("data:") && state.view === "fleet") refresh();
      }
    }
  } catch (error) {
    if (controller.signal.aborted) return;
  }
  if (state.stream === controller) {
    state.stream = null;
    live.textContent = "(polling)";
    if (sessionStorage.getItem(KEY)) setTimeout(follow, POLL_MS);
  }
}

// -- models and policies --------------------------------------------------------------------

async function loadPolicies() {
  const [health, named, global] = await Promise.all([
    api("GET", "/admin/health"), api("GET", "/admin/policy/models"), api("GET", "/admin/policy"),
  ]);
  const owner = {};
  for (const [name, models] of Object.entries(named)) for (const m of models) owner[m] = name;
  const rows = Object.entries(health.models || {}).map(([model, load]) => el("tr", {},
    el("td", { text: model }), el("td", { text: load.agents }), el("td", { text: load.eligible }),
    el("td", { text: `${load.active_requests} / ${load.capacity}` }),
    el("td", { text: load.waiting_for_capacity }),
    el("td", { text: owner[model] || "global" })));
  $("models-table").tBodies[0].replaceChildren(...rows);
  const details = [policyBlock("global", global)];
  for (const name of Object.keys(named).sort()) {
    details.push(policyBlock(name, await api("GET", `/admin/policy/models/${encodeURIComponent(name)}`)));
  }
  $("policies-list").replaceChildren(...details);
  const target = $("policy-target");
  const chosen = target.value;
  target.replaceChildren(el("option", { value: "", text: "global" }),
    ...Object.keys(named).sort().map((name) => el("option", { value: name, text: name })));
  target.value = chosen in named ? chosen : "";
}

function policyBlock(name, policy) {
  return el("details", { "data-policy": name },
    el("summary", { text: `${name}: ${policy.source || ""}` }),
    el("pre", { text: JSON.stringify(policy, null, 2) }));
}

// "body:3: routing_policy.strategy: unknown strategy ..." -> line 3, field routing_policy.strategy
function locate(message) {
  const found = /body:(\d+):\s*([A-Za-z0-9_.\[\]-]+):/.exec(message || "");
  return found ? { line: found[1], field: found[2] } : null;
}

async function writePolicy(dryRun) {
  const name = $("policy-name").value.trim() || $("policy-target").value;
  const path = name ? `/admin/policy/models/${encodeURIComponent(name)}` : "/admin/policy";
  const out = $("policy-result");
  out.replaceChildren(el("p", { className: "muted", text: dryRun ? "Validating…" : "Applying…" }));
  try {
    const answer = await api("PUT", path + (dryRun ? "?dry_run=true" : ""),
      $("policy-text").value, "application/yaml");
    const when = new Date().toLocaleTimeString();
    out.replaceChildren(el("p", { className: "ok", id: "policy-ok",
      text: dryRun ? `Valid: ${name || "global"} would apply as written.`
        : `Applied ${name || "global"} at ${when}: ${answer.status}.` }));
    if (!dryRun) await loadPolicies();
  } catch (error) {
    const where = locate(error.body && error.body.error && error.body.error.message);
    out.replaceChildren(el("p", { className: "error", id: "policy-error", role: "alert",
      text: error.message }),
    where ? el("p", { id: "policy-where", text: `Line ${where.line}, field ${where.field}` }) : null);
  }
  out.scrollIntoView({ block: "nearest" });
}

// -- tenants --------------------------------------------------------------------------------

function limits(quota) {
  if (!quota || typeof quota !== "object") return "–";
  return Object.entries(quota).filter(([, v]) => v !== null && v !== 0)
    .map(([k, v]) => `${k}: ${typeof v === "object" ? JSON.stringify(v) : v}`).join(", ") || "–";
}

async function loadTenants() {
  const [quotas, usage, traffic] = await Promise.all([
    api("GET", "/admin/quotas"), api("GET", "/admin/usage"), api("GET", "/admin/traffic"),
  ]);
  $("keys-mode").textContent = `(${quotas.mode}, ${quotas.day})`;
  const daily = {};  // "tenant model" (or "tenant ") -> tokens a day
  $("keys-table").tBodies[0].replaceChildren(...(quotas.keys || []).map((key) => {
    const quota = key.quota || {};
    if (quota.tokens_per_day) daily[`${key.owner} `] = quota.tokens_per_day;
    for (const [model, q] of Object.entries(quota.per_model || {})) {
      if (q.tokens_per_day) daily[`${key.owner} ${model}`] = q.tokens_per_day;
    }
    const used = Object.entries(key.tokens_used_today || {}).map(([m, n]) => `${m}: ${n}`);
    const off = key.enabled === false ? " (disabled)" : "";
    return el("tr", { "data-owner": key.owner },
      el("td", { text: key.owner }), el("td", { text: (key.name || "") + off }),
      el("td", { className: "mono", text: key.key_preview || "–" }),
      el("td", { text: (key.allowed_models || []).join(", ") || "any" }),
      el("td", { text: limits(quota) }), el("td", { text: used.join(", ") || "0" }));
  }));
  $("usage-scope").textContent = `(${usage.scope}, ${usage.day})`;
  $("usage-table").tBodies[0].replaceChildren(...(usage.budgets || []).map((b) =>
    el("tr", { "data-tenant": b.tenant },
      el("td", { text: b.tenant }), el("td", { text: b.model || "all" }),
      el("td", { className: "tokens", text: b.tokens_used }),
      el("td", { text: daily[`${b.tenant} ${b.model || ""}`] || "–" }))));
  const refusals = Object.entries(traffic.errors_by_tenant || {});
  $("refusals").replaceChildren(...(refusals.length ? refusals.map(([tenant, codes]) =>
    el("li", { "data-tenant": tenant, text: `${tenant}: ` + Object.entries(codes)
      .map(([code, n]) => `${code} ${n}`).join(", ") }))
    : [el("li", { className: "muted", text: "none" })]));
}

// A name as one path segment: encoded, dots included (a browser resolves "." and "..").
function segment(name) { return encodeURIComponent(name).replace(/\./g, "%2E"); }

async function loadWallet(event, before) {
  if (event) event.preventDefault();
  const tenant = event ? $("wallet-tenant").value.trim() : state.ledgerTenant;
  if (!tenant) return;
  const path = `/admin/wallets/${segment(tenant)}`;
  try {
    const wallet = await api("GET", path);
    const query = before ? `?limit=20&before=${encodeURIComponent(before)}` : "?limit=20";
    const page = await api("GET", `${path}/ledger${query}`);
    state.ledgerTenant = tenant;
    state.ledgerBefore = page.next_before;
    $("wallet-balance").textContent = `${wallet.tenant}: balance ${wallet.balance} ` +
      `${wallet.currency}, held ${wallet.held}, available ${wallet.available}`;
    ledgerTable(page.entries || []);
    $("ledger-older").disabled = !page.next_before;
    $("wallet").hidden = false;
    show("wallet-error", "");
  } catch (error) {
    $("wallet").hidden = true;
    show("wallet-error", error.status === 404 && error.body && error.body.error &&
      /no route/.test(error.body.error.message || "")
      ? "Wallets are off on this router (no --ledger-dsn)." : error.message);
  }
}

function ledgerTable(entries) {
  const columns = entries.length ? Object.keys(entries[0]) : ["id"];
  const table = $("ledger-table");
  table.tHead.replaceChildren(el("tr", {}, ...columns.map((c) => el("th", { scope: "col", text: c }))));
  table.tBodies[0].replaceChildren(...entries.map((entry) => el("tr", {},
    ...columns.map((c) => el("td", { text: entry[c] === null ? "" : typeof entry[c] === "object"
      ? JSON.stringify(entry[c]) : entry[c] })))));
}

async function credit(event) {
  event.preventDefault();
  const tenant = state.ledgerTenant;
  const body = { amount: $("credit-amount").value.trim(), reference: $("credit-reference").value.trim() };
  const note = $("credit-note").value.trim();
  if (note) body.note = note;
  try {
    const answer = await api("POST", `/admin/wallets/${segment(tenant)}/credit`,
      JSON.stringify(body));
    $("credit-result").className = "ok";
    $("credit-result").textContent = answer.applied
      ? `Credited ${body.amount}; balance ${answer.balance} ${answer.currency}.`
      : `Reference ${body.reference} was credited before; nothing added.`;
    await loadWallet(null, null);
  } catch (error) {
    $("credit-result").className = "error";
    $("credit-result").textContent = error.message;
  }
}

// -- traffic --------------------------------------------------------------------------------

function card(label, value) {
  return el("div", {}, el("dt", { text: label }), el("dd", { text: value }));
}

// `before`: the page to show (a seq), null for the newest; polling keeps the page shown.
async function loadTraffic(before) {
  if (before !== undefined) state.requestsAt = before;
  const traffic = await api("GET", "/admin/traffic");
  const latency = traffic.latency_ms || {};
  const ttft = traffic.ttft_ms || {};
  $("traffic-summary").replaceChildren(
    card("Requests (hour)", traffic.requests), card("Rate (last minute)", `${traffic.rate_per_second}/s`),
    card("Latency p50 / p90 / p99", `${ms(latency.p50)} / ${ms(latency.p90)} / ${ms(latency.p99)}`),
    card("TTFT p50 / p90 / p99", `${ms(ttft.p50)} / ${ms(ttft.p90)} / ${ms(ttft.p99)}`));
  const minutes = traffic.minutes || [];
  const top = Math.max(1, ...minutes.map((m) => m.requests));
  $("traffic-minutes").replaceChildren(...minutes.map((m) => el("span", {
    className: `h${Math.ceil((m.requests / top) * 10)}`,
    title: `${new Date(m.start * 1000).toLocaleTimeString()}: ${m.requests} requests, ${m.errors} errors` })));
  const errors = Object.entries(traffic.errors_by_code || {});
  $("traffic-errors").replaceChildren(...(errors.length ? errors.map(([code, n]) =>
    el("li", { text: `${code}: ${n}` })) : [el("li", { className: "muted", text: "none" })]));
  const at = state.requestsAt;
  const query = typeof at === "number" ? `?limit=25&before=${at}` : "?limit=25";
  const page = await api("GET", `/admin/requests${query}`);
  state.requestsBefore = page.next_before;
  $("requests-older").disabled = !page.next_before;
  $("requests-table").tBodies[0].replaceChildren(...(page.requests || []).map((r) =>
    el("tr", { "data-request": r.request_id },
      el("td", { text: r.ts }), el("td", { text: r.tenant_id }), el("td", { text: r.model }),
      el("td", { text: r.status_code }), el("td", { text: r.error_code || "" }),
      el("td", { text: `${r.latency_ms} ms` }), el("td", { text: `${r.input_tokens} / ${r.output_tokens}` }),
      el("td", { className: "mono", text: r.agent_id }),
      el("td", { className: "mono", text: r.request_id }))));
}

// -- site -----------------------------------------------------------------------------------

async function loadSite() {
  const site = await api("GET", "/admin/sync");
  $("site-off").hidden = site.enabled;
  if (!site.enabled) { $("site-body").replaceChildren(); return; }
  const up = site.store_up ? pill("store up", "good") : pill("store down", "bad");
  const fenced = site.fenced ? pill("fenced", "bad") : null;
  const errors = Object.entries(site.errors || {});
  const wallets = Object.entries(site.wallets || {});
  $("site-body").replaceChildren(
    el("p", { id: "site-health" }, `Site ${site.site}, this router ${site.router_id}: `, up, " ",
      fenced, ` sync lag ${site.lag_seconds} s, ${site.rounds} rounds, share ${site.share}`),
    el("h3", { text: "Routers of the site" }),
    el("ul", { id: "site-routers" }, ...(site.routers || []).map((r) => el("li", { text: r }))),
    el("h3", { text: "Occupancy credit pools" }),
    wallets.length ? el("div", { className: "scroll" }, el("table", { id: "site-pools" },
      el("thead", {}, el("tr", {}, ...["Model", "Held", "In use", "Budget", "Acknowledged"]
        .map((t) => el("th", { scope: "col", text: t })))),
      el("tbody", {}, ...wallets.map(([model, w]) => el("tr", {},
        el("td", { text: model }), el("td", { text: w.held }), el("td", { text: w.in_use }),
        el("td", { text: w.budget }), el("td", { text: w.acknowledged }))))))
      : el("p", { className: "muted", text: "No model holds credits yet." }),
    el("h3", { text: "Store errors" }),
    el("ul", {}, ...(errors.length ? errors.map(([kind, n]) => el("li", { text: `${kind}: ${n}` }))
      : [el("li", { className: "muted", text: "none" })])));
}

// -- start ----------------------------------------------------------------------------------

function start() {
  $("signin-form").addEventListener("submit", signIn);
  $("signout").addEventListener("click", () => signOut(""));
  for (const tab of document.querySelectorAll(".tab")) {
    tab.addEventListener("click", () => select(tab.dataset.view));
  }
  $("fleet-table").addEventListener("click", (event) => {
    const button = event.target.closest("button.drain");
    if (button) askDrain(button);
  });
  $("confirm-yes").addEventListener("click", confirmed);
  $("confirm-no").addEventListener("click", () => { state.pending = null; $("confirm").close(); });
  $("policy-validate").addEventListener("click", () => writePolicy(true));
  $("policy-apply").addEventListener("click", () => writePolicy(false));
  $("wallet-form").addEventListener("submit", (event) => loadWallet(event, null));
  $("credit-form").addEventListener("submit", credit);
  $("ledger-newest").addEventListener("click", () => loadWallet(null, null));
  $("ledger-older").addEventListener("click", () => loadWallet(null, state.ledgerBefore));
  $("requests-newest").addEventListener("click", () => loadTraffic(null));
  $("requests-older").addEventListener("click", () => loadTraffic(state.requestsBefore));
  if (sessionStorage.getItem(KEY)) enter();
  else $("admin-key").focus();
}

document.addEventListener("DOMContentLoaded", start);

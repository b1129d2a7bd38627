// artrl dashboard: runs, curves and the token-level trajectory viewer. Plain JavaScript, no build step.
"use strict";

const COLOURS = ["#0969da", "#cf222e", "#1a7f37", "#8250df", "#bf8700", "#1b7c83", "#e16f24", "#6e7781"];
const PREFERRED = ["train/reward_mean", "val/reward_mean", "val/success_mean", "train/loss", "train/clip_fraction",
  "train/kl", "train/entropy", "train/logprob_mismatch_mean", "train/logprob_mismatch_max",
  "train/logprob_mismatch_fraction", "train/trainable_tokens", "train/step_seconds"];
const SKIP = new Set(["step", "split", "time"]);
const state = { runs: [], selected: new Set(), known: new Set(), pinned: false, histories: {}, pollMs: 3000, view: "curves",
  traj: { run: null, split: null, step: null, group: null, index: null }, colourBy: "mask", detail: null };

const $ = (id) => document.getElementById(id);
const el = (tag, attrs = {}, ...children) => {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v; else if (k === "text") node.textContent = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v); else node.setAttribute(k, v);
  }
  for (const c of children) if (c != null) node.append(c);
  return node;
};
const svgEl = (tag, attrs = {}) => {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  return node;
};
async function api(path, params = {}) {
  const query = new URLSearchParams(params).toString();
  const key = sessionStorage.getItem("artrl-key"); // a dashboard with a key: from the address, #...?key=KEY
  const headers = key ? { Authorization: `Bearer ${key}` } : {};
  const response = await fetch(`api/${path}${query ? "?" + query : ""}`, { headers });
  if (!response.ok) throw new Error((await response.json().catch(() => ({}))).error || response.statusText);
  return response.json();
}
const fmt = (v) => v == null ? "–" : typeof v !== "number" ? String(v) : Math.abs(v) >= 1000 || (v !== 0 && Math.abs(v) < 0.001)
  ? v.toExponential(2) : (+v.toFixed(4)).toString();
const colourOf = (run) => COLOURS[state.runs.findIndex((r) => r.id === run) % COLOURS.length];

// ---------------------------------------------------------------- routing: #curves?runs=a,b  #traj?run=..
function readHash() {
  const [view, query] = location.hash.slice(1).split("?");
  const params = new URLSearchParams(query || "");
  if (params.get("key")) sessionStorage.setItem("artrl-key", params.get("key")); // (writeHash drops it)
  state.view = view === "traj" ? "traj" : "curves";
  if (params.get("runs")) { state.selected = new Set(params.get("runs").split(",")); state.pinned = true; }
  if (state.view === "traj") {
    for (const key of ["run", "split", "step", "group", "index"]) state.traj[key] = params.get(key);
  }
}
function writeHash() {
  const params = state.view === "traj"
    ? Object.fromEntries(Object.entries(state.traj).filter(([, v]) => v != null))
    : { runs: [...state.selected].join(",") };
  history.replaceState(null, "", `#${state.view}?${new URLSearchParams(params)}`);
}

// ---------------------------------------------------------------- runs
async function refreshRuns() {
  state.runs = await api("runs");
  for (const run of state.runs) { // a run seen for the first time (a training just started) is drawn
    if (!state.known.has(run.id)) { state.known.add(run.id); if (!state.pinned) state.selected.add(run.id); }
  }
  const list = $("runs");
  list.replaceChildren(...state.runs.map((run) => el("li", {},
    el("input", { type: "checkbox", ...(state.selected.has(run.id) ? { checked: "" } : {}),
      onchange: (e) => { e.target.checked ? state.selected.add(run.id) : state.selected.delete(run.id); showCurves(); } }),
    el("span", { class: "swatch", style: `background:${colourOf(run.id)}` }),
    el("span", {}, el("a", { text: run.id, onclick: () => openRun(run.id) }),
      el("div", { class: "meta", text: `step ${run.step} · ${run.splits.join(", ")}` })))));
  if (!state.runs.length) list.replaceChildren(el("li", { class: "hint", text: "no runs here yet" }));
}

// ---------------------------------------------------------------- curves
function series(rows) { // "split/metric" -> [[step, value]]
  const out = {};
  for (const row of rows) for (const [k, v] of Object.entries(row)) {
    if (SKIP.has(k) || typeof v !== "number") continue;
    (out[`${row.split}/${k}`] ||= []).push([row.step, v]);
  }
  return out;
}
function chart(metric, lines) {
  const W = 320, H = 160, L = 44, B = 18, T = 6, R = 8;
  const points = lines.flatMap((l) => l.points);
  const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
  let [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
  if (x0 === x1) x1 = x0 + 1; if (y0 === y1) { y0 -= 0.5; y1 += 0.5; }
  const sx = (x) => L + (x - x0) / (x1 - x0) * (W - L - R), sy = (y) => H - B - (y - y0) / (y1 - y0) * (H - B - T);
  const svg = svgEl("svg", { class: "chart", viewBox: `0 0 ${W} ${H}`, "data-metric": metric });
  svg.append(svgEl("line", { class: "axis", x1: L, y1: H - B, x2: W - R, y2: H - B }),
    svgEl("line", { class: "axis", x1: L, y1: T, x2: L, y2: H - B }));
  for (const [y, label] of [[y1, fmt(y1)], [y0, fmt(y0)]]) {
    const t = svgEl("text", { x: L - 4, y: sy(y) + 3, "text-anchor": "end" }); t.textContent = label; svg.append(t);
  }
  for (const [x, anchor] of [[x0, "start"], [x1, "end"]]) {
    const t = svgEl("text", { x: sx(x), y: H - 4, "text-anchor": anchor }); t.textContent = `step ${x}`; svg.append(t);
  }
  for (const line of lines) {
    const d = line.points.map((p, i) => `${i ? "L" : "M"}${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join("");
    svg.append(svgEl("path", { class: "line", d, stroke: line.colour, "data-run": line.run }));
    for (const p of line.points) {
      const dot = svgEl("circle", { cx: sx(p[0]), cy: sy(p[1]), r: 2.2, fill: line.colour });
      const title = svgEl("title"); title.textContent = `${line.run} · step ${p[0]} · ${metric} = ${fmt(p[1])}`;
      dot.append(title); svg.append(dot);
    }
  }
  return el("div", { class: "chart-card" }, el("h4", { text: metric }), svg);
}
async function showCurves() {
  writeHash();
  const runs = [...state.selected].filter((id) => state.runs.some((r) => r.id === id));
  await Promise.all(runs.map(async (id) => { state.histories[id] = await api("history", { run: id }); }));
  const perRun = Object.fromEntries(runs.map((id) => [id, series(state.histories[id] || [])]));
  const metrics = [...new Set(runs.flatMap((id) => Object.keys(perRun[id])))];
  metrics.sort((a, b) => {
    const [ia, ib] = [PREFERRED.indexOf(a), PREFERRED.indexOf(b)];
    return (ia < 0 ? 999 : ia) - (ib < 0 ? 999 : ib) || a.localeCompare(b);
  });
  const filter = $("metric-filter").value.trim().toLowerCase();
  const charts = metrics.filter((m) => !filter || m.toLowerCase().includes(filter)).map((m) => chart(m,
    runs.filter((id) => perRun[id][m]).map((id) => ({ run: id, colour: colourOf(id), points: perRun[id][m] }))));
  $("legend").replaceChildren(...runs.map((id) => el("span", { style: `color:${colourOf(id)}`, text: `■ ${id}` })));
  $("charts").replaceChildren(...(charts.length ? charts : [el("p", { class: "hint", text: "no metrics yet" })]));
}

// ---------------------------------------------------------------- trajectories
async function openRun(run) {
  state.view = "traj"; state.traj = { run, split: null, step: null, group: null, index: null };
  await show();
}
function options(select, values, current) {
  select.replaceChildren(...values.map((v) => el("option", { value: v, ...(String(v) === String(current) ? { selected: "" } : {}), text: v })));
}
async function showTrajectories() {
  const t = state.traj;
  t.run ||= state.runs[0]?.id;
  if (!t.run) { $("groups").replaceChildren(el("p", { class: "hint", text: "no runs here yet" })); return; }
  options($("traj-run"), state.runs.map((r) => r.id), t.run);
  const steps = await api("steps", { run: t.run });
  const splits = Object.keys(steps);
  if (!splits.includes(t.split)) t.split = splits.includes("train") ? "train" : splits[0];
  options($("traj-split"), splits, t.split);
  const stepList = t.split ? steps[t.split] : [];
  if (!stepList.map(String).includes(String(t.step))) t.step = stepList[stepList.length - 1];
  options($("traj-step"), [...stepList].reverse(), t.step);
  writeHash();
  if (t.step == null) { $("groups").replaceChildren(el("p", { class: "hint", text: "no trajectories recorded yet" })); return; }
  const groups = await api("groups", { run: t.run, split: t.split, step: t.step });
  $("groups").replaceChildren(...groups.map((g) => el("div", { class: "group" },
    el("h4", { text: `group ${g.group} · mean ${fmt(g.reward_mean)} · spread ${fmt(g.reward_spread)}` }),
    ...g.trajectories.map((x) => el("a", {
      class: "traj-link" + (String(t.group) === String(g.group) && String(t.index) === String(x.index) ? " selected" : ""),
      "data-group": g.group, "data-index": x.index,
      text: `#${x.index} reward ${fmt(x.reward)} · ${x.sampled_turns} sampled turn(s)`,
      onclick: () => { t.group = g.group; t.index = x.index; showTrajectories(); },
    })))));
  if (t.group != null && t.index != null) await showDetail();
}
async function showDetail() {
  const t = state.traj;
  try {
    state.detail = await api("trajectory", { run: t.run, split: t.split, step: t.step, group: t.group, index: t.index });
  } catch (e) { $("detail").replaceChildren(el("p", { class: "error", text: String(e.message) })); return; }
  renderDetail();
}
function messageView(m) {
  const calls = (m.tool_calls || []).map((c) => el("span", { class: "call",
    text: `${c.function?.name}(${c.function?.arguments})` }));
  return el("div", { class: `msg ${m.role}` },
    el("div", { class: "role", text: m.role + (m.sampled ? ` · sampled (${m.sampled_tokens} tokens, ${m.finish_reason})` : "")
      + (m.tool_call_id ? ` · ${m.tool_call_id}` : "") }),
    m.reasoning_content ? el("details", {}, el("summary", { text: "reasoning" }), m.reasoning_content) : null,
    m.content ? el("div", { text: m.content }) : null, ...calls);
}
function tokenColour(tok, row, maxAdv) {
  const [, , mask, sampler, trainer] = tok;
  if (state.colourBy === "mask") return mask ? "rgba(46,160,67,0.35)" : "";
  if (!mask) return "";
  if (state.colourBy === "logprob") return sampler == null ? "#eee" : `hsl(${Math.round(120 * Math.exp(sampler))},75%,78%)`;
  if (state.colourBy === "advantage") {
    const a = row.advantage || 0, alpha = maxAdv ? Math.min(1, Math.abs(a) / maxAdv) * 0.6 : 0;
    return a >= 0 ? `rgba(46,160,67,${alpha})` : `rgba(207,34,46,${alpha})`;
  }
  if (sampler == null || trainer == null) return "#eee"; // mismatch
  return `rgba(130,80,223,${Math.min(1, Math.abs(trainer - sampler) / 0.5) * 0.85 + 0.05})`;
}
function tokenTitle(tok, row) {
  const [id, text, mask, sampler, trainer] = tok;
  const parts = [`id ${id}`, JSON.stringify(text), mask ? "trained" : "not trained"];
  if (sampler != null) parts.push(`sampler logprob ${fmt(sampler)} (p ${fmt(Math.exp(sampler))})`);
  if (trainer != null) parts.push(`trainer logprob ${fmt(trainer)}`);
  if (sampler != null && trainer != null) parts.push(`mismatch ${fmt(Math.abs(trainer - sampler))}`);
  if (mask && row.advantage != null) parts.push(`advantage ${fmt(row.advantage)}`);
  return parts.join(" · ");
}
function rowView(row, maxAdv) {
  const fork = row.fork ? el("span", { class: "fork", text: ` · forks from row ${row.fork.from_row} at token ${row.fork.at}` }) : null;
  const tokens = el("div", { class: "tokens" });
  row.tokens.forEach((tok, i) => {
    if (row.fork && i === row.fork.at) tokens.append(el("span", { class: "fork-mark", text: "⑂" }));
    const span = el("span", { class: `token ${tok[2] ? "trained" : "prompt"}`, title: tokenTitle(tok, row) });
    span.textContent = tok[1].replace(/\n/g, "↵\n");
    span.style.background = tokenColour(tok, row, maxAdv);
    tokens.append(span);
  });
  const what = row.trained ? "trained" : "not trained";
  return el("div", { class: "row-card", "data-row": row.row },
    el("h5", { text: `row ${row.row} · ${what} · advantage ${fmt(row.advantage)} · weight ${fmt(row.weight)} · ${row.length} tokens, ${row.trained_tokens} sampled${row.truncated ? " (cut)" : ""}` }, fork),
    tokens);
}
function renderDetail() {
  const d = state.detail;
  const maxAdv = Math.max(0, ...d.rows.map((r) => Math.abs(r.advantage || 0)));
  const select = el("select", { id: "colour-by", onchange: (e) => { state.colourBy = e.target.value; renderDetail(); } },
    ...["mask", "logprob", "advantage", "mismatch"].map((k) => el("option", { value: k, ...(k === state.colourBy ? { selected: "" } : {}), text: k })));
  const source = d.rows_source === "trained" ? "as the step trained them" : "from the recorded calls (not trained)";
  $("detail").replaceChildren(
    el("h3", { text: `${d.split} step ${d.step} · group ${d.group} · #${d.index} · reward ${fmt(d.reward)}` }),
    el("p", { class: "hint", text: Object.entries(d.metrics).map(([k, v]) => `${k} ${fmt(v)}`).join(" · ") }),
    el("div", { class: "detail-cols" },
      el("div", { id: "conversation" }, el("h4", { text: "Conversation" }), ...d.messages.map(messageView),
        ...d.additional_histories.map((h, i) => el("details", {}, el("summary", { text: `history ${i + 1}` }), ...h.map(messageView)))),
      el("div", { id: "rows" }, el("h4", { text: `Rows (${d.rows.length}), ${source}` }),
        el("div", { class: "rows-toolbar" }, el("label", { text: "colour by " }, select),
          d.token_text ? null : el("span", { class: "error", text: "no tokenizer found: showing token ids" })),
        ...d.rows.map((r) => rowView(r, maxAdv)))));
}

// ---------------------------------------------------------------- views and the live refresh
async function show() {
  $("curves-view").hidden = state.view !== "curves";
  $("traj-view").hidden = state.view !== "traj";
  $("nav-curves").classList.toggle("active", state.view === "curves");
  $("nav-traj").classList.toggle("active", state.view === "traj");
  if (state.view === "curves") await showCurves(); else await showTrajectories();
}
async function poll() {
  try {
    const before = JSON.stringify(state.runs.map((r) => [r.id, r.history_rows]));
    await refreshRuns();
    const changed = before !== JSON.stringify(state.runs.map((r) => [r.id, r.history_rows]));
    if (changed && state.view === "curves") await showCurves();
    if (changed && state.view === "traj" && state.traj.group == null) await showTrajectories();
    $("live").classList.remove("stale"); $("live").textContent = `live · ${new Date().toLocaleTimeString()}`;
  } catch (e) { $("live").classList.add("stale"); $("live").textContent = "offline"; }
}
async function main() {
  readHash(); // first: it may hold the key the API needs
  const config = await api("config");
  state.pollMs = config.poll_interval_s * 1000;
  $("root").textContent = config.root;
  await refreshRuns();
  $("metric-filter").addEventListener("input", showCurves);
  $("traj-run").addEventListener("change", (e) => openRun(e.target.value));
  $("traj-split").addEventListener("change", (e) => { Object.assign(state.traj, { split: e.target.value, step: null, group: null, index: null }); showTrajectories(); });
  $("traj-step").addEventListener("change", (e) => { Object.assign(state.traj, { step: e.target.value, group: null, index: null }); showTrajectories(); });
  window.addEventListener("hashchange", () => { readHash(); show(); });
  await show();
  document.body.dataset.ready = "1";
  setInterval(poll, state.pollMs);
}
main().catch((e) => document.body.append(el("p", { class: "error", text: `dashboard error: ${e.message}` })));

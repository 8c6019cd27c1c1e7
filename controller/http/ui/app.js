// diffring status page: plain JavaScript, no framework, everything served by the controller.
// State comes from GET /ui/state (re-read every refresh_s seconds and shortly after any
// event); GET /v1/events (server-sent events) moves the step bars between two reads.
"use strict";

const TERMINAL = new Set(["completed", "failed", "cancelled"]);
let refreshTimer = null;
let galleryKey = "";
let period = 2000;

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined) continue;
    if (k === "class") node.className = v;
    else if (k.startsWith("data-")) node.setAttribute(k, v);
    else node[k] = v;
  }
  for (const c of children) {
    if (c === null || c === undefined) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

function bar(step, steps, stage) {
  let frac = steps ? step / steps : 0;
  if (["phase2", "decoding", "completed"].includes(stage)) frac = 1;
  const cls = stage === "completed" ? "bar done" : (TERMINAL.has(stage) ? "bar failed" : "bar");
  const fill = el("span");
  fill.style.width = `${Math.round(frac * 100)}%`;
  const label = steps ? `${step}/${steps}` : "";
  // The step k/n is written beside the bar, not only in its tooltip.
  return el("span", { class: "progress" }, el("div", { class: cls, title: label }, fill),
    el("span", { class: "steps" }, label));
}

// A waiting task's stage says which worker it waits for, and its place in that queue.
function stageText(t) {
  if (!t.waiting_for) return t.stage;
  const pos = t.queue_position ? ` #${t.queue_position}` : "";
  return `${t.stage} · waiting for ${t.waiting_for}${pos}`;
}

function age(s) {
  if (s < 60) return `${s.toFixed(1)} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min`;
  return `${(s / 3600).toFixed(1)} h`;
}

function renderHeader(st) {
  document.getElementById("pipeline").textContent = st.pipeline;
  document.getElementById("service").textContent = st.service;
  const counts = document.getElementById("counts");
  counts.replaceChildren(...Object.entries(st.counts).map(
    ([k, v]) => el("span", { class: "count" }, `${k} `, el("b", {}, v))));
}

function renderRings(st) {
  const body = document.querySelector("#rings tbody");
  const rows = Object.entries(st.rings).map(([name, r]) => {
    const repairs = Object.values(r.repairs || {}).reduce((a, b) => a + b, 0);
    return el("tr", { "data-ring": name }, el("td", {}, name), el("td", {}, r.depth),
      el("td", {}, r.slot_count), el("td", {}, r.published), el("td", {}, r.claimed),
      el("td", {}, r.peers), el("td", {}, repairs));
  });
  if (!rows.length) rows.push(el("tr", {}, el("td", { class: "none", colSpan: 7 },
    "no rings in this service (one-process baseline)")));
  body.replaceChildren(...rows);
}

function renderWorkers(st) {
  for (const box of document.querySelectorAll("#workers .role")) {
    const role = box.getAttribute("data-role");
    const list = box.querySelector(".list");
    const workers = st.workers[role] || [];
    if (!workers.length) {
      list.replaceChildren(el("div", { class: "none" }, "no worker registered"));
      continue;
    }
    list.replaceChildren(...workers.map((w) => {
      const stale = w.heartbeat_age_s > 3 * (st.refresh_s || 2);
      const current = w.current_task
        ? el("div", { class: "meta" }, `task ${w.current_task} (${w.current_stage})`,
          w.steps ? bar(w.step, w.steps, w.current_stage) : null)
        : el("div", { class: "meta" }, "idle");
      return el("div", { class: stale ? "worker stale" : "worker", "data-worker": w.name },
        el("div", { class: "name" }, w.name),
        el("div", { class: "meta" },
          `pid ${w.pid} · ${w.state} · heartbeat ${age(w.heartbeat_age_s)} ago · ` +
          `${w.tasks_done} done`),
        current);
    }));
  }
}

// What a task's progress is worth beyond its worker: its kept checkpoint (or final
// latents), the step its attempt resumed from, preemptions, a priority other than normal.
function resilience(t) {
  const parts = [];
  if (t.priority && t.priority !== "normal") parts.push(t.priority);
  if (t.checkpoint) {
    parts.push(t.checkpoint.final ? "final latents kept"
      : `checkpoint ${t.checkpoint.step}/${t.checkpoint.steps}`);
  }
  if (t.resumes) parts.push(`resumed ×${t.resumes}` +
    (t.resumed_from !== null && t.resumed_from !== undefined ? ` (step ${t.resumed_from})` : ""));
  if (t.preemptions) parts.push(`preempted ×${t.preemptions}`);
  return parts.join(" · ");
}

function taskRow(t) {
  return el("tr", { "data-task-id": t.task_id },
    el("td", {}, t.task_id),
    el("td", { class: `stage-${t.stage}` }, stageText(t)),
    el("td", {}, bar(t.step, t.steps, t.stage)),
    el("td", { class: "ckpt" }, resilience(t)),
    el("td", {}, t.attempt),
    el("td", {}, t.worker || ""),
    el("td", {}, age(t.age_s)),
    el("td", { class: "err" }, t.error && t.status !== "completed" ? t.error : ""));
}

function renderTasks(st) {
  const body = document.querySelector("#tasks tbody");
  const rows = st.tasks.map(taskRow);
  if (!rows.length) rows.push(el("tr", {}, el("td", { class: "none", colSpan: 8 },
    "no task yet")));
  body.replaceChildren(...rows);
}

function renderGallery(st) {
  const key = st.gallery.map((g) => g.task_id).join(",");
  if (key === galleryKey) return; // unchanged: keep the loaded images
  galleryKey = key;
  const box = document.getElementById("gallery");
  if (!st.gallery.length) {
    box.replaceChildren(el("div", { class: "none" }, "no result yet"));
    return;
  }
  box.replaceChildren(...st.gallery.map((g) => {
    const media = (g.media_type || "").startsWith("video/")
      ? el("video", { class: "thumb", poster: g.thumbnail_url, src: g.result_url,
        preload: "none", controls: true, muted: true, "data-task-id": g.task_id })
      : el("img", { class: "thumb", src: g.thumbnail_url, alt: g.prompt || g.task_id,
        "data-task-id": g.task_id });
    return el("figure", {}, el("a", { href: g.result_url }, media),
      el("figcaption", { title: g.prompt || "" }, g.task_id));
  }));
}

async function refresh() {
  refreshTimer = null;
  try {
    const r = await fetch("/ui/state", { cache: "no-store" });
    if (r.status === 401) { askForKey(); return; }
    if (!r.ok) return;
    const st = await r.json();
    period = (st.refresh_s || 2) * 1000;
    renderHeader(st);
    renderRings(st);
    renderWorkers(st);
    renderTasks(st);
    renderGallery(st);
  } catch (e) {
    // The controller is restarting: the next period tries again.
  }
}

let askedForKey = false;

// A front door with an API key: ask for it once and keep it in a cookie, which fetch and
// EventSource send with every request to this origin (EventSource cannot send headers).
function askForKey() {
  if (askedForKey) return;
  askedForKey = true;
  const key = window.prompt("This front door wants its API key:");
  if (!key) return;
  document.cookie = `diffring_api_key=${encodeURIComponent(key)}; path=/; SameSite=Strict`;
  location.reload();
}

function soon() {
  if (refreshTimer === null) refreshTimer = setTimeout(refresh, 250);
}

function onEvent(ev) {
  const data = JSON.parse(ev.data);
  const row = document.querySelector(`#tasks tr[data-task-id="${CSS.escape(data.task_id)}"]`);
  if (row && ev.type === "progress") {
    row.children[1].textContent = data.stage;
    row.children[2].replaceChildren(bar(data.step, data.steps, data.stage));
  }
  soon();
}

function listen() {
  const live = document.getElementById("live");
  const source = new EventSource("/v1/events");
  source.onopen = () => { live.className = "live on"; live.textContent = "events: live"; };
  source.onerror = () => { live.className = "live off"; live.textContent = "events: reconnecting"; };
  for (const name of ["stage", "progress", "completed", "failed", "cancelled", "checkpoint",
    "resumed", "yielded", "preempting", "preempted", "handover"]) {
    source.addEventListener(name, onEvent);
  }
}

refresh();
listen();
(function tick() { setTimeout(() => { refresh().finally(tick); }, period); })();

// core.js: what every view uses — elements, formatting (numbers, times in the viewer's zone),
// calls to the API with the admin key, the toast, the confirmation dialog, state badges.
//
// Text from the server (payloads, errors, type names) only ever goes into the page as text
// nodes (h() and textContent), never as HTML.

const KEY_STORE = "jobtier.dashboard.adminKey"; // sessionStorage: this tab only
const ID_RE = /^[0-9A-HJKMNP-TV-Z]{26}-[0-9]{1,4}$/;
const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);
const WAITING = new Set(["queued", "scheduled"]);
const PRIORITIES = ["critical", "high", "normal", "low"];

const $ = (id) => document.getElementById(id);
const body = document.body;

/** An element: h("a", {href: "#/", class: "x", onclick: fn, dataset: {id: 1}}, "text", child). */
function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (name === "class") el.className = value;
    else if (name === "dataset") Object.assign(el.dataset, value);
    else if (name.startsWith("on")) el.addEventListener(name.slice(2), value);
    else if (value === true) el.setAttribute(name, "");
    else el.setAttribute(name, String(value));
  }
  append(el, children);
  return el;
}
function append(el, children) {
  for (const child of children) {
    if (child === null || child === undefined || child === false) continue;
    if (Array.isArray(child)) append(el, child);
    else el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

// --- numbers: each formatter returns [number text, unit] --------------------------------------
const plain = new Intl.NumberFormat("en-US");
const known = (v) => v !== null && v !== undefined && Number.isFinite(v);

function compact(n) {
  const a = Math.abs(n);
  for (const [size, suffix] of [[1e9, "G"], [1e6, "M"], [1e3, "K"]]) {
    if (a >= size) {
      const v = n / size;
      return (Math.abs(v) < 100 ? v.toFixed(1).replace(/\.0$/, "") : Math.round(v)) + suffix;
    }
  }
  return null;
}
function fmtCount(n) {
  if (!known(n)) return ["—", ""];
  return [Math.abs(n) >= 1e4 ? compact(n) : plain.format(Math.round(n)), ""];
}
function fmtRate(r) {
  if (!known(r)) return ["—", ""];
  const a = Math.abs(r);
  const text = a >= 1e3 ? compact(r) : a === 0 ? "0" : a < 10 ? r.toFixed(1) : String(Math.round(r));
  return [text, "/s"];
}
function fmtSeconds(s) {
  if (!known(s)) return ["—", ""];
  if (s < 1) {
    const ms = s * 1000;
    return [ms === 0 ? "0" : ms < 10 ? ms.toFixed(1).replace(/\.0$/, "") : String(Math.round(ms)), "ms"];
  }
  if (s < 60) return [s < 10 ? s.toFixed(1).replace(/\.0$/, "") : String(Math.round(s)), "s"];
  if (s < 3600) return [(s / 60).toFixed(1).replace(/\.0$/, ""), "min"];
  if (s < 172800) return [(s / 3600).toFixed(1).replace(/\.0$/, ""), "h"];
  return [(s / 86400).toFixed(1).replace(/\.0$/, ""), "d"];
}
function fmtRatio(r) {
  if (!known(r)) return ["—", ""];
  const pct = r * 100;
  return [pct === 0 ? "0" : pct < 10 ? pct.toFixed(1) : String(Math.round(pct)), "%"];
}
const joinFmt = ([n, u]) => (u === "/s" || u === "%" || u === "" ? n + u : `${n} ${u}`);
const text = (fmt, v) => joinFmt(fmt(v));
function fmtBytes(n) {
  if (!known(n)) return "—";
  if (n < 1024) return `${n} B`;
  if (n < 1024 * 1024) return `${(n / 1024).toFixed(1).replace(/\.0$/, "")} KiB`;
  return `${(n / 1024 / 1024).toFixed(1).replace(/\.0$/, "")} MiB`;
}

/** Sets a figure: its text (number and a muted unit) and its raw value in data-value. */
function show(id, raw, [num, unit]) {
  const el = $(id);
  el.dataset.value = known(raw) ? String(raw) : "";
  el.replaceChildren(document.createTextNode(num), ...(unit ? [h("span", { class: "unit" }, unit)] : []));
}

// --- times: always in the viewer's zone, the UTC instant in the tooltip ----------------------
const ZONE = Intl.DateTimeFormat().resolvedOptions().timeZone || "local time";
const dateTimeFmt = new Intl.DateTimeFormat(undefined, {
  year: "numeric", month: "short", day: "numeric", hour: "2-digit", minute: "2-digit", second: "2-digit",
});
const timeFmt = new Intl.DateTimeFormat(undefined, { hour: "2-digit", minute: "2-digit", second: "2-digit" });

const toDate = (t) => (t instanceof Date ? t : typeof t === "number" ? new Date(t * 1000) : new Date(t));
function fmtTime(t) {
  const d = toDate(t);
  return Number.isNaN(d.getTime()) ? "—" : dateTimeFmt.format(d);
}
/** A <time> element: local date and time, the exact UTC instant on hover. */
function timeEl(t, { ago = false } = {}) {
  if (t === null || t === undefined) return h("span", { class: "muted" }, "—");
  const d = toDate(t);
  const label = ago ? fmtAgo(d) : fmtTime(d);
  return h("time", { datetime: d.toISOString(), title: `${fmtTime(d)} (${ZONE}) · ${d.toISOString()}` }, label);
}
function fmtAgo(t) {
  const s = (Date.now() - toDate(t).getTime()) / 1000;
  if (!Number.isFinite(s)) return "—";
  if (s < 0) return "in " + joinFmt(fmtSeconds(-s));
  if (s < 1) return "just now";
  return joinFmt(fmtSeconds(Math.round(s))) + " ago";
}
/** A duration in ms as "850 ms", "2.4 s", "3 min 5 s". */
function fmtDuration(ms) {
  if (!known(ms)) return "—";
  if (ms < 1000) return `${Math.round(ms)} ms`;
  const s = ms / 1000;
  if (s < 60) return `${s.toFixed(s < 10 ? 2 : 1)} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${Math.round(s % 60)} s`;
  return `${Math.floor(s / 3600)} h ${Math.round((s % 3600) / 60)} min`;
}

// --- the API ---------------------------------------------------------------------------------
class ApiError extends Error {
  constructor(status, detail, problem) {
    super(detail);
    this.status = status;
    this.problem = problem;
  }
}
const authLost = []; // handlers called with a message when the key stops working

/** Calls the API with the admin key; the JSON answer, or an ApiError saying why not. */
async function api(path, { method = "GET", json } = {}) {
  const key = sessionStorage.getItem(KEY_STORE);
  const headers = { authorization: `Bearer ${key}`, accept: "application/json" };
  if (json !== undefined) headers["content-type"] = "application/json";
  let response;
  try {
    response = await fetch(path, {
      method, headers, cache: "no-store", body: json === undefined ? undefined : JSON.stringify(json),
    });
  } catch {
    throw new ApiError(0, "the server cannot be reached");
  }
  let doc = null;
  try {
    doc = await response.json();
  } catch {
    doc = null;
  }
  if (response.status === 401 || response.status === 403) {
    const message = keyMessage(response.status, doc?.detail);
    for (const handler of authLost) handler(message);
    throw new ApiError(response.status, message, doc);
  }
  if (!response.ok) {
    const detail = doc?.detail || doc?.title || `HTTP ${response.status}`;
    throw new ApiError(response.status, response.status === 503 ? `${detail} (503)` : detail, doc);
  }
  return doc;
}
function keyMessage(status, detail) {
  return status === 403
    ? `That key is not the admin key (403${detail ? ": " + detail : ""}).`
    : `The server refused this key (401${detail ? ": " + detail : ""}).`;
}
function query(params) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) if (v !== null && v !== undefined && v !== "") q.set(k, v);
  const s = q.toString();
  return s ? "?" + s : "";
}

// --- the toast (announced) -------------------------------------------------------------------
let toastTimer = null;
function toast(message, bad = false) {
  const el = $("toast");
  el.textContent = message;
  el.className = bad ? "toast bad" : "toast";
  el.hidden = false;
  clearTimeout(toastTimer);
  toastTimer = setTimeout(() => { el.hidden = true; }, bad ? 9000 : 5000);
}

// --- the confirmation step of every action ---------------------------------------------------
/**
 * Asks before an action: resolves true when confirmed. With `typed`, the operator must type
 * that word (a queue's name before a purge) to enable the button. Esc or Cancel says no;
 * the dialog is modal, so the keyboard stays in it.
 */
function confirmAction({ title, text: message, ok, typed = null }) {
  const dialog = $("confirm");
  $("confirm-title").textContent = title;
  $("confirm-text").textContent = message;
  $("confirm-ok").textContent = ok;
  const input = $("confirm-input");
  $("confirm-typed").hidden = !typed;
  input.value = "";
  $("confirm-input-label").textContent = typed ? `Type ${typed} to confirm` : "";
  const okButton = $("confirm-ok");
  okButton.disabled = Boolean(typed);
  const opener = document.activeElement;
  return new Promise((resolve) => {
    const onInput = () => { okButton.disabled = input.value.trim() !== typed; };
    const done = (answer) => {
      input.removeEventListener("input", onInput);
      $("confirm-cancel").removeEventListener("click", cancel);
      dialog.removeEventListener("close", closed);
      if (dialog.open) dialog.close();
      // the browser gives the focus back to the opener itself; only if that is gone (its
      // row was redrawn) does the focus need a place
      const lost = !document.activeElement || document.activeElement === document.body;
      if (lost && opener instanceof HTMLElement && opener.isConnected) opener.focus();
      resolve(answer);
    };
    const cancel = () => done(false);
    const closed = () => done(dialog.returnValue === "ok");
    input.addEventListener("input", onInput);
    $("confirm-cancel").addEventListener("click", cancel);
    dialog.addEventListener("close", closed);
    dialog.returnValue = "";
    okButton.value = "ok";
    dialog.showModal();
    (typed ? input : $("confirm-cancel")).focus(); // the safe choice has the focus
  });
}

/** Runs a confirmed action: the call, then a toast saying what happened (or why not). */
async function act(confirmation, call, success) {
  if (!(await confirmAction(confirmation))) return null;
  try {
    const answer = await call();
    toast(success(answer));
    return answer;
  } catch (err) {
    toast(`${confirmation.ok} failed: ${err.message}`, true);
    return null;
  }
}

// --- states, in colour and in words ----------------------------------------------------------
function stateBadge(state, label = state) {
  return h("span", { class: `state s-${/^[a-z_]+$/.test(state) ? state : "other"}` }, label);
}
function jobLink(id, label = id) {
  return h("a", { href: `#/jobs/${encodeURIComponent(id)}`, class: "id-link" }, label);
}
function prettyJson(value) {
  return h("pre", { class: "json", tabindex: "0" }, JSON.stringify(value, null, 2));
}
function progressOf(p) {
  // a number in [0, 1] is a fraction; anything else is shown as it is
  if (typeof p === "number" && p >= 0 && p <= 1) {
    const bar = h("span", { class: "bar", "aria-hidden": "true" }, h("span"));
    bar.firstChild.style.width = `${Math.round(p * 100)}%`;
    return h("span", { class: "nowrap" }, bar, `${Math.round(p * 100)}%`);
  }
  if (p === null || p === undefined) return h("span", { class: "muted" }, "—");
  const s = JSON.stringify(p);
  return h("span", { class: "mono", title: s }, s.length > 40 ? s.slice(0, 39) + "…" : s);
}
/** Marks a view as drawn (tests wait for data-loaded to move). */
function drawn(section) {
  section.dataset.loaded = String(Number(section.dataset.loaded || 0) + 1);
}
function emptyState(title, ...hint) {
  return h("div", { class: "empty" }, h("strong", {}, title), h("span", {}, hint));
}

/** Replaces what `holder` shows with `node`, keeping the keyboard focus on the same link or
 * button (same row, same target) when the focus was inside: views that redraw while read
 * must not throw a keyboard user back to the top. */
function swap(holder, node) {
  const active = document.activeElement;
  const key = active instanceof HTMLElement && holder.contains(active) ? focusKey(active) : null;
  holder.replaceChildren(node);
  if (key) [...holder.querySelectorAll("a, button, [tabindex]")].find((el) => focusKey(el) === key)?.focus();
}
const ROW_SELECTOR = "[data-id], [data-worker], [data-queue], [data-version]";
function focusKey(el) {
  const row = el.closest(ROW_SELECTOR);
  const rowKey = row ? [row.dataset.id, row.dataset.worker, row.dataset.queue, row.dataset.version] : [];
  return JSON.stringify([el.tagName, el.getAttribute("href"), el.dataset.act || "", el.textContent, rowKey]);
}

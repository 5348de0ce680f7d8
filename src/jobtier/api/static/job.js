// job.js: one job (#/jobs/<id>) — its status, each attempt with its error and traceback, the
// lines its task logged (ctx.log), the jobs it waits for (a flow's: each one's state and
// outcome, and a parent's children done), the full history with times and durations, payload,
// result (or the link to one kept in the result store), related jobs and the admin actions
// taken on it; for a job not started yet, why not (/v1/admin/jobs/<id>/explain: each reason
// in words and numbers, read again every few seconds while it waits); live: its status follows /v1/admin/events, its history is read again as it
// changes, and its log lines every few seconds while it runs. Members of the status document
// this page does not know (a newer server's) are shown as they are, so nothing is hidden.

const KNOWN_FIELDS = new Set(["id", "type", "queue", "state", "version", "priority", "attempt",
  "max_attempts", "created_at", "updated_at", "run_at", "progress", "error", "cancel_requested", "worker", "result_url", "dependencies"]);
// a running job's log lines come without a change of its status: read again this often
const LINES_EVERY_MS = 5000;
// a job not started yet: its explanation (its place in line, its queue's state) is read again
// this often, as it changes without a change of the job's status
const WHY_EVERY_MS = 5000;
const NOT_STARTED = new Set(["queued", "scheduled", "waiting"]);
// times to the millisecond (an attempt's changes and lines are close together)
const preciseFmt = new Intl.DateTimeFormat(undefined, {
  year: "numeric", month: "short", day: "numeric", hour: "2-digit", minute: "2-digit", second: "2-digit",
  fractionalSecondDigits: 3,
});
const clockFmt = new Intl.DateTimeFormat(undefined, {
  hour: "2-digit", minute: "2-digit", second: "2-digit", fractionalSecondDigits: 3,
});
const jobView = { id: null, data: null, feed: null, timer: null, linesTimer: null, whyTimer: null, fetchedAt: 0, loading: 0, open: new Map(), sigs: {} };

function showJob(id) {
  hideJob();
  jobView.id = id;
  jobView.data = null;
  jobView.open = new Map();
  jobView.sigs = {};
  $("job-body").replaceChildren(h("p", { class: "muted", "aria-busy": "true" }, "Loading job ", h("span", { class: "mono" }, id), "…"));
  loadJob();
  jobView.feed = new Feed(`/v1/admin/events${query({ ids: id })}`, {
    onEvent: (type, doc) => { if (type === "status" && doc.id === jobView.id) onJobStatus(doc); },
    onAuth: (message) => askForKey(message),
  });
  jobView.feed.start();
}

function hideJob() {
  if (jobView.feed) jobView.feed.stop();
  jobView.feed = null;
  clearTimeout(jobView.timer);
  clearTimeout(jobView.linesTimer);
  clearTimeout(jobView.whyTimer);
  jobView.timer = null;
  jobView.linesTimer = null;
  jobView.whyTimer = null;
  jobView.id = null;
}

async function loadJob() {
  const mine = ++jobView.loading;
  const id = jobView.id;
  let data;
  try {
    data = await api(`/v1/admin/jobs/${encodeURIComponent(id)}`);
  } catch (err) {
    if (mine !== jobView.loading || id !== jobView.id) return;
    if (jobView.data) return toast(`The job could not be read again: ${err.message}`, true);
    const hint = err.status === 404
      ? ["Check the id, or ", h("a", { href: "#/jobs" }, "find the job in the list"),
        ". A finished job is kept in Postgres for JOBTIER_PG_JOB_RETENTION_DAYS, then deleted."]
      : [`${err.message}. `, h("button", { type: "button", onclick: () => loadJob() }, "Try again")];
    $("job-body").replaceChildren(emptyState(err.status === 404 ? `No job ${id}` : "The job could not be read", ...hint));
    drawn($("view-job"));
    return;
  }
  if (mine !== jobView.loading || id !== jobView.id) return;
  if (NOT_STARTED.has(data.job.state)) data.explain = await explainOf(id);
  if (mine !== jobView.loading || id !== jobView.id) return;
  jobView.fetchedAt = Date.now();
  // a status the stream brought meanwhile may be newer than the one just read
  if (jobView.data && jobView.data.job.version > data.job.version) data.job = jobView.data.job;
  jobView.data = data;
  renderJob();
  clearTimeout(jobView.linesTimer);
  clearTimeout(jobView.whyTimer);
  if (data.explain) jobView.whyTimer = setTimeout(() => loadWhy(id), WHY_EVERY_MS);
  if (data.job.state === "running") {
    jobView.linesTimer = setTimeout(() => { if (!document.hidden) loadJob(); else onHiddenRunning(); }, LINES_EVERY_MS);
  }
}

/** Why the job has not started (null when it cannot be read: the page shows the rest). */
async function explainOf(id) {
  try {
    return await api(`/v1/admin/jobs/${encodeURIComponent(id)}/explain`);
  } catch {
    return null;
  }
}

/** The explanation read again while the job waits (its place in line moves without a change
 * of its status); a hidden tab reads it when it is shown. */
async function loadWhy(id) {
  if (document.hidden) {
    document.addEventListener("visibilitychange", () => { if (jobView.id === id) loadWhy(id); }, { once: true });
    return;
  }
  const explain = await explainOf(id);
  const data = jobView.data;
  if (id !== jobView.id || !data || !NOT_STARTED.has(data.job.state)) return;
  data.explain = explain;
  renderJob();
  clearTimeout(jobView.whyTimer);
  if (explain) jobView.whyTimer = setTimeout(() => loadWhy(id), WHY_EVERY_MS);
}

/** A hidden tab reads nothing; it reads the job again when it is shown. */
function onHiddenRunning() {
  const id = jobView.id;
  document.addEventListener("visibilitychange", () => { if (jobView.id === id) loadJob(); }, { once: true });
}

/** A newer status from the stream: shown at once; the history is read again (at most once a
 * second: it comes from Postgres, written behind). */
function onJobStatus(doc) {
  const data = jobView.data;
  if (!data || doc.version <= data.job.version) return;
  data.job = doc;
  renderJob();
  clearTimeout(jobView.timer);
  const wait = Math.max(0, 1000 - (Date.now() - jobView.fetchedAt));
  jobView.timer = setTimeout(loadJob, wait + 300);
}

/** Sections are drawn again only when what they show changed (open attempts and scroll
 * positions stay put). */
function section(key, signature, build) {
  const holder = $("job-body").querySelector(`[data-section="${key}"]`);
  if (jobView.sigs[key] === signature && holder) return;
  jobView.sigs[key] = signature;
  const node = build();
  if (node) node.dataset.section = key;
  const placeholder = node || h("div", { hidden: true, dataset: { section: key } });
  holder.replaceWith(placeholder);
}

const JOB_SECTIONS = ["head", "why", "facts", "now", "flow", "attempts", "lines", "history", "relations", "data", "audit"];

function renderJob() {
  const data = jobView.data;
  const job = data.job;
  const root = $("job-body");
  if (!root.querySelector('[data-section="head"]')) {
    root.replaceChildren(...JOB_SECTIONS.map((key) => h("div", { hidden: true, dataset: { section: key } })));
  }
  section("head", JSON.stringify([job.state, job.version]), () => jobHead(data));
  const why = data.explain && NOT_STARTED.has(job.state) ? [data.explain.reasons, data.explain.position] : null;
  section("why", JSON.stringify(why), () => jobWhy(data));
  section("facts", JSON.stringify([job, data.tenant, data.source, data.lag]), () => jobFacts(data));
  section("now", JSON.stringify([job.state, job.progress, job.error]), () => jobNow(job));
  section("flow", JSON.stringify([data.dependencies, data.children, job.dependencies]), () => jobFlow(data));
  section("attempts", JSON.stringify([data.history, job.attempt, job.state]), () => jobAttempts(data));
  section("lines", JSON.stringify([data.lines, data.source, job.state]), () => jobLines(data));
  section("history", JSON.stringify([data.history, data.lag]), () => jobHistory(data));
  section("relations", JSON.stringify(Object.keys(job).filter((k) => !KNOWN_FIELDS.has(k)).map((k) => [k, job[k]])), () => jobRelations(job));
  section("data", JSON.stringify([data.payload, data.result, job.result_url]), () => jobData(data));
  section("audit", JSON.stringify(data.audit), () => jobAudit(data));
  document.title = `${job.id} · ${job.state} · jobtier`;
  drawn($("view-job"));
}

function jobHead(data) {
  const job = data.job;
  return h("div", { class: "job-head" },
    h("h1", { id: "job-title" }, h("span", { class: "sr-only" }, "Job "), job.id),
    stateBadge(job.state),
    job.cancel_requested && !TERMINAL.has(job.state) ? h("span", { class: "tag" }, "cancel requested") : null,
    h("button", { type: "button", class: "small", title: "Copy the id", onclick: () => copyText(job.id) }, "Copy id"),
    h("div", { class: "actions" }, jobActions(job, (doc) => onJobStatus(doc), { small: false, current: () => jobView.data.job })));
}

async function copyText(value) {
  try {
    await navigator.clipboard.writeText(value);
    toast("Copied.");
  } catch {
    toast("The browser did not allow copying; select the id instead.", true);
  }
}

function jobFacts(data) {
  const job = data.job;
  const fact = (label, value) => h("div", {}, h("dt", {}, label), h("dd", {}, value));
  return h("section", { class: "panel", "aria-label": "Facts" }, h("dl", { class: "facts" },
    fact("Type", job.type),
    fact("Queue", h("a", { href: `#/jobs${query({ queue: job.queue })}` }, job.queue)),
    fact("Tenant", h("a", { href: `#/jobs${query({ tenant: data.tenant })}` }, data.tenant)),
    fact("Priority", job.priority),
    fact("Attempt", `${job.attempt} of ${job.max_attempts}`),
    fact("Version", String(job.version)),
    fact("Created", timeEl(job.created_at)),
    fact("Updated", [timeEl(job.updated_at), " (", timeEl(job.updated_at, { ago: true }), ")"]),
    fact("Run at", job.run_at ? timeEl(job.run_at) : "as soon as possible"),
    fact("Worker", job.worker ? h("span", { class: "mono" }, job.worker) : "—"),
    fact("Read from", data.source === "redis"
      ? h("span", { title: "the job is live in Redis: this is its status now" }, "Redis (live)")
      : h("span", { title: "Redis no longer holds it (retention): this is what Postgres kept" }, "Postgres")),
    fact("History", data.lag?.transitions
      ? `Postgres ${joinFmt(fmtSeconds(data.lag.seconds))} behind`
      : "up to date"),
  ));
}

const REASON_TITLES = {
  queue_paused: "Queue paused", queue_concurrency_full: "Queue at its concurrency limit",
  rate_limited: "Rate-limited", breaker_open: "Circuit breaker open",
  concurrency_key_held: "Concurrency key held",
  waiting_for_dependencies: "Waiting for dependencies", scheduled: "Scheduled",
  no_worker_for_queue: "No worker for its queue", no_worker_for_type: "No worker for its task",
  tenant_turn: "Other tenants' turns", in_line: "In line", unknown: "In no line",
  not_relayed: "Not relayed from the outbox yet", expired: "Past its expiry",
};

/** Why a job not started yet has not: each reason in words (its numbers are in the words),
 * the jobs it names as links, and its place in line. */
function jobWhy(data) {
  const e = data.explain;
  if (!e || !e.waiting || !NOT_STARTED.has(data.job.state)) return null;
  const jobs = (label, refs) => (refs?.length
    ? h("div", { class: "muted" }, `${label}: `, refs.flatMap((r, i) => [i ? ", " : "", jobLink(r.id), ` (${r.state || "no longer kept"})`]))
    : null);
  const items = e.reasons.map((r) => h("li", { dataset: { code: r.code } },
    h("strong", {}, REASON_TITLES[r.code] || r.code), " — ", h("span", { class: "why-msg" }, r.message),
    jobs("Held by", r.holders), jobs("Waits for", r.dependencies)));
  return h("section", { class: "panel", id: "job-why", "aria-labelledby": "h-why" },
    h("h2", { id: "h-why" }, "Why it has not started"),
    e.position ? h("p", { id: "why-position" }, `Position ${plain.format(e.position)} in line`) : null,
    h("ul", { id: "why-reasons" }, items),
    h("p", { class: "muted" }, "Read ", timeEl(e.checked_at, { ago: true }), " from the Redis state the claim script decides by."));
}

/** Progress and the latest error, with its traceback. */
function jobNow(job) {
  const parts = [];
  if (job.progress !== null && job.progress !== undefined) {
    const p = job.progress;
    parts.push(h("h2", {}, "Progress"), typeof p === "number" && p >= 0 && p <= 1
      ? h("div", { class: "progress-big" }, progressOf(p))
      : prettyJson(p));
  }
  if (job.error) {
    // a succeeded job keeps the error of the attempt before the one that succeeded
    const title = job.state === "succeeded" ? "Error of an earlier attempt"
      : TERMINAL.has(job.state) ? "Error" : "Last error";
    parts.push(h("h2", {}, title), errorBox(job.error));
  }
  return parts.length ? h("section", { class: "panel", "aria-label": "Progress and error" }, parts) : null;
}

/** An error as recorded: type, message, the traceback when the worker sent one, and any
 * other member shown as it is. */
function errorBox(error) {
  if (typeof error !== "object" || error === null) return prettyJson(error);
  const { type, message, traceback, ...rest } = error;
  return h("div", { class: "error-box" },
    h("div", { class: "what" }, type || "Error"),
    message ? h("div", { class: "msg" }, message) : null,
    traceback ? h("pre", { class: "trace", tabindex: "0", "aria-label": "Traceback" }, traceback) : null,
    Object.keys(rest).length ? prettyJson(rest) : null);
}

/** The jobs it waits for, in its order: each a link to its page, its state in colour and
 * text (a pending one's state now: waiting in a chain, queued, running), and, once finished,
 * its error's type or whether it left a result; for a parent, its children done. */
function jobFlow(data) {
  const deps = data.dependencies || [];
  if (!deps.length) return null;
  const job = data.job;
  const total = job.dependencies?.total ?? deps.length;
  const head = h("h2", { id: "h-flow" }, `Dependencies (${plain.format(total)})`);
  const summary = [];
  if (job.dependencies) {
    const d = job.dependencies;
    summary.push(h("span", { id: "flow-done" }, `${plain.format(d.done)} of ${plain.format(d.total)} finished`,
      d.failed ? `, ${plain.format(d.failed)} did not succeed` : ""));
  }
  if (data.children) {
    const c = data.children;
    summary.push(h("span", { id: "flow-children", class: "tag" }, `children ${plain.format(c.done)} / ${plain.format(c.total)} done`,
      c.failed ? `, ${plain.format(c.failed)} failed` : ""));
  }
  const rows = deps.map((d) => {
    const pending = d.state === "pending";
    const shown = pending && d.now ? d.now : d.state;
    const outcome = d.error ? [h("strong", {}, d.error.type || "Error"), d.error.message ? `: ${d.error.message}` : ""]
      : d.state === "succeeded" ? (d.result ? "result" : "no result (null)")
        : d.state === "missing" ? "no such job (or no longer kept)"
          : pending ? h("span", { class: "muted" }, "not finished") : "—";
    return h("tr", { dataset: { dep: d.id, state: shown } },
      h("td", { "data-label": "Job" }, jobLink(d.id)),
      h("td", { "data-label": "State", "data-col": "state" }, stateBadge(shown)),
      h("td", { "data-label": "Made", class: "muted" }, d.child ? "child (same flow)" : "earlier job"),
      h("td", { "data-label": "Outcome", "data-col": "outcome" }, outcome));
  });
  const more = total > deps.length
    ? h("p", { class: "muted" }, `The first ${plain.format(deps.length)} are listed.`) : null;
  return h("section", { class: "panel", "aria-labelledby": "h-flow" }, head,
    summary.length ? h("p", { class: "flow-summary" }, summary.flatMap((x, i) => (i ? [" · ", x] : [x]))) : null,
    h("div", { class: "table-wrap" }, h("table", { class: "data cards", id: "deps-grid" },
      h("thead", {}, h("tr", {}, ["Job", "State", "Made", "Outcome"].map((c) => h("th", { scope: "col" }, c)))),
      h("tbody", {}, rows))), more);
}

/** Attempts from the history: each claim (queued -> running) up to the transition that
 * ended it, with its worker, duration and error. */
function attemptsOf(history) {
  const out = [];
  let current = null;
  for (const t of history) {
    if (t.to_state === "running" && t.from_state !== "running") {
      current = { n: t.attempt, start: t, end: null, waited: null };
      const before = history[history.indexOf(t) - 1];
      if (before) current.waited = new Date(t.at) - new Date(before.at);
      out.push(current);
    } else if (current && !current.end && t.from_state === "running" && t.to_state !== "running") {
      current.end = t;
    }
  }
  return out;
}

/** Whether the transition that ended an attempt carries that attempt's error: a success
 * carries the previous attempt's (the document keeps its last error), not its own. */
function endError(end) {
  return Boolean(end?.error) && end.to_state !== "succeeded";
}

function jobAttempts(data) {
  const attempts = attemptsOf(data.history);
  const job = data.job;
  if (!attempts.length) {
    if (!job.attempt) return null;
    return h("section", { class: "panel", "aria-labelledby": "h-attempts" }, h("h2", { id: "h-attempts" }, "Attempts"),
      h("p", { class: "muted" }, `Attempt ${job.attempt} is in Redis; its history is not in Postgres yet.`));
  }
  const items = attempts.map((a) => {
    const end = a.end;
    const outcome = end ? end.to_state : "running";
    const label = !end ? "running" : outcome === "scheduled" ? "failed, retried"
      : outcome === "queued" ? (end.error ? "lost, requeued" : "released") : outcome;
    const badge = stateBadge(!end ? "running" : outcome === "scheduled" ? "failed" : outcome, label);
    const took = end ? new Date(end.at) - new Date(a.start.at) : Date.now() - new Date(a.start.at);
    const details = h("details", { class: "attempt", dataset: { attempt: String(a.n) } },
      h("summary", {}, h("strong", {}, `Attempt ${a.n}`), badge,
        h("span", { class: "muted" }, `${end ? "took" : "running for"} ${fmtDuration(took)}`),
        h("span", { class: "muted mono" }, a.start.worker),
        timeEl(a.start.at)),
      h("dl", { class: "kv" },
        h("dt", {}, "Started"), h("dd", {}, timeEl(a.start.at), a.waited !== null ? h("span", { class: "muted" }, ` after waiting ${fmtDuration(a.waited)}`) : null),
        h("dt", {}, "Ended"), h("dd", {}, end ? timeEl(end.at) : "—"),
        h("dt", {}, "Worker"), h("dd", { class: "mono" }, a.start.worker)),
      endError(end) ? errorBox(end.error) : null);
    // the last attempt's error is open at first; then what the reader opened or closed
    details.open = jobView.open.get(a.n) ?? (a === attempts[attempts.length - 1] && endError(end));
    details.addEventListener("toggle", () => jobView.open.set(a.n, details.open));
    return details;
  });
  return h("section", { class: "panel", "aria-labelledby": "h-attempts" }, h("h2", { id: "h-attempts" }, `Attempts (${attempts.length})`), items);
}

/** What the task logged with ctx.log(), oldest first, with the attempt that logged it. Redis
 * keeps them with the job (the latest ones); Postgres does not. */
function jobLines(data) {
  const lines = data.lines || [];
  const head = h("h2", { id: "h-lines" }, `Log lines (${lines.length})`);
  if (!lines.length) {
    const why = data.source === "postgres"
      ? "None left: log lines are kept in Redis with the job, and Redis no longer holds it."
      : !data.job.attempt
        ? TERMINAL.has(data.job.state) ? "None: the task never ran." : "None yet: the task has not run."
        : data.job.state === "running" ? "Nothing logged yet. A task logs with ctx.log(\"…\"); its lines show here."
          : "The task logged nothing. A task logs with ctx.log(\"…\"); its lines show here.";
    return h("section", { class: "panel", "aria-labelledby": "h-lines" }, head, h("p", { class: "muted" }, why));
  }
  const multi = new Set(lines.map((l) => l.attempt)).size > 1;
  const rows = lines.map((l) => h("li", { dataset: { attempt: String(l.attempt) } },
    preciseEl(l.at, { clock: true }), multi ? h("span", { class: "tag" }, `attempt ${l.attempt}`) : null,
    h("span", { class: "line-msg" }, l.message)));
  return h("section", { class: "panel", "aria-labelledby": "h-lines" }, head,
    h("ol", { class: "log-lines", id: "job-lines", tabindex: "0", "aria-label": "Log lines, oldest first" }, rows));
}

/** A time to the millisecond in the viewer's zone (the time of day only with ``clock``); the
 * date, zone and instant in its title. */
function preciseEl(t, { clock = false } = {}) {
  const d = toDate(t);
  if (Number.isNaN(d.getTime())) return h("span", { class: "muted" }, "—");
  return h("time", { datetime: d.toISOString(), title: `${fmtTime(d)} (${ZONE}) · ${d.toISOString()}` },
    (clock ? clockFmt : preciseFmt).format(d));
}

function jobHistory(data) {
  const history = data.history;
  const head = h("h2", { id: "h-history" }, `History (${history.length} change${history.length === 1 ? "" : "s"})`);
  if (!history.length) {
    return h("section", { class: "panel", "aria-labelledby": "h-history" }, head,
      h("p", { class: "muted" }, "No change of this job is in Postgres yet: the persister writes them behind Redis",
        data.lag?.transitions ? ` (${plain.format(data.lag.transitions)} changes to go, ${joinFmt(fmtSeconds(data.lag.seconds))}).` : "."));
  }
  const rows = history.map((t, i) => {
    const prev = history[i - 1];
    const after = prev ? new Date(t.at) - new Date(prev.at) : null;
    const what = t.from_state === t.to_state
      ? (t.cancel_requested && !prev?.cancel_requested ? "cancel requested" : "progress")
      : null;
    const notes = [];
    // an attempt's error, where the attempt ended (later rows carry it until the next one)
    if (t.from_state === "running" && endError(t)) notes.push(errorLine(t.error));
    if (t.progress !== null && t.progress !== undefined && what === "progress") notes.push(progressOf(t.progress));
    return h("tr", { dataset: { version: String(t.version) } },
      h("td", { "data-label": "Version", class: "num" }, String(t.version)),
      h("td", { "data-label": "At", class: "nowrap" }, preciseEl(t.at)),
      h("td", { "data-label": "Change", class: "nowrap" },
        t.from_state ? [stateBadge(t.from_state), " → "] : "created ", stateBadge(t.to_state), what ? h("span", { class: "muted" }, ` ${what}`) : null),
      h("td", { "data-label": "After", class: "num nowrap" }, after === null ? "—" : fmtDuration(after)),
      h("td", { "data-label": "By", class: "mono" }, t.worker),
      h("td", { "data-label": "Attempt", class: "num" }, String(t.attempt)),
      h("td", { "data-label": "Details" }, notes));
  });
  return h("section", { class: "panel", "aria-labelledby": "h-history" }, head,
    h("div", { class: "table-wrap" }, h("table", { class: "data cards", id: "history-grid" },
      h("thead", {}, h("tr", {}, ["#", "At", "Change", "After", "By", "Attempt", "Details"].map((c) => h("th", { scope: "col" }, c)))),
      h("tbody", {}, rows))));
}

/** Members the page does not know (dependencies, a flow's children, …), shown as they are;
 * job ids in them are links. */
function jobRelations(job) {
  const extra = Object.keys(job).filter((k) => !KNOWN_FIELDS.has(k));
  if (!extra.length) return null;
  const order = ["depends_on", "parent", "children"];
  extra.sort((a, b) => (order.indexOf(a) + 1 || 99) - (order.indexOf(b) + 1 || 99) || a.localeCompare(b));
  const label = (k) => ({ depends_on: "Depends on", parent: "Parent", children: "Children" })[k]
    || k.replace(/_/g, " ").replace(/^./, (c) => c.toUpperCase());
  return h("section", { class: "panel", "aria-labelledby": "h-related" }, h("h2", { id: "h-related" }, "Related"),
    h("dl", { class: "kv", id: "job-extra" }, extra.flatMap((k) => [h("dt", {}, label(k)), h("dd", { dataset: { field: k } }, anyValue(job[k]))])));
}

function anyValue(v) {
  if (typeof v === "string") return ID_RE.test(v) ? jobLink(v) : v;
  if (Array.isArray(v) && v.length && v.every((x) => typeof x === "string" && ID_RE.test(x))) {
    return h("span", {}, v.flatMap((id, i) => (i ? [", ", jobLink(id)] : [jobLink(id)])));
  }
  if (v === null || typeof v !== "object") return JSON.stringify(v);
  return prettyJson(v);
}

function jobData(data) {
  const job = data.job;
  const block = (title, id, preview, part, absent) => h("section", { class: "panel", "aria-labelledby": id },
    h("h2", { id }, title, preview.size !== null ? h("span", { class: "muted" }, ` · ${fmtBytes(preview.size)}`) : null),
    preview.ref ? storedResult(job, preview)
    : preview.size === null ? h("p", { class: "muted" }, absent)
      : preview.truncated ? h("p", {}, `Too large to show here (more than 64 KiB). `,
        h("button", { type: "button", onclick: () => downloadValue(job.id, part) }, `Download ${part}`))
        : prettyJson(preview.value));
  const noResult = job.state === "failed" ? "No result: the job failed (see its error)."
    : TERMINAL.has(job.state) ? "No result." : "No result yet: it comes when the job succeeds.";
  return h("div", { class: "cols" },
    block("Payload", "h-payload", data.payload, "payload", "Not known yet: the submit is not in Postgres."),
    block("Result", "h-result", data.result, "result", noResult));
}

/** A large result the result store keeps: never inlined, named by its reference, with its
 * download (the admin route streams it; result_url is the tenant's own link). */
function storedResult(job, preview) {
  if (preview.size === null) {
    return h("p", { id: "result-stored" }, "Kept in the result store (", h("span", { class: "mono" }, preview.ref),
      "), which no longer has it: it was deleted with the job's retention.");
  }
  return h("div", { id: "result-stored" },
    h("p", {}, `Kept in the result store, not in Redis (${fmtBytes(preview.size)}). `,
      h("button", { type: "button", onclick: () => downloadValue(job.id, "result") }, "Download result")),
    h("dl", { class: "kv" },
      h("dt", {}, "Reference"), h("dd", { class: "mono" }, preview.ref),
      job.result_url ? [h("dt", {}, "Tenant's link"), h("dd", { class: "mono" }, job.result_url)] : null));
}

async function downloadValue(id, part) {
  try {
    const response = await fetch(`/v1/admin/jobs/${encodeURIComponent(id)}/${part}`, {
      headers: { authorization: `Bearer ${sessionStorage.getItem(KEY_STORE)}` }, cache: "no-store",
    });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    const url = URL.createObjectURL(await response.blob());
    const a = h("a", { href: url, download: `${id}-${part}.json` });
    document.body.append(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(url), 10000);
  } catch (err) {
    toast(`The ${part} could not be downloaded: ${err.message}`, true);
  }
}

function jobAudit(data) {
  if (!data.audit?.length) return null;
  return h("section", { class: "panel", "aria-labelledby": "h-job-audit" }, h("h2", { id: "h-job-audit" }, "Admin actions on this job"),
    auditTable(data.audit, { target: false }));
}

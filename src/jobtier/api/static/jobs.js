// jobs.js: the job list (#/jobs) and the dead letters (#/dead: the same list, failed jobs
// only, with a bulk replay). Filters live in the URL fragment; pages are keyset cursors from
// Postgres. Rows of jobs in flight follow /v1/admin/events and change in place.

const PAGE_SIZE = 50;
const FILTERS = ["state", "type", "queue", "tenant", "after", "before", "id"];
const STATES = ["waiting", "scheduled", "queued", "running", "succeeded", "failed", "cancelled"];
const jobsView = {
  mode: "jobs", // or "dead"
  filters: {},
  cursors: [null], // the cursor of each page shown so far (Newer goes back one)
  next: null,
  rows: new Map(), // id -> {row, job, tenant}
  feed: null,
  followed: "",
  timer: null,
  loading: 0,
};

/** "2024-05-01T12:00:00" (a datetime-local value, in the viewer's zone) <-> ISO instant. */
function localInput(iso) {
  if (!iso) return "";
  const d = new Date(iso);
  if (Number.isNaN(d.getTime())) return "";
  const pad = (n) => String(n).padStart(2, "0");
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())}T${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
}
function fromLocalInput(value) {
  if (!value) return "";
  const d = new Date(value); // a date-time without an offset is read in the viewer's zone
  return Number.isNaN(d.getTime()) ? "" : d.toISOString();
}

function initJobsView() {
  fillStates(STATES);
  // the states this server has (a newer one may have more): its OpenAPI document says
  fetch("/v1/openapi.json", { cache: "no-store" })
    .then((r) => r.json())
    .then((doc) => {
      const param = doc.paths["/v1/admin/jobs"]?.get?.parameters?.find((p) => p.name === "state");
      if (Array.isArray(param?.schema?.enum)) fillStates(param.schema.enum);
    })
    .catch(() => {}); // the list above stays
  $("job-filters").addEventListener("submit", (event) => {
    event.preventDefault();
    const f = {
      state: jobsView.mode === "dead" ? "" : $("f-state").value,
      type: $("f-type").value.trim(),
      queue: $("f-queue").value.trim(),
      tenant: $("f-tenant").value.trim(),
      after: fromLocalInput($("f-after").value),
      before: fromLocalInput($("f-before").value),
      id: $("f-id").value.trim(),
    };
    const target = `#/${jobsView.mode}${query(f)}`;
    if (location.hash === target) loadJobs(); // the same filters: load again
    else location.hash = target;
  });
  $("f-clear").addEventListener("click", () => { location.hash = `#/${jobsView.mode}`; });
  $("jobs-refresh").addEventListener("click", () => loadJobs());
  $("jobs-older").addEventListener("click", () => {
    if (!jobsView.next) return;
    jobsView.cursors.push(jobsView.next);
    loadJobs();
  });
  $("jobs-newer").addEventListener("click", () => {
    if (jobsView.cursors.length < 2) return;
    jobsView.cursors.pop();
    loadJobs();
  });
  $("jobs-live").addEventListener("change", scheduleRefresh);
  $("replay-matching").addEventListener("click", replayMatching);
}

function fillStates(states) {
  const select = $("f-state");
  const chosen = select.value;
  select.replaceChildren(h("option", { value: "" }, "any"), ...states.map((s) => h("option", { value: s }, s)));
  select.value = chosen;
  STATES.splice(0, STATES.length, ...states);
}

/** Shows the list for route `mode` ("jobs" or "dead") with the fragment's filters. */
function showJobs(mode, params) {
  jobsView.mode = mode;
  jobsView.filters = Object.fromEntries(FILTERS.map((k) => [k, params.get(k) || ""]));
  if (mode === "dead") jobsView.filters.state = "failed";
  jobsView.cursors = [null];
  $("h-jobs").textContent = mode === "dead" ? "Dead letters" : "Jobs";
  $("f-state-label").hidden = mode === "dead";
  $("replay-matching").hidden = mode !== "dead";
  // a replay takes type, queue and tenant only: with an id or time filter the list would
  // show fewer than it replays, so it is not offered under the name "matching"
  const unmatched = ["after", "before", "id"].some((k) => jobsView.filters[k]);
  $("replay-matching").disabled = unmatched;
  $("replay-matching").title = unmatched
    ? "A replay cannot apply the id or time filters: clear them to replay by type, queue or tenant"
    : "";
  $("f-state").value = STATES.includes(jobsView.filters.state) ? jobsView.filters.state : "";
  $("f-type").value = jobsView.filters.type;
  $("f-queue").value = jobsView.filters.queue;
  $("f-tenant").value = jobsView.filters.tenant;
  $("f-after").value = localInput(jobsView.filters.after);
  $("f-before").value = localInput(jobsView.filters.before);
  $("f-id").value = jobsView.filters.id;
  $("f-id").placeholder = idPrefixNow() + "…";
  fillKnownNames();
  loadJobs();
}

/** What the ids of jobs made about now start with: a job id is a ULID (its first ten
 *  characters the time in milliseconds, Crockford base32) then "-shard"; the first four
 *  change every twelve days or so, so they match the recent jobs an example should. */
function idPrefixNow() {
  const digits = "0123456789ABCDEFGHJKMNPQRSTVWXYZ";
  let ms = Date.now();
  let out = "";
  for (let i = 0; i < 10; i++) {
    out = digits[ms % 32] + out;
    ms = Math.floor(ms / 32);
  }
  return out.slice(0, 4);
}

function hideJobs() {
  clearTimeout(jobsView.timer);
  if (jobsView.feed) jobsView.feed.stop();
  jobsView.feed = null;
  jobsView.followed = "";
}

/** The type and queue inputs suggest the names the workers advertise. */
function fillKnownNames() {
  const queues = latest?.queues || [];
  const types = [...new Set(queues.flatMap((q) => q.tasks || []))].sort();
  $("known-types").replaceChildren(...types.map((t) => h("option", { value: t })));
  $("known-queues").replaceChildren(...queues.map((q) => h("option", { value: q.name })));
}

function apiFilters() {
  const f = jobsView.filters;
  return {
    state: f.state, type: f.type, queue: f.queue, tenant: f.tenant,
    created_after: f.after, created_before: f.before, id_prefix: f.id,
  };
}

async function loadJobs() {
  const mine = ++jobsView.loading;
  const cursor = jobsView.cursors[jobsView.cursors.length - 1];
  const holder = $("jobs-table");
  holder.setAttribute("aria-busy", "true");
  let page;
  try {
    page = await api(`/v1/admin/jobs${query({ ...apiFilters(), limit: PAGE_SIZE, cursor })}`);
  } catch (err) {
    if (mine !== jobsView.loading) return;
    holder.removeAttribute("aria-busy");
    holder.replaceChildren(emptyState("The jobs could not be listed", `${err.message}. `,
      h("button", { type: "button", onclick: () => loadJobs() }, "Try again")));
    $("jobs-summary").textContent = "";
    drawn($("view-jobs"));
    return;
  }
  if (mine !== jobsView.loading || $("view-jobs").hidden) return;
  holder.removeAttribute("aria-busy");
  jobsView.next = page.next_cursor;
  renderJobRows(page.jobs);
  const n = page.jobs.length;
  const pageNo = jobsView.cursors.length;
  $("jobs-summary").textContent = n
    ? `${plain.format(n)} job${n === 1 ? "" : "s"}, newest first${pageNo > 1 ? ` · page ${pageNo}` : ""}`
    : "";
  $("jobs-lag").replaceChildren(lagNote(page.lag));
  $("jobs-older").disabled = !page.next_cursor;
  $("jobs-newer").disabled = jobsView.cursors.length < 2;
  followLiveRows();
  scheduleRefresh();
  drawn($("view-jobs"));
}

function lagNote(lag) {
  if (!lag) return "";
  if (!lag.transitions) return h("span", { title: "every change is in Postgres" }, "Postgres is up to date");
  return h("span", { class: lag.seconds > 5 ? "note warn" : "", title: "the list comes from Postgres, written behind Redis" },
    `Postgres is ${joinFmt(fmtSeconds(lag.seconds))} behind (${plain.format(lag.transitions)} changes): the newest may not show yet`);
}

function jobColumns() {
  const middle = jobsView.mode === "dead" ? "Error" : "Progress";
  return ["State", "Job", "Type", "Queue", "Tenant", "Priority", "Attempt", middle, "Created", "Updated"];
}

function renderJobRows(items) {
  const holder = $("jobs-table");
  jobsView.rows = new Map();
  if (!items.length) {
    const filtered = FILTERS.some((k) => k !== "state" && jobsView.filters[k]) || (jobsView.mode === "jobs" && jobsView.filters.state);
    let empty;
    if (filtered) {
      empty = emptyState("No job matches these filters",
        "Widen the time range, check the spelling of the type, queue or tenant, or ",
        h("a", { href: `#/${jobsView.mode}` }, "clear the filters"), ".");
    } else if (jobsView.cursors.length > 1) {
      empty = emptyState("No older jobs", "This is the end of the list.");
    } else if (jobsView.mode === "dead") {
      empty = emptyState("No dead letters",
        "A job that fails for good (out of attempts, or a non-retryable error) lands here, to be inspected and replayed.");
    } else {
      empty = emptyState("No jobs in Postgres yet",
        "Submit one with POST /v1/jobs (the getting-started tour shows how); it shows here once the persister has written it.");
    }
    holder.replaceChildren(empty);
    return;
  }
  const tbody = h("tbody");
  for (const item of items) {
    const row = h("tr", { dataset: { id: item.job.id } });
    jobsView.rows.set(item.job.id, { row, job: item.job, tenant: item.tenant });
    fillJobRow(row, item.job, item.tenant);
    tbody.append(row);
  }
  holder.replaceChildren(h("table", { class: "data cards", id: "jobs-grid" },
    h("thead", {}, h("tr", {}, [...jobColumns(), ""].map((c) => h("th", { scope: "col" }, c || h("span", { class: "sr-only" }, "Actions"))))),
    tbody));
}

/** The error of a failed attempt, in a line: type and message (the job page has all of it). */
function errorLine(error) {
  if (!error) return h("span", { class: "muted" }, "—");
  const line = `${error.type || "error"}: ${error.message ?? ""}`;
  return h("span", { class: "mono", title: line }, line.length > 80 ? line.slice(0, 79) + "…" : line);
}

/** Fills a row (or, when it has cells, updates those that changed: focus stays put). The
 * dead letters show each job's error where the list shows progress. */
function fillJobRow(row, job, tenant) {
  row.dataset.state = job.state;
  const dead = jobsView.mode === "dead";
  const cells = {
    state: () => [stateBadge(job.state),
      job.cancel_requested && !TERMINAL.has(job.state) ? h("span", { class: "tag", title: "a cancel was requested" }, "cancelling") : null],
    id: () => jobLink(job.id),
    type: () => job.type,
    queue: () => job.queue,
    tenant: () => tenant,
    priority: () => job.priority,
    attempt: () => `${job.attempt} / ${job.max_attempts}`,
    [dead ? "error" : "progress"]: () => (dead ? errorLine(job.error) : progressOf(job.progress)),
    created: () => timeEl(job.created_at),
    updated: () => timeEl(job.updated_at, { ago: true }),
  };
  const acts = jobActions(job, (doc) => updateJobRow(doc), {
    current: () => jobsView.rows.get(job.id)?.job || job,
  });
  const actKey = acts.map((b) => b.dataset.act).join(",");
  if (!row.cells.length) {
    Object.entries(cells).forEach(([col, make], i) => {
      const nowrap = ["attempt", "created", "updated"].includes(col) ? "nowrap" : "";
      row.append(h("td", { "data-label": jobColumns()[i], "data-col": col, class: nowrap }, make()));
    });
    row.append(h("td", { class: "actions", "data-acts": actKey }, acts));
    return;
  }
  for (const col of ["state", "attempt", dead ? "error" : "progress", "updated"]) {
    const cell = row.querySelector(`[data-col="${col}"]`);
    cell.replaceChildren();
    append(cell, [cells[col]()]);
  }
  const actions = row.querySelector(".actions");
  if (actions.dataset.acts !== actKey) {
    actions.dataset.acts = actKey;
    actions.replaceChildren(...acts);
  }
}

/** The buttons a job's state allows: Replay a dead letter, Run a scheduled job now, Cancel a
 * job not yet finished.
 * `current()` gives the job as it is when a button is pressed (rows change under them). */
function jobActions(job, onDone, { small = true, current = () => job } = {}) {
  const out = [];
  const cls = small ? "small" : "";
  if (job.state === "failed") {
    out.push(h("button", { type: "button", class: `${cls} danger`, "data-act": "replay", onclick: () => replayJob(current(), onDone) }, "Replay…"));
  }
  if (job.state === "scheduled") {
    out.push(h("button", { type: "button", class: cls, "data-act": "promote", onclick: () => promoteJob(current(), onDone) }, "Run now…"));
  }
  if (!TERMINAL.has(job.state) && !job.cancel_requested) {
    out.push(h("button", { type: "button", class: `${cls} danger`, "data-act": "cancel", onclick: () => cancelJob(current(), onDone) }, "Cancel…"));
  }
  return out;
}

async function replayJob(job, onDone) {
  const doc = await act(
    {
      title: `Replay job ${job.id}?`,
      text: `It goes back to queue ${job.queue} with its attempts reset (it has used ${job.attempt} of ${job.max_attempts}) and runs again.`,
      ok: "Replay",
    },
    () => api(`/v1/admin/dead-letters/${encodeURIComponent(job.id)}/replay`, { method: "POST" }),
    () => `Job ${job.id} replayed: queued again.`,
  );
  if (doc) onDone(doc);
}

async function promoteJob(job, onDone) {
  const doc = await act(
    {
      title: `Run job ${job.id} now?`,
      text: job.attempt > 0
        ? `It is waiting out the back-off of its attempt ${job.attempt}: its next attempt is queued now.`
        : `It is scheduled${job.run_at ? ` for ${job.run_at}` : ""}: it is queued now instead.`,
      ok: "Run now",
    },
    () => api(`/v1/admin/jobs/${encodeURIComponent(job.id)}/promote`, { method: "POST" }),
    () => `Job ${job.id} queued to run now.`,
  );
  if (doc) onDone(doc);
}

async function cancelJob(job, onDone) {
  const running = job.state === "running";
  const doc = await act(
    {
      title: `Cancel job ${job.id}?`,
      text: running
        ? "It is running: its worker is asked to stop at its next heartbeat (a task that finishes first succeeds)."
        : `It is ${job.state}: it is cancelled at once and never runs.`,
      ok: "Cancel job",
    },
    () => api(`/v1/admin/jobs/${encodeURIComponent(job.id)}/cancel`, { method: "POST" }),
    (d) => d.state === "cancelled" ? `Job ${job.id} cancelled.` : `Job ${job.id}: its worker was asked to stop.`,
  );
  if (doc) onDone(doc);
}

/** A newer status document of a listed job: its row changes in place. */
function updateJobRow(doc) {
  const entry = jobsView.rows.get(doc.id);
  if (!entry || doc.version <= entry.job.version) return;
  entry.job = doc;
  fillJobRow(entry.row, doc, entry.tenant);
  entry.row.classList.remove("changed");
  void entry.row.offsetWidth; // restart the highlight
  entry.row.classList.add("changed");
  followLiveRows();
}

/** Follows the listed jobs not yet finished; the set changes as they finish. */
function followLiveRows() {
  const ids = [...jobsView.rows.values()].filter((e) => !TERMINAL.has(e.job.state)).map((e) => e.job.id);
  const key = ids.join(",");
  if (key === jobsView.followed) return;
  jobsView.followed = key;
  if (jobsView.feed) jobsView.feed.stop();
  jobsView.feed = null;
  if (!ids.length) return;
  jobsView.feed = new Feed(`/v1/admin/events${query({ ids: key })}`, {
    onEvent: (type, doc) => { if (type === "status") updateJobRow(doc); },
    onAuth: (message) => askForKey(message),
  });
  jobsView.feed.start();
}

function scheduleRefresh() {
  clearTimeout(jobsView.timer);
  if (!$("jobs-live").checked || $("view-jobs").hidden) return;
  jobsView.timer = setTimeout(() => {
    if (document.visibilityState === "visible" && jobsView.cursors.length === 1) loadJobs();
    else scheduleRefresh();
  }, 5000);
}

async function replayMatching() {
  const f = jobsView.filters;
  const by = [f.type && `type ${f.type}`, f.queue && `queue ${f.queue}`, f.tenant && `tenant ${f.tenant}`].filter(Boolean);
  const limit = 1000;
  const answer = await act(
    {
      title: by.length ? `Replay the dead letters of ${by.join(", ")}?` : "Replay every dead letter?",
      text: `Up to ${plain.format(limit)} of the newest dead letters Redis still holds${by.length ? " that match" : ""} go back to their queues with their attempts reset.`,
      ok: "Replay",
    },
    () => api("/v1/admin/dead-letters/replay", {
      method: "POST",
      json: { type: f.type || null, queue: f.queue || null, tenant: f.tenant || null, limit, all: !by.length },
    }),
    (r) => {
      const held = (r.skipped || []).length;  // their unique keys held by other jobs
      const passed = held ? ` ${plain.format(held)} passed over: another job holds its unique key.` : "";
      return `${plain.format(r.count)} dead letter${r.count === 1 ? "" : "s"} replayed.${passed}`;
    },
  );
  if (answer) loadJobs();
}

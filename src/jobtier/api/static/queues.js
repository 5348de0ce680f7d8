// queues.js: every queue's state from the latest frame (what GET /v1/admin/queues answers,
// with its counters), and the actions on a queue: pause, resume, unblock (a RateLimited's
// hold lifted before its end), purge its ready jobs.

const QUEUE_COLUMNS = [
  // [key, heading, numeric]
  ["state", "State", false],
  ["ready", "Ready", true],
  ...PRIORITIES.map((p) => [p, p, true]),
  ["parked", "Parked", true],
  ["held", "Held by keys", true],
  ["running", "Running", true],
  ["oldest", "Oldest wait", true],
  ["workers", "Workers", true],
  ["in", "In", true],
  ["done", "Done", true],
  ["failing", "Failing", true],
];

/** A queue's state in words: paused, rate-limited until, limited (and how), or active. */
function queueState(q) {
  if (q.paused) return ["paused", "paused", "workers claim nothing from it; submits are accepted"];
  if (q.blocked_until) {
    return ["blocked", `held until ${timeFmt.format(new Date(q.blocked_until * 1000))}`,
      "a task raised RateLimited (or an HTTP worker asked block_queue): no job starts until then"];
  }
  if (q.limits) {
    const parts = [];
    if (q.limits.concurrency) parts.push(`≤ ${q.limits.concurrency} running`);
    if (q.limits.rate) parts.push(`${q.limits.rate} per ${q.limits.per ?? 1} s`);
    return ["limited", `limited: ${parts.join(", ")}`, "global limits across every worker"];
  }
  return ["active", "active", "workers claim from it"];
}

function queueFigures(q) {
  const jobs = jobsCounted();
  const c = (name) => `q:${q.name}:${name}`;
  return {
    ready: q.queued_total,
    critical: q.queued?.critical ?? 0,
    high: q.queued?.high ?? 0,
    normal: q.queued?.normal ?? 0,
    low: q.queued?.low ?? 0,
    parked: q.parked,
    held: q.held ?? 0,
    running: q.running,
    oldest: q.oldest_queued_age_seconds,
    workers: q.workers,
    in: jobs ? rate(c("jobs_submitted_total")) : null,
    done: jobs ? COMPLETED.reduce((sum, n) => sum + rate(c(n)), 0) : null,
    failing: jobs ? ratio(c("jobs_failed_total"), c("jobs_claimed_total")) : null,
  };
}
const QUEUE_FORMAT = { oldest: fmtSeconds, in: fmtRate, done: fmtRate, failing: fmtRatio };

const queueTables = new Map(); // one table per place (overview, queues view), kept
const QUEUES_EMPTY = () => emptyState("No queues yet",
  "A queue appears once a job is submitted to it or a worker advertises a task for it.");

/**
 * Shows the queues in `holder` as a table updated in place: a row per queue (data-queue),
 * kept across frames so that focus, hover and a half-read row stay put; only texts change.
 */
function mountQueueTable(holder, queues, { actions }) {
  let table = queueTables.get(holder.id);
  if (!table) {
    const heads = [h("th", { scope: "col" }, "Queue"),
      ...QUEUE_COLUMNS.map(([key, label, numeric]) => h("th", { scope: "col", class: numeric ? "num" : "" },
        key === "in" ? h("abbr", { title: "jobs submitted per second" }, "In")
          : key === "done" ? h("abbr", { title: "jobs succeeded, dead-lettered or cancelled per second" }, "Done")
          : key === "failing" ? h("abbr", { title: "failed attempts / attempts started, last minute" }, "Failing")
          : label))];
    if (actions) heads.push(h("th", { scope: "col" }, h("span", { class: "sr-only" }, "Actions")));
    table = h("table", { class: "data cards" }, h("thead", {}, h("tr", {}, heads)), h("tbody"));
    queueTables.set(holder.id, table);
  }
  const tbody = table.tBodies[0];
  const rows = new Map([...tbody.rows].map((r) => [r.dataset.queue, r]));
  const names = new Set();
  let before = tbody.firstElementChild;
  for (const q of queues) {
    names.add(q.name);
    let row = rows.get(q.name);
    if (!row) row = queueRow(q, actions);
    updateQueueRow(row, q, actions);
    // the server's order (by name); a row already in place is not moved (focus stays)
    if (row !== before) tbody.insertBefore(row, before);
    else before = before.nextElementSibling;
  }
  for (const [name, row] of rows) if (!names.has(name)) row.remove();
  const node = queues.length ? table : holder.querySelector(".empty") || QUEUES_EMPTY();
  if (holder.firstChild !== node) holder.replaceChildren(node);
}

function queueRow(q, actions) {
  const cells = [h("th", { scope: "row", "data-label": "Queue" },
    h("a", { href: `#/jobs${query({ queue: q.name })}`, title: `Jobs of queue ${q.name}` }, q.name),
    actions ? h("div", { class: "tasks" }) : null)];
  for (const [key, label, numeric] of QUEUE_COLUMNS) {
    cells.push(h("td", { "data-col": key, "data-label": label, class: numeric ? "num" : "" }));
  }
  if (actions) {
    const name = q.name;
    cells.push(h("td", { class: "actions" },
      h("button", { type: "button", class: "small", "data-act": "toggle", onclick: () => togglePause(name) }, "Pause"),
      h("button", { type: "button", class: "small", "data-act": "unblock", hidden: true, onclick: () => unblockQueue(name) }, "Unblock"),
      h("button", { type: "button", class: "small danger", "data-act": "purge", onclick: () => purgeQueue(name) }, "Purge…")));
  }
  return h("tr", { dataset: { queue: q.name } }, cells);
}

function updateQueueRow(row, q, actions) {
  const figures = queueFigures(q);
  const [state, label, hint] = queueState(q);
  const stateCell = row.querySelector('[data-col="state"]');
  if (stateCell.dataset.value !== label) {
    stateCell.dataset.value = label;
    stateCell.replaceChildren(h("span", { class: `state s-${state}`, title: hint }, label));
  }
  for (const [key] of QUEUE_COLUMNS.slice(1)) {
    const cell = row.querySelector(`[data-col="${key}"]`);
    const v = figures[key];
    const shown = joinFmt((QUEUE_FORMAT[key] || fmtCount)(v));
    cell.dataset.value = known(v) ? String(v) : "";
    if (cell.textContent !== shown) cell.textContent = shown;
  }
  if (actions) {
    row.dataset.paused = q.paused ? "1" : "0";
    const toggle = row.querySelector('[data-act="toggle"]');
    const word = q.paused ? "Resume" : "Pause";
    if (toggle.textContent !== word) toggle.textContent = word;
    row.querySelector('[data-act="unblock"]').hidden = !q.blocked_until;
    const purge = row.querySelector('[data-act="purge"]');
    purge.disabled = !(q.queued_total + q.parked);
    const tasks = row.querySelector(".tasks");
    const names = (q.tasks || []).join(" ");
    if (tasks.dataset.names !== names) {
      tasks.dataset.names = names;
      tasks.replaceChildren(...(q.tasks || []).map((t) => h("span", { class: "tag" }, t)));
    }
  }
}

function renderQueuesView() {
  const section = $("view-queues");
  if (section.hidden || !latest) return;
  mountQueueTable($("queues-table"), latest.queues || [], { actions: true });
  renderBreakersPanel(); // (breakers.js: read every 2 s, not with each frame)
  drawn(section);
}

function findQueue(name) {
  return (latest?.queues || []).find((q) => q.name === name);
}

async function togglePause(name) {
  const q = findQueue(name);
  if (q?.paused) {
    await act(
      { title: `Resume queue ${name}?`, text: "Workers start claiming its jobs again.", ok: "Resume" },
      () => api(`/v1/admin/queues/${encodeURIComponent(name)}/resume`, { method: "POST" }),
      () => `Queue ${name} resumed.`,
    );
  } else {
    await act(
      {
        title: `Pause queue ${name}?`,
        text: "Workers stop claiming its jobs at once; submits are still accepted and jobs already running finish.",
        ok: "Pause",
      },
      () => api(`/v1/admin/queues/${encodeURIComponent(name)}/pause`, { method: "POST" }),
      () => `Queue ${name} paused: nothing is claimed from it until you resume it.`,
    );
  }
}

async function unblockQueue(name) {
  const q = findQueue(name);
  const until = q?.blocked_until ? ` (held until ${timeFmt.format(new Date(q.blocked_until * 1000))})` : "";
  await act(
    {
      title: `Unblock queue ${name}?`,
      text: `Workers may start its jobs at once${until}, though the service that asked to slow down `
        + "may still refuse them. A pause stays.",
      ok: "Unblock",
    },
    () => api(`/v1/admin/queues/${encodeURIComponent(name)}/unblock`, { method: "POST" }),
    (r) => r.blocked_until
      ? `Queue ${name} unblocked: its hold until ${timeFmt.format(new Date(r.blocked_until * 1000))} is lifted.`
      : `Queue ${name} was not blocked (its hold had ended).`,
  );
}

async function purgeQueue(name) {
  const q = findQueue(name);
  const n = q ? q.queued_total + q.parked : 0;
  await act(
    {
      title: `Purge the ready jobs of ${name}?`,
      text: `The ${plain.format(n)} job${n === 1 ? "" : "s"} waiting in ${name} are cancelled, oldest first, `
        + "each as a cancel would (their history says so). Scheduled and running jobs stay. "
        + "This cannot be undone; pause the queue first to keep workers from taking some meanwhile.",
      ok: "Purge",
      typed: name,
    },
    () => api(`/v1/admin/queues/${encodeURIComponent(name)}/purge`, { method: "POST" }),
    (r) => `Queue ${name} purged: ${plain.format(r.cancelled)} job${r.cancelled === 1 ? "" : "s"} cancelled`
      + (r.remaining ? `, ${plain.format(r.remaining)} ready now (submitted meanwhile or released by a concurrency key).` : "."),
  );
}

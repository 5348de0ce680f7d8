// workers.js: the live workers (#/workers), read every 2 s while the view is open: host,
// pid, queues, tasks, concurrency, the jobs each runs now, and its last heartbeat.

const workersView = { timer: null, loading: 0 };

function showWorkers() {
  hideWorkers();
  loadWorkers();
}

function hideWorkers() {
  clearTimeout(workersView.timer);
  workersView.timer = null;
}

async function loadWorkers() {
  const mine = ++workersView.loading;
  let data = null;
  let error = null;
  try {
    data = await api("/v1/admin/workers");
  } catch (err) {
    error = err;
  }
  if (mine !== workersView.loading || $("view-workers").hidden) return;
  const holder = $("workers-table");
  if (error) {
    holder.replaceChildren(emptyState("The workers could not be read", `${error.message}. Trying again…`));
  } else {
    renderWorkers(holder, data);
  }
  drawn($("view-workers"));
  // a hidden tab does not poll: it reads again when shown (app.js)
  if (document.visibilityState === "visible") workersView.timer = setTimeout(loadWorkers, 2000);
}

function renderWorkers(holder, data) {
  const n = data.workers.length;
  $("workers-summary").textContent = n
    ? `${n} live worker${n === 1 ? "" : "s"} · ${plain.format(data.running_total)} job${data.running_total === 1 ? "" : "s"} running`
      + (data.running_listed < data.running_total ? ` (${plain.format(data.running_listed)} listed)` : "")
    : "";
  if (!n) {
    holder.replaceChildren(emptyState("No worker is running",
      "Start one with ", h("code", {}, "jobtier worker myapp.tasks"),
      "; it shows here within seconds. A worker stopped without signing off leaves after a minute."));
    return;
  }
  const rows = data.workers.map((w) => {
    const busy = w.concurrency ? w.jobs.length / w.concurrency : 0;
    const bar = h("span", { class: "bar", "aria-hidden": "true" }, h("span"));
    bar.firstChild.style.width = `${Math.min(100, Math.round(busy * 100))}%`;
    const age = Date.now() / 1000 - w.seen_at;
    const jobs = w.jobs.length
      ? h("ul", { class: "plain" }, w.jobs.slice(0, 8).map((j) => h("li", {}, jobLink(j.id), " ",
        h("span", { class: "muted" }, `${j.type} · ${j.tenant} · attempt ${j.attempt} · `), timeEl(j.since, { ago: true }))),
        w.jobs.length > 8 ? h("li", { class: "muted" }, `and ${w.jobs.length - 8} more`) : null)
      : h("span", { class: "muted" }, "idle");
    return h("tr", { dataset: { worker: w.id } },
      h("th", { scope: "row", "data-label": "Worker", class: "mono" }, w.id),
      h("td", { "data-label": "Host" }, w.host, h("span", { class: "muted" }, ` · pid ${w.pid}`)),
      h("td", { "data-label": "Queues" }, w.queues.map((q) => h("a", { class: "tag", href: `#/jobs${query({ queue: q })}` }, q))),
      h("td", { "data-label": "Tasks" }, w.tasks.map((t) => h("span", { class: "tag" }, t))),
      h("td", { "data-label": "Busy", class: "nowrap", "data-col": "busy" }, bar, `${w.jobs.length} / ${w.concurrency}`),
      h("td", { "data-label": "Running" }, jobs),
      h("td", { "data-label": "Heartbeat", class: "nowrap" },
        h("span", { class: age > 30 ? "state s-blocked" : "state s-ok", title: fmtTime(w.seen_at) }, fmtAgo(w.seen_at))));
  });
  swap(holder, h("table", { class: "data cards", id: "workers-grid" },
    h("thead", {}, h("tr", {}, ["Worker", "Host", "Queues", "Tasks", "Busy", "Running jobs", "Last heartbeat"].map((c) => h("th", { scope: "col" }, c)))),
    h("tbody", {}, rows)));
}

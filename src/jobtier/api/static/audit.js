// audit.js: the admin actions (#/audit): who (a fingerprint of the admin key), when, what,
// on what, and the answer; newest first, a page at a time.

const auditView = { cursor: null, records: [], you: "", loading: 0 };

function initAuditView() {
  $("audit-filters").addEventListener("submit", (event) => {
    event.preventDefault();
    const target = `#/audit${query({ action: $("a-action").value, target: $("a-target").value.trim() })}`;
    if (location.hash === target) loadAudit(false);
    else location.hash = target;
  });
  $("audit-older").addEventListener("click", () => loadAudit(true));
}

function showAudit(params) {
  $("a-action").value = params.get("action") || "";
  $("a-target").value = params.get("target") || "";
  loadAudit(false);
}

async function loadAudit(more) {
  const mine = ++auditView.loading;
  const holder = $("audit-table");
  const params = { action: $("a-action").value, target: $("a-target").value.trim(), limit: 50 };
  if (more) params.cursor = auditView.cursor;
  let page;
  try {
    page = await api(`/v1/admin/audit${query(params)}`);
  } catch (err) {
    if (mine !== auditView.loading) return;
    holder.replaceChildren(emptyState("The audit could not be read", `${err.message}. `,
      h("button", { type: "button", onclick: () => loadAudit(false) }, "Try again")));
    drawn($("view-audit"));
    return;
  }
  if (mine !== auditView.loading || $("view-audit").hidden) return;
  auditView.records = more ? [...auditView.records, ...page.records] : page.records;
  auditView.cursor = page.next_cursor;
  auditView.you = page.you;
  $("audit-you").textContent = `you are ${page.you}`;
  $("audit-older").disabled = !page.next_cursor;
  swap(holder, auditView.records.length
    ? auditTable(auditView.records, { target: true })
    : emptyState(params.action || params.target ? "No action matches" : "No admin action yet",
      params.action || params.target
        ? "Clear the filters to see every action."
        : "Cancels, replays, pauses, resumes, limits, purges and breakers opened or closed with the admin key are recorded here."));
  drawn($("view-audit"));
}

const ACTION_WORDS = {
  "job.cancel": "cancelled a job", "job.promote": "ran a scheduled job now", "job.replay": "replayed a job", "dead_letters.replay": "replayed dead letters",
  "queue.pause": "paused a queue", "queue.resume": "resumed a queue", "queue.unblock": "lifted a queue's RateLimited block", "queue.purge": "purged a queue",
  "queue.limits": "set a queue's limits", "breaker.open": "opened a circuit breaker",
  "breaker.close": "closed a circuit breaker",
  "schedule.create": "created a schedule", "schedule.change": "changed a schedule",
  "schedule.pause": "paused a schedule", "schedule.resume": "resumed a schedule",
  "schedule.delete": "deleted a schedule", "schedule.run": "ran a schedule now",
};

function auditTable(records, { target }) {
  const rows = records.map((r) => {
    const ok = r.status < 300;
    const refused = r.detail?.refused ? `${r.detail.refused}: ${r.detail.detail}` : null;
    const detail = refused || (r.detail === null ? "" : JSON.stringify(r.detail));
    const on = ID_RE.test(r.target) ? jobLink(r.target)
      : r.action.startsWith("queue.") ? h("a", { href: `#/jobs${query({ queue: r.target })}` }, r.target)
      : h("span", { class: "mono" }, r.target);
    return h("tr", { dataset: { id: r.id, action: r.action } },
      h("td", { "data-label": "When", class: "nowrap" }, timeEl(r.at)),
      h("td", { "data-label": "Who", class: "mono" }, r.actor, r.actor === auditView.you ? h("span", { class: "muted" }, " (you)") : null),
      h("td", { "data-label": "Action" }, h("span", { title: ACTION_WORDS[r.action] || r.action }, r.action)),
      target ? h("td", { "data-label": "Target" }, on) : null,
      h("td", { "data-label": "Answer" }, h("span", { class: `state ${ok ? "s-ok" : "s-refused"}` }, `${r.status} ${ok ? "done" : r.status >= 500 ? "failed" : "refused"}`)),
      h("td", { "data-label": "Details", class: "mono" }, detail.length > 160 ? h("span", { title: detail }, detail.slice(0, 159) + "…") : detail),
      h("td", { "data-label": "From", class: "muted" }, r.source || "—"));
  });
  const heads = ["When", "Who", "Action", target ? "Target" : null, "Answer", "Details", "From"].filter(Boolean);
  return h("table", { class: "data cards audit-grid" },
    h("thead", {}, h("tr", {}, heads.map((c) => h("th", { scope: "col" }, c)))),
    h("tbody", {}, rows));
}

// breakers.js: the circuit breakers (GET /v1/admin/breakers) under the queues, read at most
// every 2 s while the queues view is drawn, and opening or closing one by hand (audited).

const breakersView = { readAt: 0, loading: 0 };
const BREAKER_STATES = {
  closed: ["active", "closed", "jobs of it start as any other"],
  open: ["blocked", "open", "no job of it starts on any worker; they wait without using attempts"],
  half_open: ["limited", "half-open", "its next jobs are probes: a success closes it, a failure opens it again"],
};

/** Called as the queues view draws (every frame): reads the breakers again every 2 s. */
function renderBreakersPanel(force = false) {
  if ($("view-queues").hidden) return;
  const now = Date.now();
  if (!force && now - breakersView.readAt < 2000) return;
  breakersView.readAt = now;
  loadBreakers();
}

async function loadBreakers() {
  const mine = ++breakersView.loading;
  let data = null;
  let error = null;
  try {
    data = await api("/v1/admin/breakers");
  } catch (err) {
    error = err;
  }
  if (mine !== breakersView.loading) return;
  const holder = $("breakers-table");
  if (error) {
    holder.replaceChildren(emptyState("The breakers could not be read", `${error.message}. Trying again…`));
  } else {
    swap(holder, breakersTable(data.breakers));
  }
  holder.dataset.loaded = String(Number(holder.dataset.loaded || 0) + 1);
}

function breakersTable(breakers) {
  if (!breakers.length) {
    return emptyState("No circuit breakers yet",
      "A breaker appears once a task declared with ", h("code", {}, "@task(breaker=…)"),
      " records a downstream failure, or once one is opened by hand.");
  }
  const heads = ["Breaker", "State", "Until", "Trips", "Reason"].map((t) => h("th", { scope: "col" }, t));
  heads.push(h("th", { scope: "col" }, h("span", { class: "sr-only" }, "Actions")));
  const rows = breakers.map((b) => {
    const [style, label, hint] = BREAKER_STATES[b.state] || ["other", b.state, ""];
    const until = b.state !== "open" ? "—"
      : b.open_until ? timeFmt.format(new Date(b.open_until * 1000)) : "until closed by hand";
    const act = b.state === "closed"
      ? h("button", { type: "button", class: "small danger", "data-act": "open", onclick: () => openBreaker(b.name) }, "Open…")
      : h("button", { type: "button", class: "small", "data-act": "close", onclick: () => closeBreaker(b.name) }, "Close");
    return h("tr", { dataset: { queue: `breaker:${b.name}` } },
      h("th", { scope: "row", "data-label": "Breaker" }, b.name),
      h("td", { "data-label": "State" }, h("span", { class: `state s-${style}`, title: hint }, label)),
      h("td", { "data-label": "Until" }, until),
      h("td", { "data-label": "Trips", class: "num" }, String(b.trips)),
      h("td", { "data-label": "Reason" }, b.reason || "—"),
      h("td", { class: "actions" }, act));
  });
  return h("table", { class: "data cards" }, h("thead", {}, h("tr", {}, heads)), h("tbody", {}, rows));
}

async function openBreaker(name) {
  await act(
    {
      title: `Open breaker ${name}?`,
      text: "No job of it starts on any worker until you close it; they wait without using attempts.",
      ok: "Open",
    },
    () => api(`/v1/admin/breakers/${encodeURIComponent(name)}/open`, { method: "POST", json: { reason: "opened from the console" } }),
    () => `Breaker ${name} open: its jobs wait until you close it.`,
  );
  renderBreakersPanel(true);
}

async function closeBreaker(name) {
  await act(
    { title: `Close breaker ${name}?`, text: "Its jobs start again as their waits end.", ok: "Close" },
    () => api(`/v1/admin/breakers/${encodeURIComponent(name)}/close`, { method: "POST", json: { reason: "closed from the console" } }),
    () => `Breaker ${name} closed.`,
  );
  renderBreakersPanel(true);
}

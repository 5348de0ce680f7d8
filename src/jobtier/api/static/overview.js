// overview.js: the frames of /v1/admin/dashboard/stream (one a second) turned into figures,
// rates and sparklines; the latest frame also feeds the queues view and the tab badges.

const WINDOW_S = 120; // history the sparklines show
// Rates are measured over a few seconds, not frame to frame: each process publishes its
// counters every ~2 s, so a 1 s difference flickers between zero and double. An even span
// holds the same number of publications whatever the phase.
const RATE_S = 6;
const RATIO_S = 60; // failure ratio and near-cache hit ratio: over the last minute
const COMPLETED = ["jobs_succeeded_total", "jobs_dead_lettered_total", "jobs_cancelled_total"];

// frames: {t, f, c}; c holds each counter's running total of *increases* seen by this page,
// so differences of c are the work done between two frames (see ingest()). A queue's
// counters are kept under "q:<queue>:<counter>".
const frames = [];
const series = {}; // name -> [[t, value | null], ...]
let latest = null; // the last frame

function flatCounters(f) {
  const out = { ...(f.counters || {}) };
  for (const q of f.queues || []) {
    for (const [name, v] of Object.entries(q.counters || {})) out[`q:${q.name}:${name}`] = v;
  }
  return out;
}

function ingest(f) {
  const prev = frames[frames.length - 1];
  // A sum that goes down means a process restarted (or went quiet); a counter that appears
  // brings its whole past at once. Neither is work done in the last second: that frame
  // counts 0 for it.
  const flat = flatCounters(f);
  const c = {};
  const names = new Set([...Object.keys(flat), ...(prev ? Object.keys(prev.c) : [])]);
  for (const name of names) {
    const now = flat[name];
    const before = prev?.flat[name];
    const step = known(now) && known(before) && now >= before ? now - before : 0;
    c[name] = (prev?.c[name] ?? 0) + step;
  }
  frames.push({ t: f.at, f, c, flat });
  while (frames.length > 2 && frames[0].t < f.at - WINDOW_S - RATIO_S) frames.shift();
  latest = f;
}

/** Counter increase over the last `span` seconds, and the seconds it covers. */
function increase(name, span) {
  const last = frames[frames.length - 1];
  let i = frames.length - 1;
  while (i > 0 && last.t - frames[i - 1].t <= span + 0.25) i--;
  const first = frames[i];
  return [(last.c[name] ?? 0) - (first.c[name] ?? 0), last.t - first.t];
}
function rate(name, span = RATE_S) {
  const [n, dt] = increase(name, span);
  return dt > 0 ? n / dt : null;
}
function ratio(num, den, span = RATIO_S) {
  const [a] = increase(num, span);
  const [b] = increase(den, span);
  return b > 0 ? a / b : null;
}
function record(name, t, v) {
  const s = (series[name] ||= []);
  s.push([t, known(v) ? v : null]);
  while (s.length && s[0][0] < t - WINDOW_S) s.shift();
}
/** Whether the job counters are known: a persister counts them (each appears once > 0). */
function jobsCounted() {
  return frames.length > 1 && Object.keys(latest?.counters || {}).some((k) => k.startsWith("jobs_"));
}

function windowSpan() {
  // the charts stretch over the history there is, up to WINDOW_S (at least 10 s)
  const t1 = frames[frames.length - 1].t;
  const t0 = Math.max(frames[0].t, t1 - WINDOW_S);
  return [Math.min(t0, t1 - 10), t1];
}
function windowText() {
  const [t0, t1] = windowSpan();
  const s = Math.round(t1 - t0);
  return s >= 110 ? "last 2 min" : `last ${s} s`;
}

/** Show a figure in its tile, formatted by `fmt`; the figure, for its sparkline. */
function figure(id, value, fmt) {
  show(id, value, fmt(value));
  return value;
}

function renderOverview(f) {
  const t = f.at;
  const depth = PRIORITIES.map((p) => f.queue_depth?.[p] ?? 0);
  const total = depth.reduce((a, b) => a + b, 0);
  figure("queue-depth", total, fmtCount);
  PRIORITIES.forEach((p, i) => {
    record(`depth-${p}`, t, figure(`depth-${p}`, depth[i], fmtCount));
    $("depth-split").children[i].style.width = total ? `${(100 * depth[i]) / total}%` : "0";
  });
  figure("oldest-age", f.oldest_queued_age_seconds, fmtSeconds);
  figure("scheduled", f.scheduled, fmtCount);

  // Rates need two frames. The job counters come from the persister (it sees every
  // transition once) and each appears only once it is non-zero: with some present, an
  // absent one is 0; with none, nobody counts them (no persister) and they stay unknown.
  const enough = frames.length > 1;
  const jobs = jobsCounted();
  const jobRate = (name) => (jobs ? rate(name) : null);
  const completed = jobs ? COMPLETED.reduce((sum, n) => sum + rate(n), 0) : null;
  record("submitted", t, figure("rate-submitted", jobRate("jobs_submitted_total"), fmtRate));
  record("completed", t, figure("rate-completed", completed, fmtRate));
  figure("rate-succeeded", jobRate("jobs_succeeded_total"), fmtRate);
  figure("rate-claimed", jobRate("jobs_claimed_total"), fmtRate);

  const failRatio = jobs ? ratio("jobs_failed_total", "jobs_claimed_total") : null;
  record("failure", t, figure("failure-ratio", failRatio, fmtRatio));
  figure("rate-failed", jobRate("jobs_failed_total"), fmtRate);
  figure("rate-retried", jobRate("jobs_retried_total"), fmtRate);

  record("dead", t, figure("dead-letters", f.dead_letters, fmtCount));
  const [deadNew] = increase("jobs_dead_lettered_total", WINDOW_S);
  show("dead-new", jobs ? deadNew : null, jobs ? ["+" + fmtCount(deadNew)[0], ""] : ["—", ""]);

  figure("workers", f.workers, fmtCount);
  record("running", t, figure("running", f.running, fmtCount));

  const hasPg = f.lag_transitions !== null && f.lag_transitions !== undefined;
  show("lag-seconds", f.lag_seconds, hasPg ? fmtSeconds(f.lag_seconds) : ["n/a", ""]);
  figure("lag-transitions", f.lag_transitions, fmtCount);
  $("lag-transitions").hidden = !hasPg;
  $("lag-note").lastChild.textContent = hasPg
    ? " transitions not yet in Postgres"
    : "no Postgres configured: nothing is written behind";
  record("lag", t, hasPg ? f.lag_seconds : null);

  record("wait", t, figure("p99-claim-wait", f.p99_claim_wait_seconds, fmtSeconds));
  record("run", t, figure("p99-run-time", f.p99_run_time_seconds, fmtSeconds));
  // the workers publish these histograms; the server keeps the last minute of them
  const windowed = known(f.p99_window_seconds);
  const span = windowed ? `last ${Math.round(f.p99_window_seconds)} s` : "since the workers started";
  const idle = windowed ? `no jobs in the ${span}` : "no worker has reported one yet";
  // a histogram's p99 is the bound of the bucket it falls in: the figure is "at most"
  $("wait-note").textContent = known(f.p99_claim_wait_seconds) ? `at most · queued → claimed, ${span}` : idle;
  $("run-note").textContent = known(f.p99_run_time_seconds) ? `at most · task duration, ${span}` : idle;

  const reads = enough ? rate("status_requests_total") : null;
  record("reads", t, figure("rate-status-reads", reads, fmtRate));
  figure("rate-redis-loads", enough ? rate("status_redis_loads_total") : null, fmtRate);
  const hits = enough ? ratio("status_near_cache_hits_total", "status_requests_total") : null;
  figure("near-cache-ratio", hits, fmtRatio);
  renderShedding(f);

  if (!$("view-overview").hidden) {
    mountQueueTable($("queue-summary"), f.queues || [], { actions: false });
  }
  drawSparks();
}

// what each chip in the header stands for (its tooltip): a process's role
const ROLES = {
  api: "the HTTP API (jobtier api)",
  worker: "workers running tasks (jobtier worker)",
  scheduler: "the scheduler: delayed jobs and schedules (jobtier scheduler)",
  persister: "the persister: history into Postgres (jobtier persister)",
  dispatcher: "the webhook dispatcher (jobtier dispatcher)",
  resolver: "the resolver: flows' dependencies (jobtier resolver)",
  run: "jobtier run: every part in one process (development)",
};

/** The header: processes reporting, time of the last frame, the dead-letter badge. */
function renderChrome(f) {
  const chip = (p) => h("span", { class: "chip", title: `Reporting: ${ROLES[p] || p}` }, p);
  $("processes").replaceChildren(...(f.processes || []).map(chip));
  $("updated").textContent = "updated " + timeFmt.format(new Date(f.at * 1000));
  const dead = $("nav-dead");
  dead.hidden = !f.dead_letters;
  dead.textContent = f.dead_letters ? fmtCount(f.dead_letters)[0] : "";
  dead.title = `${plain.format(f.dead_letters || 0)} jobs in the dead-letter set`;
}

function drawSparks() {
  if (!frames.length || $("view-overview").hidden) return;
  const [t0, t1] = windowSpan();
  const opts = { t0, t1, windowLabel: windowText() };
  const s = (name) => series[name] || [];
  spark($("spark-depth"), [
    { name: "low", data: s("depth-low"), color: palette.slate },
    { name: "normal", data: s("depth-normal"), color: palette.blue },
    { name: "high", data: s("depth-high"), color: palette.orange },
    { name: "critical", data: s("depth-critical"), color: palette.red },
  ], { ...opts, stack: true, label: "Queue depth by priority" });
  spark($("spark-throughput"), [
    { name: "submitted", data: s("submitted"), color: palette.blue },
    { name: "completed", data: s("completed"), color: palette.green },
  ], { ...opts, fmt: fmtRate, label: "Jobs per second" });
  spark($("spark-failures"), [{ data: s("failure"), color: palette.red }],
    { ...opts, floor: 0.1, fmt: fmtRatio, label: "Share of attempts failing" });
  spark($("spark-dead"), [{ data: s("dead"), color: palette.red }],
    { ...opts, label: "Dead-letter queue size" });
  spark($("spark-running"), [{ data: s("running"), color: palette.teal }],
    { ...opts, label: "Jobs running" });
  spark($("spark-lag"), [{ data: s("lag"), color: palette.amber }],
    { ...opts, floor: 0.1, fmt: fmtSeconds, label: "Persister lag" });
  spark($("spark-wait"), [{ data: s("wait"), color: palette.violet }],
    { ...opts, floor: 0.01, fmt: fmtSeconds, label: "p99 claim wait" });
  spark($("spark-run"), [{ data: s("run"), color: palette.violet }],
    { ...opts, floor: 0.01, fmt: fmtSeconds, label: "p99 run time" });
  spark($("spark-reads"), [{ data: s("reads"), color: palette.teal }],
    { ...opts, fmt: fmtRate, label: "Status reads per second" });
  $("window-label").textContent = opts.windowLabel;
  for (const el of document.querySelectorAll(".window-short")) el.textContent = opts.windowLabel.replace("last ", "");
}

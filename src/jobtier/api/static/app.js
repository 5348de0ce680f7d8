// app.js: the key, the overview stream that says whether the console is live, and the
// router: the URL fragment names the view (#/, #/jobs?…, #/jobs/<id>, #/dead?…, #/queues,
// #/workers, #/audit?…), so that views can be linked to and Back works.

const STREAM_URL = "/v1/admin/dashboard/stream";
const STALL_S = 10; // frames come every second: this long without one, the stream is dead
const VIEWS = ["overview", "jobs", "job", "queues", "workers", "audit"];
let overviewFeed = null;
let ready = false; // a first frame arrived with this key: the views may show

function setState(state, label) {
  body.dataset.state = state;
  // rewriting the same text would make screen readers announce it again
  if ($("conn-state").textContent !== label) $("conn-state").textContent = label;
  const signedIn = state !== "need-key" && state !== "unauthorized";
  $("login").hidden = signedIn;
  $("forget").hidden = !signedIn;
  $("nav").hidden = !signedIn || !ready;
  $("view-overview").classList.toggle("stale", state !== "live");
}

function banner(message) {
  $("banner").hidden = !message;
  $("banner-text").textContent = message || "";
}

function askForKey(message) {
  stopAll();
  ready = false;
  sessionStorage.removeItem(KEY_STORE);
  const error = $("key-error");
  error.hidden = !message;
  error.textContent = message || "";
  banner("");
  for (const view of VIEWS) $(`view-${view}`).hidden = true;
  body.dataset.view = "";
  setState(message ? "unauthorized" : "need-key", message ? "Key refused" : "Not connected");
  $("key-input").focus();
}
authLost.push(askForKey);

function stopAll() {
  if (overviewFeed) overviewFeed.stop();
  overviewFeed = null;
  hideJobs();
  hideJob();
  hideWorkers();
}

function connect() {
  if (!sessionStorage.getItem(KEY_STORE)) return askForKey("");
  if (overviewFeed) overviewFeed.stop();
  overviewFeed = new Feed(STREAM_URL, {
    stallSeconds: STALL_S,
    onEvent: (type, frame) => { if (type === "frame") onFrame(frame); },
    onAuth: (message) => askForKey(message),
    onState: (state, reason, left) => {
      if (state === "connecting") setState("connecting", "Connecting…");
      else if (state === "live") {
        setState("live", "Live");
        banner("");
      } else if (state === "reconnecting") {
        setState("reconnecting", "Reconnecting…");
        if (reason) {
          const last = overviewFeed?.lastEventAt;
          const since = last ? ` · last data ${timeFmt.format(new Date(last))}` : "";
          banner(`Connection lost (${reason}). Retrying in ${left} s${since}.`);
        }
      }
    },
  });
  overviewFeed.start();
}

function onFrame(frame) {
  ingest(frame);
  renderChrome(frame);
  if (!ready) {
    ready = true;
    $("nav").hidden = false;
    route();
  }
  renderOverview(frame);
  renderQueuesView();
  body.dataset.frames = String(Number(body.dataset.frames) + 1);
}

// --- the router ------------------------------------------------------------------------------
function parseHash() {
  const raw = location.hash.replace(/^#\/?/, "");
  const [path, search = ""] = raw.split("?");
  const parts = path.split("/").filter(Boolean).map(decodeURIComponent);
  return { parts, params: new URLSearchParams(search) };
}

function route() {
  if (!ready) return;
  const { parts, params } = parseHash();
  let view = "overview";
  let tab = "overview";
  if (parts[0] === "jobs" && parts[1]) [view, tab] = ["job", "jobs"];
  else if (parts[0] === "jobs") [view, tab] = ["jobs", "jobs"];
  else if (parts[0] === "dead") [view, tab] = ["jobs", "dead"];
  else if (["queues", "workers", "audit"].includes(parts[0])) [view, tab] = [parts[0], parts[0]];
  const changed = body.dataset.view !== (view === "jobs" ? tab : view);
  hideJobs();
  hideJob();
  hideWorkers();
  for (const v of VIEWS) $(`view-${v}`).hidden = v !== view;
  body.dataset.view = view === "jobs" ? tab : view;
  for (const link of $("nav").querySelectorAll("a")) {
    if (link.dataset.view === tab) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
  document.title = { overview: "Overview", jobs: "Jobs", dead: "Dead letters", job: "Job", queues: "Queues",
    workers: "Workers", audit: "Audit" }[view === "jobs" ? tab : view] + " · jobtier";
  if (view === "overview") {
    if (latest) renderOverview(latest);
    drawSparks();
  } else if (view === "jobs") showJobs(tab, params);
  else if (view === "job") showJob(parts[1]);
  else if (view === "queues") renderQueuesView();
  else if (view === "workers") showWorkers();
  else if (view === "audit") showAudit(params);
  if (changed && document.activeElement !== $("key-input")) {
    // a new view: reading (and the keyboard) starts at its top
    $("main").focus({ preventScroll: true });
    scrollTo(0, 0);
  }
}

// --- wiring -------------------------------------------------------------------------------
$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const input = $("key-input");
  const key = input.value.trim();
  if (!key) return;
  sessionStorage.setItem(KEY_STORE, key);
  input.value = "";
  $("key-error").hidden = true;
  connect();
});
$("forget").addEventListener("click", () => askForKey(""));
$("retry-now").addEventListener("click", () => overviewFeed?.retryNow());
addEventListener("hashchange", route);
addEventListener("resize", drawSparks);
matchMedia("(prefers-color-scheme: dark)").addEventListener("change", () => { readPalette(); drawSparks(); });
document.addEventListener("visibilitychange", () => {
  // the workers view polls; a hidden tab need not (it reads again when shown)
  if (document.visibilityState === "visible" && body.dataset.view === "workers") showWorkers();
});

$("zone").textContent = `times in ${ZONE}`;
initJobsView();
initAuditView();
readPalette();
if (sessionStorage.getItem(KEY_STORE)) connect();
else askForKey("");

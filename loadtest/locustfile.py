"""Load-test jobtier's HTTP API with locust: pollers, submitters, SSE watchers, and their mix.

    loadtest/run.sh                          # headless, 50 users, 30 s, the mix; reports saved
    loadtest/run.sh --scenario poller -u 200 -t 60s
    locust -f loadtest/locustfile.py         # locust's web UI on http://127.0.0.1:8089

User classes (name them on locust's command line to run only some; none named = the mix):

Poller     ``GET /v1/jobs/{id}`` as fast as answers come back, sending the ``ETag`` it last
           saw as ``If-None-Match`` (a ``304`` is a success). A ``LOADTEST_HOT_RATIO`` share of
           the reads go to a few hot jobs (thousands of clients polling the same job), the rest
           spread over many. The jobs are submitted at test start in batches
           (``POST /v1/jobs/batch``), or read from ``LOADTEST_JOB_IDS`` / ``LOADTEST_JOBS_FILE``.
Submitter  ``POST /v1/jobs``; optionally a share with a fresh ``Idempotency-Key``, and a share
           re-sending an earlier keyed submit (which must answer 200 with the same job).
Watcher    submits a job (a short ``sleep`` by default) and holds its SSE stream
           ``GET /v1/jobs/{id}/events`` until the terminal state, checking that versions only
           grow and that the stream ends there. Besides the request itself it reports three
           custom entries of type ``SSE`` (the columns are locust's, so read them as labelled):
             ``events: first``  time from the request to the first event, ms;
             ``events: stream`` time from the request to the end of the stream, ms
                                 (its "size" column: bytes read);
             ``events: count``  events per stream, in the *response time* columns.
Mix        all three at once, by class weight (``LOADTEST_WEIGHTS``).

Configuration (environment):

JOBTIER_URL             the API (default http://127.0.0.1:8000; ``--host`` overrides it)
JOBTIER_KEY             a tenant's API key (required)
LOADTEST_ALLOW_REMOTE   1 to allow a target other than a loopback address (default: refuse)
LOADTEST_HOT_JOBS       hot jobs to submit at start (default 5)
LOADTEST_SPREAD_JOBS    spread jobs to submit at start (default 1000)
LOADTEST_HOT_RATIO      share of status reads on the hot jobs, 0..1 (default 0.8)
LOADTEST_JOB_IDS        comma-separated job ids to poll instead (the first HOT_JOBS are hot)
LOADTEST_JOBS_FILE      a file of job ids, one a line, to poll instead (likewise)
LOADTEST_SEED_TYPE      task type of the jobs submitted at start (default echo)
LOADTEST_SEED_PAYLOAD   their payload, JSON (default {}); e.g. type sleep with
                        {"seconds": 60} keeps versions moving while pollers read them
LOADTEST_SUBMIT_TYPE    task type the Submitter submits (default echo)
LOADTEST_IDEMPOTENCY    share of submits carrying a fresh Idempotency-Key, 0..1 (default 0)
LOADTEST_DUPLICATES     share of submits re-sending an earlier keyed submit, 0..1 (default 0)
LOADTEST_WATCH_TYPE     task type the Watcher submits and watches (default sleep)
LOADTEST_WATCH_PAYLOAD  its payload, JSON (default {"seconds": 1})
LOADTEST_WATCH_TIMEOUT  seconds a stream may take before it counts as failed (default 60)
LOADTEST_WAIT           seconds each user waits between its tasks (default 0: closed loop,
                        as fast as the server answers)
LOADTEST_WEIGHTS        class weights of the mix (default poller=80,submitter=15,watcher=5)

Distributed runs (``--master`` / ``--worker``): every worker process submits its own set of
jobs at test start, so N workers poll N hot sets; give them one ``LOADTEST_JOBS_FILE`` to
share a set. See run.sh for the commands, and for why this closed-loop harness
underestimates tail latency (``bench/status_read.py`` has the open-loop figures).
"""

from __future__ import annotations

import ipaddress
import itertools
import json
import os
import random
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import gevent
import requests
from locust import FastHttpUser, HttpUser, constant, events, task
from locust.env import Environment
from locust.exception import StopUser
from locust.runners import MasterRunner

TERMINAL = frozenset({"succeeded", "failed", "cancelled"})
BATCH = 1000  # the API's default JOBTIER_MAX_BATCH


# --- configuration ---------------------------------------------------------------------------
def _float(env: Mapping[str, str], name: str, default: float, high: float | None = None) -> float:
    raw = env.get(name, "")
    try:
        value = float(raw) if raw else default
    except ValueError:
        raise SystemExit(f"loadtest: {name}={raw!r} is not a number") from None
    if value < 0 or (high is not None and value > high):
        raise SystemExit(f"loadtest: {name}={raw!r} is out of range [0, {high}]")
    return value


def _json(env: Mapping[str, str], name: str, default: Any) -> Any:
    raw = env.get(name)
    if not raw:
        return default
    try:
        return json.loads(raw)
    except ValueError:
        raise SystemExit(f"loadtest: {name} is not valid JSON: {raw!r}") from None


@dataclass(frozen=True)
class Config:
    """The harness's settings (the variables documented at the top of this file)."""

    url: str
    key: str
    allow_remote: bool
    hot_jobs: int
    spread_jobs: int
    hot_ratio: float
    job_ids: str
    jobs_file: str
    seed_type: str
    seed_payload: Any
    submit_type: str
    idempotency: float
    duplicates: float
    watch_type: str
    watch_payload: Any
    watch_timeout: float
    wait: float
    weights: str

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Config:
        return cls(
            url=env.get("JOBTIER_URL", "http://127.0.0.1:8000").rstrip("/"),
            key=env.get("JOBTIER_KEY", ""),
            allow_remote=env.get("LOADTEST_ALLOW_REMOTE", "") == "1",
            hot_jobs=int(_float(env, "LOADTEST_HOT_JOBS", 5)),
            spread_jobs=int(_float(env, "LOADTEST_SPREAD_JOBS", 1000)),
            hot_ratio=_float(env, "LOADTEST_HOT_RATIO", 0.8, high=1.0),
            job_ids=env.get("LOADTEST_JOB_IDS", ""),
            jobs_file=env.get("LOADTEST_JOBS_FILE", ""),
            seed_type=env.get("LOADTEST_SEED_TYPE", "echo"),
            seed_payload=_json(env, "LOADTEST_SEED_PAYLOAD", {}),
            submit_type=env.get("LOADTEST_SUBMIT_TYPE", "echo"),
            idempotency=_float(env, "LOADTEST_IDEMPOTENCY", 0.0, high=1.0),
            duplicates=_float(env, "LOADTEST_DUPLICATES", 0.0, high=1.0),
            watch_type=env.get("LOADTEST_WATCH_TYPE", "sleep"),
            watch_payload=_json(env, "LOADTEST_WATCH_PAYLOAD", {"seconds": 1}),
            watch_timeout=max(1.0, _float(env, "LOADTEST_WATCH_TIMEOUT", 60.0)),
            wait=_float(env, "LOADTEST_WAIT", 0.0),
            weights=env.get("LOADTEST_WEIGHTS", "poller=80,submitter=15,watcher=5"),
        )


CONFIG = Config.from_env(os.environ)


def class_weights(spec: str) -> dict[str, int]:
    weights = {}
    for item in filter(None, (p.strip() for p in spec.split(","))):
        name, _, value = item.partition("=")
        if name not in ("poller", "submitter", "watcher") or not value.isdigit():
            raise SystemExit(f"loadtest: LOADTEST_WEIGHTS entry {item!r} is not name=integer")
        weights[name] = int(value)
    return weights


def check_target(url: str, allow_remote: bool) -> None:
    """Refuse to load anything but this machine unless asked to: a load test pointed at the
    wrong URL is an outage for someone else."""
    host = urlsplit(url).hostname or ""
    if allow_remote:
        return
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise SystemExit(
            f"loadtest: refusing to load {url}: only loopback targets (127.0.0.1) unless "
            "LOADTEST_ALLOW_REMOTE=1"
        )


def target(environment: Environment) -> str:
    return (environment.host or CONFIG.url).rstrip("/")


# --- the jobs pollers read -------------------------------------------------------------------
class JobSet:
    """The job ids pollers read: the first ``hot`` are the hot set, the rest the spread set."""

    def __init__(self) -> None:
        self.hot: list[str] = []
        self.spread: list[str] = []

    def assign(self, ids: list[str], hot: int) -> None:
        hot = min(hot, len(ids))
        self.hot, self.spread = ids[:hot], ids[hot:] or ids[:hot]

    def __bool__(self) -> bool:
        return bool(self.hot or self.spread)

    def pick(self, hot_ratio: float) -> tuple[str, str]:
        """(job id, "hot" or "spread")."""
        if self.hot and (not self.spread or random.random() < hot_ratio):
            return random.choice(self.hot), "hot"
        return random.choice(self.spread), "spread"


JOBS = JobSet()


def given_ids(config: Config) -> list[str]:
    if config.job_ids:
        return [i.strip() for i in config.job_ids.split(",") if i.strip()]
    if config.jobs_file:
        with open(config.jobs_file, encoding="utf-8") as f:
            return [line.strip() for line in f if line.strip()]
    return []


def submit_batches(url: str, key: str, specs: list[dict[str, Any]]) -> list[str]:
    """Submit ``specs`` through ``POST /v1/jobs/batch``, ``BATCH`` at a time; their ids."""
    ids: list[str] = []
    for start in range(0, len(specs), BATCH):
        body = json.dumps({"jobs": specs[start : start + BATCH]}).encode()
        request = urllib.request.Request(
            f"{url}/v1/jobs/batch",
            data=body,
            method="POST",
            headers={"authorization": f"Bearer {key}", "content-type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                results = json.load(response)["results"]
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:300]
            raise RuntimeError(f"batch submit answered {exc.code}: {detail}") from None
        for result in results:
            if result["status"] not in (200, 202):
                raise RuntimeError(f"batch submit refused a job: {result}")
            ids.append(result["job"]["id"])
    return ids


@events.init.add_listener
def on_init(environment: Environment, **_: Any) -> None:
    check_target(target(environment), CONFIG.allow_remote)
    if not CONFIG.key:
        raise SystemExit("loadtest: set JOBTIER_KEY to a tenant's API key")


@events.test_start.add_listener
def on_test_start(environment: Environment, **_: Any) -> None:
    """Load the pollers' jobs on every process that runs users (not on a master)."""
    if isinstance(environment.runner, MasterRunner) or JOBS:
        return
    if not any(issubclass(cls, Poller) for cls in environment.user_classes):
        return
    url = target(environment)
    check_target(url, CONFIG.allow_remote)
    ids = given_ids(CONFIG)
    if not ids and CONFIG.hot_jobs + CONFIG.spread_jobs > 0:
        specs = [
            {"type": CONFIG.seed_type, "payload": CONFIG.seed_payload}
            for _ in range(CONFIG.hot_jobs + CONFIG.spread_jobs)
        ]
        started = time.perf_counter()
        try:
            ids = submit_batches(url, CONFIG.key, specs)
        except (OSError, RuntimeError, KeyError, ValueError) as exc:
            print(f"loadtest: could not submit the pollers' jobs to {url}: {exc}", flush=True)
            environment.process_exit_code = 2
            if environment.runner is not None:
                # not from inside the runner's start(), which is firing this event
                gevent.spawn_later(0, environment.runner.quit)
            return
        print(
            f"loadtest: submitted {len(ids)} jobs for the pollers "
            f"in {time.perf_counter() - started:.2f} s",
            flush=True,
        )
    JOBS.assign(ids, CONFIG.hot_jobs)


# --- tallies printed at the end (per process) -------------------------------------------------
@dataclass
class Tally:
    reads: int = 0
    not_modified: int = 0
    streams: int = 0
    events: int = 0


TALLY = Tally()


@events.test_stop.add_listener
def on_test_stop(environment: Environment, **_: Any) -> None:
    if isinstance(environment.runner, MasterRunner):
        return
    if TALLY.reads:
        share = TALLY.not_modified / TALLY.reads
        print(
            f"loadtest: status reads {TALLY.reads}, 304 Not Modified {TALLY.not_modified} "
            f"({share:.1%})",
            flush=True,
        )
    if TALLY.streams:
        print(
            f"loadtest: SSE streams completed {TALLY.streams}, events {TALLY.events} "
            f"({TALLY.events / TALLY.streams:.1f} per stream)",
            flush=True,
        )


# --- users ------------------------------------------------------------------------------------
def auth_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {CONFIG.key}"}


WEIGHTS = class_weights(CONFIG.weights)


class Poller(FastHttpUser):
    """Reads job statuses with ``If-None-Match``, like a client polling for progress."""

    host = CONFIG.url
    weight = WEIGHTS.get("poller", 80)
    wait_time = constant(CONFIG.wait)
    default_headers = auth_headers()

    def on_start(self) -> None:
        check_target(self.host or "", CONFIG.allow_remote)
        self.etags: dict[str, str] = {}

    @task
    def read_status(self) -> None:
        if not JOBS:
            raise StopUser()  # nothing to poll: the start-up submit failed (and said why)
        job_id, kind = JOBS.pick(CONFIG.hot_ratio)
        held = self.etags.get(job_id)
        headers = {"If-None-Match": held} if held else {}
        with self.client.get(
            f"/v1/jobs/{job_id}",
            headers=headers,
            name=f"GET /v1/jobs/[id] {kind}",
            catch_response=True,
        ) as r:
            TALLY.reads += 1
            if r.status_code == 304:
                TALLY.not_modified += 1
                r.success()
            elif r.status_code == 200 and r.content and r.headers.get("etag"):
                self.etags[job_id] = r.headers["etag"]
                r.success()
            else:
                r.failure(f"status {r.status_code}: {(r.text or '')[:200]}")


class Submitter(FastHttpUser):
    """Submits jobs one at a time, some with idempotency keys, some repeated."""

    host = CONFIG.url
    weight = WEIGHTS.get("submitter", 15)
    wait_time = constant(CONFIG.wait)
    default_headers = auth_headers()

    def on_start(self) -> None:
        check_target(self.host or "", CONFIG.allow_remote)
        # (key, payload, job id) of this user's keyed submits: the duplicates re-send these
        self.keyed: list[tuple[str, dict[str, Any], str]] = []
        self.serial = itertools.count()

    @task
    def submit(self) -> None:
        roll = random.random()
        if self.keyed and roll < CONFIG.duplicates:
            key, payload, original = random.choice(self.keyed)
            self._post(payload, key, expect=200, job_id=original, name="POST /v1/jobs duplicate")
            return
        payload = {"n": next(self.serial)}
        if roll < CONFIG.duplicates + CONFIG.idempotency:  # (the first duplicates need keys)
            key = uuid.uuid4().hex
            created = self._post(payload, key, expect=202, name="POST /v1/jobs idempotency-key")
            if created and len(self.keyed) < 1000:
                self.keyed.append((key, payload, created))
            return
        self._post(payload, None, expect=202, name="POST /v1/jobs")

    def _post(
        self,
        payload: dict[str, Any],
        key: str | None,
        *,
        expect: int,
        name: str,
        job_id: str | None = None,
    ) -> str | None:
        headers = {"Idempotency-Key": key} if key else {}
        body = {"type": CONFIG.submit_type, "payload": payload}
        with self.client.post(
            "/v1/jobs", json=body, headers=headers, name=name, catch_response=True
        ) as r:
            if r.status_code != expect:
                r.failure(f"status {r.status_code} (expected {expect}): {(r.text or '')[:200]}")
                return None
            try:
                got: str = r.json()["id"]
            except (ValueError, KeyError, TypeError):
                r.failure(f"not a job document: {(r.text or '')[:200]}")
                return None
            if job_id is not None and got != job_id:
                r.failure(f"a duplicate submit answered job {got}, not the original {job_id}")
                return None
            r.success()
            return got


@dataclass
class Event:
    id: str | None
    event: str
    data: str


def parse_sse(lines: Iterable[bytes]) -> Iterator[Event]:
    """Server-Sent Events from a stream's lines (comments and ``retry:`` skipped)."""
    fields: dict[str, str] = {}
    data: list[str] = []
    for raw in lines:
        line = raw.decode("utf-8").rstrip("\r")
        if not line:
            if data:
                yield Event(fields.get("id"), fields.get("event", "message"), "\n".join(data))
            fields, data = {}, []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            data.append(value)
        elif name in ("id", "event"):
            fields[name] = value
    if data:
        yield Event(fields.get("id"), fields.get("event", "message"), "\n".join(data))


class Watcher(HttpUser):
    """Submits a job and follows its SSE stream to the end.

    An ``HttpUser`` (requests), not a ``FastHttpUser``: a stream abandoned half-way (a timeout,
    a bad event) must close its connection, and requests' ``Response.close()`` does that,
    where geventhttpclient would return the half-read socket to its pool.
    """

    host = CONFIG.url
    weight = WEIGHTS.get("watcher", 5)
    wait_time = constant(CONFIG.wait)

    def on_start(self) -> None:
        check_target(self.host or "", CONFIG.allow_remote)
        self.client.headers.update(auth_headers())

    @task
    def watch(self) -> None:
        body = {"type": CONFIG.watch_type, "payload": CONFIG.watch_payload}
        with self.client.post(
            "/v1/jobs", json=body, name="POST /v1/jobs watched", catch_response=True
        ) as r:
            if r.status_code != 202:
                r.failure(f"status {r.status_code}: {r.text[:200]}")
                return
            job_id = r.json()["id"]
        self._follow(job_id)

    def _follow(self, job_id: str) -> None:
        started = time.perf_counter()
        deadline = started + CONFIG.watch_timeout
        count = size = 0
        first_ms: float | None = None
        error: Exception | None = None
        with self.client.get(
            f"/v1/jobs/{job_id}/events",
            name="GET /v1/jobs/[id]/events",
            headers={"Accept": "text/event-stream"},
            stream=True,
            catch_response=True,
            timeout=(10, CONFIG.watch_timeout),
        ) as r:
            if r.status_code != 200:
                r.failure(f"status {r.status_code}: {r.text[:200]}")
                return
            r.success()
            last_version, state = 0, ""
            try:
                for event in parse_sse(self._lines(r, deadline)):
                    if first_ms is None:
                        first_ms = (time.perf_counter() - started) * 1000
                    count += 1
                    size += len(event.data)
                    version = int(event.id or 0)
                    if state in TERMINAL:
                        raise AssertionError(f"an event after the terminal state {state}")
                    if version <= last_version:
                        raise AssertionError(f"version {version} after {last_version}")
                    last_version, state = version, json.loads(event.data)["state"]
                if state not in TERMINAL:
                    raise AssertionError(f"the stream ended in state {state or 'unknown'}")
            except (
                requests.RequestException,
                AssertionError,
                TimeoutError,
                ValueError,
                KeyError,
            ) as exc:
                error = exc
                r.close()  # abandon the connection: it may be half-read
        fire = self.environment.events.request.fire
        stream_ms = (time.perf_counter() - started) * 1000
        if first_ms is not None:
            fire(request_type="SSE", name="events: first", response_time=first_ms,
                 response_length=0, exception=None, context={})  # fmt: skip
        fire(request_type="SSE", name="events: stream", response_time=stream_ms,
             response_length=size, exception=error, context={})  # fmt: skip
        if error is None:
            fire(request_type="SSE", name="events: count", response_time=count,
                 response_length=0, exception=None, context={})  # fmt: skip
            TALLY.streams += 1
            TALLY.events += count

    @staticmethod
    def _lines(r: Any, deadline: float) -> Iterator[bytes]:
        for line in r.iter_lines(chunk_size=None):
            if time.perf_counter() > deadline:
                raise TimeoutError(f"no terminal state within {CONFIG.watch_timeout:g} s")
            yield line

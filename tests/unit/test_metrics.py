"""Metrics: histograms, the transition counter, and the Prometheus rendering."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from jobtier.core.model import JobError, JobStatus, Priority, State
from jobtier.metrics.histogram import Histogram, quantile
from jobtier.metrics.prometheus import render
from jobtier.metrics.snapshot import ROLES, HistogramWindow, Snapshot, labels, totals
from jobtier.metrics.transitions import TransitionCounter


def status(state: State, error: str | None = None, type_: str = "echo") -> JobStatus:
    return JobStatus(
        id="01M8KK4FZ54RBHFVYBN6HBV0CZ-1", type=type_, state=state, version=1,
        priority=Priority.NORMAL, attempt=1, max_attempts=3, created_at="", updated_at="",
        error=JobError(error, "m") if error else None,
    )  # fmt: skip


def entry(
    frm: str | None,
    to: State,
    error: str | None = None,
    type_: str = "echo",
    refunded: bool = False,
    actor: str = "w1",
) -> SimpleNamespace:
    return SimpleNamespace(
        from_state=frm, status=status(to, error, type_), refunded=refunded, actor=actor
    )


def test_histogram_and_quantiles() -> None:
    h = Histogram((0.01, 0.1, 1.0))
    for v in [0.005] * 90 + [0.05] * 9 + [5.0]:
        h.observe(v)
    snap = h.snapshot()
    assert snap["counts"] == [90, 9, 0, 1] and snap["count"] == 100
    assert quantile(snap, 0.5) == 0.01 and quantile(snap, 0.99) == 0.1
    assert quantile(snap, 1.0) == 1.0  # past the last bound: the largest finite bound
    assert quantile(Histogram().snapshot(), 0.99) is None


def test_transition_counter_counts_outcomes_by_type() -> None:
    c = TransitionCounter()
    c.observe([
        entry(None, State.QUEUED), entry("queued", State.RUNNING), entry("running", State.RUNNING),
        entry("running", State.SCHEDULED, "E"), entry("scheduled", State.QUEUED),
        entry("queued", State.RUNNING), entry("running", State.QUEUED, "LeaseExpired"),
        entry("queued", State.RUNNING), entry("running", State.FAILED, "E"),
        entry("failed", State.QUEUED), entry(None, State.SCHEDULED, type_="other"),
        entry("scheduled", State.CANCELLED, type_="other", actor="api"),
        # a claim found it past its expiry (claim.lua)
        entry("queued", State.CANCELLED, "Expired", type_="other", actor="expiry"),
        # given back, not failed (fail.lua's 'rf'): a RateLimited task, a job an open
        # breaker held
        entry("queued", State.RUNNING),
        entry("running", State.SCHEDULED, "RateLimited", refunded=True),
        entry("queued", State.RUNNING),
        entry("running", State.SCHEDULED, "BreakerOpen", refunded=True),
        # a task's own exception of that name failed its attempt
        entry("queued", State.RUNNING), entry("running", State.SCHEDULED, "RateLimited"),
    ])  # fmt: skip
    echo, other = labels(type="echo", queue="default"), labels(type="other", queue="default")
    got = {name: dict(series) for name, series in c.counts.items()}
    assert got["jobs_submitted_total"] == {echo: 1, other: 1}
    assert got["jobs_claimed_total"] == {echo: 6}
    assert got["jobs_retried_total"] == {echo: 2}
    assert got["jobs_held_total"] == {echo: 2}
    assert got["jobs_failed_total"] == {echo: 3}
    assert got["jobs_dead_lettered_total"] == {echo: 1}
    assert got["lease_expirations_total"] == {echo: 1}
    assert got["jobs_cancelled_total"] == {other: 2}
    assert got["jobs_expired_total"] == {other: 1}
    assert got["transitions_persisted_total"] == {"": 19}
    assert "jobs_succeeded_total" not in got


def test_render_labels_each_process_and_parses_as_prometheus() -> None:
    h = Histogram((0.1, 1.0))
    h.observe(0.05)
    snaps = [
        Snapshot("worker:a:1", "worker", 0.0, counters={"jobs_claimed_total": {labels(type="echo"): 5}},
                 histograms={"claim_wait_seconds": {"": h.snapshot()}}),
        Snapshot("worker:b:2", "worker", 0.0, counters={"jobs_claimed_total": {labels(type="echo"): 7}}),
    ]  # fmt: skip
    text = render(snaps, {"queue_depth": {labels(priority="high"): 3}}).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    claimed = families["jobtier_jobs_claimed"]
    assert claimed.type == "counter"
    assert sorted(
        (s.labels["process"], s.value) for s in claimed.samples if s.name.endswith("_total")
    ) == [("worker:a:1", 5.0), ("worker:b:2", 7.0)]
    depth = families["jobtier_queue_depth"].samples[0]
    assert depth.labels == {"priority": "high"} and depth.value == 3
    buckets = [
        s for s in families["jobtier_claim_wait_seconds"].samples if s.name.endswith("_bucket")
    ]
    assert [(s.labels["le"], s.value) for s in buckets] == [
        ("0.1", 1.0),
        ("1.0", 1.0),
        ("+Inf", 1.0),
    ]
    counters, hists = totals(snaps)
    assert counters["jobs_claimed_total"] == 12 and hists["claim_wait_seconds"]["count"] == 1


def test_live_processes_by_role_with_a_zero_for_a_role_with_none() -> None:
    snaps = [
        Snapshot("worker:a:1", "worker", 0.0),
        Snapshot("worker:b:2", "worker", 0.0),
        Snapshot("api:a:3", "api", 0.0),
    ]
    text = render(snaps, {}).decode()
    family = {f.name: f for f in text_string_to_metric_families(text)}["jobtier_processes"]
    got = {s.labels["role"]: s.value for s in family.samples}
    assert got["worker"] == 2 and got["api"] == 1
    # no persister published: its 0 is there for an alert to see
    assert got["persister"] == 0 and set(got) == set(ROLES)


def snap(process: str, hist: Histogram, at: float = 0.0) -> Snapshot:
    return Snapshot(process, "worker", at, histograms={"run": {"type=echo": hist.snapshot()}})


def test_histogram_window_gives_the_last_minute() -> None:
    h = Histogram([0.01, 0.1, 1.0])
    window = HistogramWindow(60.0)
    for _ in range(1000):
        h.observe(0.005)  # a long spell of fast jobs
    first, span = window.observe(0.0, [snap("w1", h)])
    assert span is None and quantile(first["run"], 0.99) == 0.01  # no window yet: the totals
    for _ in range(10):
        h.observe(0.5)  # then a slow one
    part, span = window.observe(30.0, [snap("w1", h)])
    assert span == 30.0 and part["run"]["count"] == 10 and quantile(part["run"], 0.99) == 1.0
    assert quantile(h.snapshot(), 0.99) == 0.01  # all-time, the slow spell does not show
    later, span = window.observe(95.0, [snap("w1", h)])  # nothing since: an empty window
    assert span == 65.0 and later["run"]["count"] == 0 and quantile(later["run"], 0.99) is None


def test_histogram_window_per_process_when_processes_come_and_go() -> None:
    old, other = Histogram([0.01, 0.1, 1.0]), Histogram([0.01, 0.1, 1.0])
    for _ in range(500):
        old.observe(0.05)
        other.observe(0.05)
    window = HistogramWindow(60.0)
    window.observe(0.0, [snap("w1", old), snap("w2", other)])
    for _ in range(3):
        other.observe(0.005)
    # w1 stopped publishing (it left the snapshots); a long-lived w3 appears with its history
    veteran = Histogram([0.01, 0.1, 1.0])
    for _ in range(10_000):
        veteran.observe(0.5)
    got, _ = window.observe(10.0, [snap("w2", other), snap("w3", veteran)])
    # w2's 3 new jobs count, and neither w1's leaving nor w3's past hides or swamps them
    assert got["run"]["count"] == 3 and got["run"]["counts"] == [3, 0, 0, 0]
    for _ in range(2):
        veteran.observe(0.05)
    got, _ = window.observe(20.0, [snap("w2", other), snap("w3", veteran)])
    assert got["run"]["counts"] == [3, 2, 0, 0]  # w3 counts from its first sample


def test_an_attempt_whose_retry_fell_after_the_expiry_counts_as_failed_or_held() -> None:
    """fail.lua ends the job (running -> cancelled, by 'expiry') rather than schedule a retry
    past its expiry: the attempt still counts as failed, or as given back when it was."""
    c = TransitionCounter()
    c.observe([
        entry("queued", State.RUNNING),
        entry("running", State.CANCELLED, "Expired", actor="expiry"),
        entry("queued", State.RUNNING),
        entry("running", State.CANCELLED, "Expired", refunded=True, actor="expiry"),
        # cancelled on request while running: no attempt counted (as before)
        entry("queued", State.RUNNING),
        entry("running", State.CANCELLED, "Cancelled", actor="w1"),
    ])  # fmt: skip
    echo = labels(type="echo", queue="default")
    got = {name: dict(series) for name, series in c.counts.items()}
    assert got["jobs_failed_total"] == {echo: 1} and got["jobs_held_total"] == {echo: 1}
    assert got["jobs_expired_total"] == {echo: 2} and got["jobs_cancelled_total"] == {echo: 3}
    assert "jobs_retried_total" not in got and "jobs_dead_lettered_total" not in got

"""The chaos soak's auditor: what the system holds after the storm, against what it promised.

Given every job id the API acknowledged, it reads Redis and Postgres and reports:

* lost jobs: acknowledged, and neither Redis nor Postgres knows them; vanished ones: only
  Postgres knows them (Redis lost them: it was killed within its AOF's fsync window);
* jobs not terminal after the settle time;
* jobs with more than one ``succeeded`` transition (a fenced write let through twice);
* history gaps: a job whose Postgres history is not complete (``history_problems``);
* Postgres's ``jobs`` row unequal to Redis's job hash (for jobs Redis still holds);
* duplicate executions: claims beyond the attempts the task's own failures explain, i.e.
  attempts run again because a worker was killed (allowed: delivery is at least once).

Not a library: a part of ``chaos.py`` kept apart so each file stays about one thing.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import asyncpg

from jobtier.core.keys import Keys
from jobtier.status.docs import read_docs
from jobtier.store import format as job_format
from jobtier.streams.group import lag

TERMINAL = {b"succeeded", b"failed", b"cancelled"}
CHUNK = 2000


@dataclass
class Audit:
    acknowledged: int = 0
    terminal_states: dict[str, int] = field(default_factory=dict)
    lost: list[str] = field(default_factory=list)  # in neither Redis nor Postgres
    vanished_from_redis: list[str] = field(default_factory=list)  # only Postgres has it
    not_terminal: list[str] = field(default_factory=list)
    double_success: list[str] = field(default_factory=list)
    history_problems: list[str] = field(default_factory=list)
    pg_differs: list[str] = field(default_factory=list)
    history_rows: int = 0
    claims: int = 0
    duplicate_executions: int = 0  # claims beyond the first attempt not explained by failures
    lease_expirations: int = 0
    task_retries: int = 0
    lag_after_drain: int = -1
    redis_reported_lag: int = -1  # XINFO GROUPS: pending + lag, summed (may be stale: 7.0)
    history_check: str = ""  # "prev_version links" or "contiguous versions"

    def violations(self) -> list[str]:
        """The invariants that do not hold (empty when the run is clean)."""
        out = []
        for name in (
            "lost", "vanished_from_redis", "not_terminal", "double_success",
            "history_problems", "pg_differs",
        ):  # fmt: skip
            found = getattr(self, name)
            if found:
                out.append(f"{name}: {len(found)} (e.g. {', '.join(found[:3])})")
        if self.lag_after_drain != 0:
            out.append(f"lag after drain is {self.lag_after_drain}, not 0")
        if self.acknowledged == 0:
            out.append("no job was acknowledged: the run proves nothing")
        return out

    def summary(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        for name in (
            "lost", "vanished_from_redis", "not_terminal", "double_success",
            "history_problems", "pg_differs",
        ):  # fmt: skip
            d[name] = {"count": len(d[name]), "examples": d[name][:10]}
        return d


def history_problems(
    versions: Sequence[tuple[int, int | None]], latest: int, has_prev: bool
) -> str | None:
    """What is wrong with one job's history, or None when it is complete.

    ``versions``: its (version, prev_version) rows; ``latest``: the version of its ``jobs``
    row. Where ``job_transitions`` has a ``prev_version`` column (coalesced progress reports
    may leave version gaps), following the links down from ``latest`` must visit every row
    and end at version 1; without it, the versions must be exactly 1..latest.
    """
    if not versions:
        return "no history"
    by_version = dict(versions)
    if len(by_version) != len(versions):
        return "a version twice"
    if max(by_version) != latest:
        return f"history ends at {max(by_version)}, the job is at {latest}"
    if not has_prev:
        if sorted(by_version) != list(range(1, latest + 1)):
            missing = sorted(set(range(1, latest + 1)) - set(by_version))
            return f"versions missing: {missing[:5]}"
        return None
    seen, at = 0, latest
    while True:
        if at not in by_version:
            return f"version {at} is linked to but missing"
        seen += 1
        prev = by_version[at]
        if at == 1:
            if prev not in (None, 0):
                return f"version 1 links to {prev}"
            break
        if prev is None or not 1 <= prev < at:
            return f"version {at} links to {prev}"
        at = prev
    if seen != len(by_version):
        return f"{len(by_version) - seen} versions outside the chain"
    return None


def _chunks(items: Sequence[str]) -> Iterable[Sequence[str]]:
    for i in range(0, len(items), CHUNK):
        yield items[i : i + CHUNK]


async def job_states(redis: Any, keys: Keys, job_ids: Sequence[str]) -> dict[str, bytes | None]:
    """Each job's state in Redis (None: Redis does not hold it)."""
    out: dict[str, bytes | None] = {}
    for chunk in _chunks(job_ids):
        pipe = redis.pipeline(transaction=False)
        for job_id in chunk:
            pipe.hmget(keys.job(job_id), job_format.small_fields("state"))
        for job_id, values in zip(chunk, await pipe.execute(), strict=True):
            out[job_id] = job_format.small_field(values, "state")
    return out


async def audit(redis: Any, pool: Any, keys: Keys, job_ids: Sequence[str]) -> Audit:
    """Check every acknowledged job against Redis and Postgres (run once all has settled)."""
    a = Audit(acknowledged=len(job_ids))
    has_prev = bool(
        await pool.fetchval(
            "SELECT 1 FROM information_schema.columns"
            " WHERE table_name = 'job_transitions' AND column_name = 'prev_version'"
        )
    )
    a.history_check = "prev_version links" if has_prev else "contiguous versions"
    prev_col = "prev_version" if has_prev else "NULL::integer AS prev_version"
    states: Counter[str] = Counter()
    for chunk in _chunks(job_ids):
        pipe = redis.pipeline(transaction=False)
        for job_id in chunk:
            pipe.hgetall(keys.job(job_id))
        hashes = dict(zip(chunk, await pipe.execute(), strict=True))
        rows = {
            r["id"]: r
            for r in await pool.fetch(
                "SELECT id, version, state, doc, tenant, payload FROM jobs WHERE id = any($1)",
                list(chunk),
            )
        }
        history: dict[str, list[asyncpg.Record]] = defaultdict(list)
        for r in await pool.fetch(
            f"SELECT job_id, version, {prev_col}, from_state, to_state, error->>'type' AS error"
            " FROM job_transitions WHERE job_id = any($1) ORDER BY job_id, version",
            list(chunk),
        ):
            history[r["job_id"]].append(r)
        # the document a reader gets: rendered from the job's fields
        docs = dict(zip(chunk, [d for _, d in await read_docs(redis, keys, chunk)], strict=True))
        for job_id in chunk:
            h, row, transitions = hashes[job_id], rows.get(job_id), history.get(job_id, [])
            a.history_rows += len(transitions)
            if not h:
                (a.vanished_from_redis if row else a.lost).append(job_id)
                continue
            fields = job_format.job_fields(h)  # the packed small fields unpacked
            state, version = fields["state"].encode(), int(fields["version"])
            states[state.decode()] += 1
            if state not in TERMINAL:
                a.not_terminal.append(job_id)
            if row is None:
                a.pg_differs.append(f"{job_id} (no jobs row)")
                continue
            if (row["version"], row["state"].encode(), row["doc"], row["payload"]) != (
                version,
                state,
                docs[job_id],
                h[b"payload"],
            ):
                a.pg_differs.append(f"{job_id} (Postgres v{row['version']}, Redis v{version})")
            problem = history_problems(
                [(t["version"], t["prev_version"]) for t in transitions], row["version"], has_prev
            )
            if problem:
                a.history_problems.append(f"{job_id}: {problem}")
            if sum(t["to_state"] == "succeeded" for t in transitions) > 1:
                a.double_success.append(job_id)
            claims = sum(
                t["to_state"] == "running" and t["from_state"] != "running" for t in transitions
            )
            expired = sum(  # the requeue (or dead letter) carries the error, no later row
                t["from_state"] == "running" and t["to_state"] in ("queued", "failed")
                and t["error"] == "LeaseExpired"
                for t in transitions
            )  # fmt: skip
            retried = sum(
                t["from_state"] == "running" and t["to_state"] in ("queued", "scheduled")
                and t["error"] not in (None, "LeaseExpired")
                for t in transitions
            )  # fmt: skip
            a.claims += claims
            a.lease_expirations += expired
            a.task_retries += retried
            a.duplicate_executions += max(0, claims - 1 - retried)
    a.terminal_states = dict(states)
    a.lag_after_drain = (await lag(redis, keys))[0]
    total = 0
    for shard in range(keys.shards):
        for g in await redis.xinfo_groups(keys.log(shard)):
            total += int(g["pending"]) + int(g["lag"] or 0)
    a.redis_reported_lag = total
    return a

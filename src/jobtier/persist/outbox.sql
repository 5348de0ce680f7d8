-- The outbox relay's statements (persist/outbox.py; the tables: migrations/0010_outbox.sql).

-- name: outbox_record_config
-- The shard count and the API's limits (JOBTIER_MAX_PAYLOAD_BYTES, JOBTIER_MAX_FLOW_JOBS,
-- JOBTIER_MAX_FUTURE_SECONDS, the most attempts a job may have), which jobtier.submit and
-- the outbox's check (migrations/0022) apply and cannot read from the settings.
INSERT INTO jobtier.outbox_config AS c (one, shards, max_payload_bytes, max_depends_on,
                                        max_future_seconds, max_attempts)
VALUES (true, $1, $2, $3, $4, $5)
ON CONFLICT (one) DO UPDATE
SET shards = excluded.shards, max_payload_bytes = excluded.max_payload_bytes,
    max_depends_on = excluded.max_depends_on, max_future_seconds = excluded.max_future_seconds,
    max_attempts = excluded.max_attempts
WHERE (c.shards, c.max_payload_bytes, c.max_depends_on, c.max_future_seconds, c.max_attempts)
    IS DISTINCT FROM (excluded.shards, excluded.max_payload_bytes, excluded.max_depends_on,
                      excluded.max_future_seconds, excluded.max_attempts)

-- name: outbox_take
-- Committed rows not yet relayed, oldest first; rows another relay holds are skipped, so
-- relays in several persisters share the work without waiting on each other.
-- run_at as seconds since the epoch (a double): any timestamptz Postgres took reads, the
-- infinities and years before 1 included, which a datetime could not hold (a row the batch
-- could not read would hold back every row after it); the relay refuses those alone.
-- A row left for later (0023's not_before: waiting for a worker of its type, or for a row
-- it depends on) is left until then; waited: the seconds since it was written.
SELECT id, tenant, type, payload, queue, priority,
       extract(epoch FROM run_at)::double precision AS run_at, idempotency_key, max_attempts,
       depends_on, extract(epoch FROM clock_timestamp() - created_at)::double precision AS waited
FROM jobtier.outbox
WHERE relayed_at IS NULL AND (not_before IS NULL OR not_before <= clock_timestamp())
ORDER BY seq
LIMIT $1
FOR UPDATE SKIP LOCKED

-- name: outbox_relayed
UPDATE jobtier.outbox SET relayed_at = clock_timestamp() WHERE id = ANY($1::text[])

-- name: outbox_refused
UPDATE jobtier.outbox AS o SET relayed_at = clock_timestamp(), error = r.error
FROM unnest($1::text[], $2::text[]) AS r(id, error)
WHERE o.id = r.id

-- name: outbox_cancel
-- The tenant's row not relayed yet ($2; any tenant's with NULL: the console), cancelled: the
-- relay never takes it. A row a relay holds (taken, its Redis submit under way) is waited for,
-- and then matches no more: the job is in Redis, where the cancel goes. Its id: cancelled.
UPDATE jobtier.outbox
SET relayed_at = clock_timestamp(), cancelled_at = clock_timestamp()
WHERE id = $1 AND ($2::text IS NULL OR tenant = $2) AND relayed_at IS NULL
RETURNING id

-- name: outbox_wait
-- Rows of types no worker has advertised yet: left out until $2 seconds after their submit
-- (then refused if their type is still unknown), or until outbox_release.
UPDATE jobtier.outbox SET not_before = created_at + make_interval(secs => $2)
WHERE id = ANY($1::text[])

-- name: outbox_later
-- Rows waiting for a row not relayed yet: each left out for its seconds of $2.
UPDATE jobtier.outbox AS o SET not_before = clock_timestamp() + make_interval(secs => l.s)
FROM unnest($1::text[], $2::float8[]) AS l(id, s)
WHERE o.id = l.id

-- name: outbox_release
-- The rows left out of types a worker has advertised since: read again.
UPDATE jobtier.outbox SET not_before = NULL
WHERE relayed_at IS NULL AND not_before IS NOT NULL AND type = ANY($1::text[])

-- name: outbox_waiting_types
-- The types of rows left out waiting for a worker of their type (outbox_wait: until $1
-- seconds after their submit; not those left out for a row they depend on, outbox_later).
SELECT coalesce(array_agg(DISTINCT type), '{}') FROM jobtier.outbox
WHERE relayed_at IS NULL AND not_before = created_at + make_interval(secs => $1)

-- name: outbox_unrelayed
-- Whether one of these ids is the tenant's row not relayed yet (locked by another relay, or
-- left pending by this one): a job waiting for it is left pending rather than refused.
SELECT EXISTS (
    SELECT 1 FROM jobtier.outbox
    WHERE id = ANY($1::text[]) AND tenant = $2 AND relayed_at IS NULL
)

-- name: outbox_ended
-- The first of these ids that is the tenant's row refused by the relay or cancelled before it:
-- what a job depending on it is refused for. NULL: none.
SELECT CASE WHEN cancelled_at IS NOT NULL THEN id || ', which was cancelled before its relay'
            ELSE id || ', which the relay refused' END
FROM jobtier.outbox
WHERE id = ANY($1::text[]) AND tenant = $2 AND (error IS NOT NULL OR cancelled_at IS NOT NULL)
ORDER BY seq
LIMIT 1

-- name: outbox_depends_on
-- What the tenant's row not relayed yet waits for (NULL: no such row; '{}': none).
SELECT coalesce(depends_on, '{}') FROM jobtier.outbox
WHERE id = $1 AND tenant = $2 AND relayed_at IS NULL

-- name: outbox_pending
SELECT count(*) FROM jobtier.outbox WHERE relayed_at IS NULL

-- name: outbox_backlog
-- Rows committed and not yet relayed (counted up to $1: a scrape costs the same however long
-- the backlog), and the age in seconds of the oldest the relay should take now (NULL: none;
-- a row left out until later, waiting for a worker of its type, is not late), by the
-- pending index.
SELECT (SELECT count(*) FROM (SELECT 1 FROM jobtier.outbox WHERE relayed_at IS NULL LIMIT $1) p)
           AS rows,
       (SELECT extract(epoch FROM clock_timestamp() - created_at)::double precision
        FROM jobtier.outbox
        WHERE relayed_at IS NULL AND (not_before IS NULL OR not_before <= clock_timestamp())
        ORDER BY seq LIMIT 1) AS age

-- name: outbox_prune
-- Relayed rows once their idempotency keys are forgotten ($1), refused and cancelled ones (the
-- only record of those jobs) with the finished jobs ($2; NULL: kept).
DELETE FROM jobtier.outbox
WHERE id IN (
    SELECT id FROM jobtier.outbox
    WHERE relayed_at < $1 AND error IS NULL AND cancelled_at IS NULL
       OR relayed_at < $2 AND (error IS NOT NULL OR cancelled_at IS NOT NULL)
    LIMIT $3
)

-- name: outbox_status_docs
-- Jobs of the outbox that Postgres has no row of: not relayed yet, refused by the relay,
-- cancelled before their relay, or (with $2) relayed within the last 10 minutes (a read that
-- missed them in Redis just before the relay, and the persister has not written their row
-- yet: they read as submitted, as they were, rather than not found; past that, a job neither
-- Redis nor Postgres holds is not found).
-- run_at only as a datetime holds it (an infinity or a date BC reads as none: due now, or
-- refused by the relay), so that one such row cannot fail the read of every id with it.
SELECT id, tenant, type, queue, priority,
       CASE WHEN run_at BETWEEN '0001-01-02 00:00:00+00' AND '9999-12-30 00:00:00+00'
            THEN run_at END AS run_at,
       max_attempts, created_at, relayed_at, error, cancelled_at
FROM jobtier.outbox
WHERE id = ANY($1::text[])
  AND (relayed_at IS NULL OR error IS NOT NULL OR cancelled_at IS NOT NULL
       OR $2 AND relayed_at > now() - interval '10 minutes')

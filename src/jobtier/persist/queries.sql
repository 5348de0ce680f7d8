-- Named queries: each block starts with `-- name: <name>` and runs to the next one.
-- db.query(name) returns the text; db.queries() loads this file once per process.

-- name: create_staging
-- The write path COPYs each batch into these (batch.write_batch), then moves it with one
-- statement per table. Session-local; emptied at every commit.
CREATE TEMP TABLE IF NOT EXISTS jobs_staging (LIKE jobs) ON COMMIT DELETE ROWS;
CREATE TEMP TABLE IF NOT EXISTS transitions_staging (LIKE job_transitions) ON COMMIT DELETE ROWS;

-- name: insert_transitions
-- Replays (a batch committed but not acknowledged before a crash, or an entry claimed by two
-- persisters) hit the key and are ignored. Ordered so that concurrent persisters take key
-- locks in one order (no deadlocks).
INSERT INTO job_transitions
    (job_id, version, from_state, to_state, at, worker, attempt, error, progress, cancel_requested)
SELECT job_id, version, from_state, to_state, at, worker, attempt, error, progress, cancel_requested
FROM transitions_staging
ORDER BY job_id, version
ON CONFLICT (job_id, version) DO NOTHING

-- name: upsert_jobs
-- One row per job (the batch was collapsed to each job's highest version). The row only moves
-- forward in version: a replay, or an older batch committed after a newer one by another
-- persister, changes nothing. payload and idempotency_key are known only to the submit entry
-- and result only to the success entry; they are kept whichever version wrote them first.
-- Rows are locked in id order, the same in every persister: concurrent batches cannot deadlock.
INSERT INTO jobs AS j
    (id, tenant, type, priority, state, version, attempt, max_attempts, created_at, updated_at,
     run_at, payload, idempotency_key, result, result_size, error, progress, cancel_requested,
     worker, doc)
SELECT id, tenant, type, priority, state, version, attempt, max_attempts, created_at, updated_at,
       run_at, payload, idempotency_key, result, result_size, error, progress, cancel_requested,
       worker, doc
FROM jobs_staging
ORDER BY id
ON CONFLICT (id) DO UPDATE SET
    state = excluded.state,
    version = excluded.version,
    attempt = excluded.attempt,
    max_attempts = excluded.max_attempts,
    updated_at = excluded.updated_at,
    run_at = excluded.run_at,
    payload = coalesce(j.payload, excluded.payload),
    idempotency_key = coalesce(j.idempotency_key, excluded.idempotency_key),
    result = coalesce(excluded.result, j.result),
    result_size = coalesce(excluded.result_size, j.result_size),
    error = excluded.error,
    progress = excluded.progress,
    cancel_requested = excluded.cancel_requested,
    worker = excluded.worker,
    doc = excluded.doc
WHERE j.version < excluded.version

-- name: fill_submitted
-- The submit entry of a job whose later version another persister committed first: upsert_jobs
-- left the row alone (its version is newer), so fill in what only the submit knows. Those rows
-- are already locked by upsert_jobs in this transaction: no new lock, no new lock order.
UPDATE jobs AS j
SET payload = s.payload, idempotency_key = s.idempotency_key
FROM jobs_staging AS s
WHERE j.id = s.id AND j.payload IS NULL AND s.payload IS NOT NULL

-- name: insert_results
INSERT INTO job_results (job_id, result, size)
SELECT * FROM unnest($1::text[], $2::json[], $3::int[])
ON CONFLICT (job_id) DO NOTHING

-- name: status_doc
SELECT tenant, doc FROM jobs WHERE id = $1

-- name: status_docs
SELECT id, tenant, doc FROM jobs WHERE id = ANY($1::text[])

-- name: list_jobs
-- pg_reader.py puts the optional filters in place of /*filters*/ (fixed fragments such as
-- `AND state = $3`, never caller input) and the direction in place of /*dir*/. Each
-- combination is a statement of its own, so each gets a plan with the index that serves it:
-- (tenant, created_at, id), (tenant, state, created_at, id) or (tenant, type, created_at, id).
SELECT doc, created_at, id
FROM jobs
WHERE tenant = $1 /*filters*/
ORDER BY created_at /*dir*/, id /*dir*/
LIMIT $2

-- name: history
-- Empty for an unknown job and for another tenant's job alike: the caller cannot tell them apart.
SELECT t.version, t.from_state, t.to_state, t.at, t.worker, t.attempt, t.error, t.progress,
       t.cancel_requested
FROM jobs j
JOIN job_transitions t ON t.job_id = j.id
WHERE j.id = $1 AND j.tenant = $2
ORDER BY t.version

-- name: result
SELECT j.state, j.version, coalesce(j.result, r.result) AS result
FROM jobs j
LEFT JOIN job_results r ON r.job_id = j.id
WHERE j.id = $1 AND j.tenant = $2

-- name: migration_lock
-- Held until the migrating transaction ends: a second migrator waits, then finds nothing to do.
SELECT pg_advisory_xact_lock($1)

-- name: create_migrations_table
CREATE TABLE IF NOT EXISTS schema_migrations (
    name       text        PRIMARY KEY,
    applied_at timestamptz NOT NULL DEFAULT now()
)

-- name: applied_migrations
SELECT name FROM schema_migrations ORDER BY name

-- name: record_migration
INSERT INTO schema_migrations (name) VALUES ($1)

-- name: insert_schedule
INSERT INTO schedules (id, tenant, name, type, payload, priority, max_attempts, cron, timezone,
                       interval_seconds, misfire_policy, paused, next_fire_at, created_at,
                       updated_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $14)
RETURNING *

-- name: get_schedule
SELECT * FROM schedules WHERE id = $1 AND tenant = $2

-- name: list_schedules
SELECT * FROM schedules WHERE tenant = $1 AND name > $2 ORDER BY name LIMIT $3

-- name: set_schedule_paused
UPDATE schedules SET paused = $3, next_fire_at = $4, updated_at = now()
WHERE id = $1 AND tenant = $2
RETURNING *

-- name: delete_schedule
DELETE FROM schedules WHERE id = $1 AND tenant = $2 RETURNING id

-- name: all_schedules
SELECT * FROM schedules ORDER BY id

-- name: sync_schedule_times
-- The scheduler copies the firing state it keeps in Redis back here, now and then.
UPDATE schedules AS s
SET next_fire_at = t.next_fire_at, last_fired_at = t.last_fired_at
FROM unnest($1::text[], $2::timestamptz[], $3::timestamptz[]) AS t(id, next_fire_at, last_fired_at)
WHERE s.id = t.id
  AND (s.next_fire_at IS DISTINCT FROM t.next_fire_at
       OR s.last_fired_at IS DISTINCT FROM t.last_fired_at)

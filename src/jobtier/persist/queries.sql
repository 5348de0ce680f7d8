-- Named queries: each block starts with `-- name: <name>` and runs to the next one.
-- db.query(name) returns the text; db.queries() loads this file once per process.

-- name: create_staging
-- The write path COPYs each batch into these (batch.write_batch), then moves it with one
-- statement per table. Session-local; emptied at every commit.
CREATE TEMP TABLE IF NOT EXISTS jobs_staging (LIKE jobs) ON COMMIT DELETE ROWS;
CREATE TEMP TABLE IF NOT EXISTS transitions_staging (LIKE job_transitions) ON COMMIT DELETE ROWS;

-- name: insert_transitions
-- Replays (a batch committed but not acknowledged before a crash, or an entry claimed by two
-- persisters) hit the key and are ignored: a replayed entry carries the same document, so the
-- same `at`, and lands in the same partition, whose part of the key catches it. Ordered so
-- that concurrent persisters take key locks in one order (no deadlocks).
INSERT INTO job_transitions
    (job_id, version, prev_version, from_state, to_state, at, worker, attempt, error, progress,
     cancel_requested)
SELECT job_id, version, prev_version, from_state, to_state, at, worker, attempt, error, progress,
       cancel_requested
FROM transitions_staging
ORDER BY job_id, version
ON CONFLICT (job_id, version, at) DO NOTHING

-- name: upsert_jobs
-- One row per job (the batch was collapsed to each job's highest version). The row only moves
-- forward in version: a replay, or an older batch committed after a newer one by another
-- persister, changes nothing. payload and idempotency_key are known only to the submit entry
-- and result only to the success entry; they are kept whichever version wrote them first.
-- Rows are locked in id order, the same in every persister: concurrent batches cannot deadlock.
INSERT INTO jobs AS j
    (id, tenant, type, priority, state, version, attempt, max_attempts, created_at, updated_at,
     run_at, payload, idempotency_key, result, result_size, error, progress, cancel_requested,
     worker, doc, queue, result_ref)
SELECT id, tenant, type, priority, state, version, attempt, max_attempts, created_at, updated_at,
       run_at, payload, idempotency_key, result, result_size, error, progress, cancel_requested,
       worker, doc, queue, result_ref
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
    result_ref = coalesce(excluded.result_ref, j.result_ref),
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
-- No transition precedes its job's creation (both times come from one Redis clock): the
-- bound on `at` lets the executor skip the daily partitions older than the job.
SELECT t.version, t.prev_version, t.from_state, t.to_state, t.at, t.worker, t.attempt, t.error,
       t.progress, t.cancel_requested
FROM jobs j
JOIN job_transitions t ON t.job_id = j.id AND t.at >= j.created_at
WHERE j.id = $1 AND j.tenant = $2
ORDER BY t.version

-- name: history_gaps
-- Proof that the history of the jobs $1 (ids) is complete: follows each job's prev_version
-- links (NULL: version - 1) from its latest version in `jobs` down to version 1, and returns
-- every link that leads to a missing row: (job_id, missing_version, named_by: the version
-- whose row names it, NULL for the latest). A job `jobs` does not know comes back with
-- missing_version NULL. No row back = every logged transition of those jobs is in Postgres.
-- History older than JOBTIER_PG_HISTORY_RETENTION_DAYS is dropped by design: audit younger
-- jobs. Links are only ever followed downwards, so a corrupt row cannot make it loop.
WITH RECURSIVE chain (job_id, version, named_by) AS (
    SELECT ids.id, j.version, NULL::integer
    FROM unnest($1::text[]) AS ids (id)
    LEFT JOIN jobs j ON j.id = ids.id
  UNION ALL
    SELECT t.job_id, coalesce(t.prev_version, t.version - 1), t.version
    FROM chain c
    JOIN job_transitions t ON t.job_id = c.job_id AND t.version = c.version
    WHERE coalesce(t.prev_version, t.version - 1) BETWEEN 1 AND t.version - 1
)
SELECT DISTINCT c.job_id, c.version AS missing_version, c.named_by
FROM chain c
WHERE NOT EXISTS (
    SELECT 1 FROM job_transitions t WHERE t.job_id = c.job_id AND t.version = c.version
)
ORDER BY c.job_id, c.version

-- name: result
SELECT j.state, j.version, coalesce(j.result, r.result) AS result, j.result_ref
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
                       updated_at, queue)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $14, $15)
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

-- --- retention (persist/retention.py) --------------------------------------------------------
-- name: prune_lock
-- Session-level, on the pass's own connection: held across the pass's many short transactions.
SELECT pg_try_advisory_lock($1)

-- name: prune_unlock
SELECT pg_advisory_unlock($1)

-- name: history_partitions
-- The partitions of job_transitions and their bounds ([lower, upper); NULL for MINVALUE,
-- MAXVALUE and the default partition), read back from the bound's text: Postgres renders the
-- bounds as timestamptz literals with their offset.
SELECT c.relname AS name,
       c.relpartbound IS NOT NULL AND pg_get_expr(c.relpartbound, c.oid) = 'DEFAULT' AS is_default,
       (regexp_match(pg_get_expr(c.relpartbound, c.oid), 'FROM \(''([^'']+)''\)'))[1]::timestamptz
           AS lower,
       (regexp_match(pg_get_expr(c.relpartbound, c.oid), 'TO \(''([^'']+)''\)'))[1]::timestamptz
           AS upper
FROM pg_inherits i
JOIN pg_class c ON c.oid = i.inhrelid
WHERE i.inhparent = 'job_transitions'::regclass
ORDER BY upper NULLS FIRST, c.relname

-- name: create_history_partition
-- retention.py fills in {partition} (a quoted name) and {lower}, {upper} (timestamptz
-- literals). Made apart and then attached: ATTACH takes SHARE UPDATE EXCLUSIVE on the parent,
-- so the persister's inserts go on. The default partition is locked first, then emptied of the
-- day's rows (ATTACH would refuse them; locked, none can arrive in between).
LOCK TABLE job_transitions_default IN ACCESS EXCLUSIVE MODE;
CREATE TABLE {partition} (LIKE job_transitions INCLUDING ALL);
WITH moved AS (
    DELETE FROM job_transitions_default WHERE at >= {lower} AND at < {upper}
    RETURNING job_id, version, prev_version, from_state, to_state, at, worker, attempt, error,
              progress, cancel_requested
)
INSERT INTO {partition}
    (job_id, version, prev_version, from_state, to_state, at, worker, attempt, error, progress,
     cancel_requested)
SELECT * FROM moved;
ALTER TABLE job_transitions ATTACH PARTITION {partition} FOR VALUES FROM ({lower}) TO ({upper})

-- name: drop_history_partition
DROP TABLE {partition}

-- name: detach_history_partition
-- The table stays, outside job_transitions, for an operator to archive (pg_dump -t) and drop.
ALTER TABLE job_transitions DETACH PARTITION {partition}

-- name: count_partition_rows
SELECT count(*) FROM {partition}

-- name: count_old_default_history
SELECT count(*) FROM job_transitions_default WHERE at < $1

-- name: delete_old_default_history
-- One bounded batch ($2 rows); the default partition is small (rows no daily one covered).
DELETE FROM job_transitions_default
WHERE ctid = ANY (ARRAY(SELECT ctid FROM job_transitions_default WHERE at < $1 LIMIT $2))

-- name: count_finished_jobs
SELECT count(*) FROM jobs
WHERE state IN ('succeeded', 'failed', 'cancelled') AND updated_at < $1

-- name: delete_finished_jobs
-- One bounded batch ($2 rows, through jobs_finished_idx) of jobs finished before $1. Rows a
-- persister is writing are skipped, not waited for (the next batch or pass takes them); the
-- state is checked on the locked row, so a job moving on meanwhile (a replayed dead letter)
-- is not deleted. job_results rows go with their job (ON DELETE CASCADE).
DELETE FROM jobs
WHERE id IN (
    SELECT id FROM jobs
    WHERE state IN ('succeeded', 'failed', 'cancelled') AND updated_at < $1
    ORDER BY updated_at
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)

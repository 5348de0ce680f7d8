-- Named queries: each block starts with `-- name: <name>` and runs to the next one.
-- db.query(name) returns the text; db.queries() loads this file once per process.

-- name: create_staging
-- The write path COPYs each batch into these (batch.write_batch), then moves it with one
-- statement per table. Session-local; emptied at every commit.
CREATE TEMP TABLE IF NOT EXISTS jobs_staging (LIKE jobs) ON COMMIT DELETE ROWS;
CREATE TEMP TABLE IF NOT EXISTS transitions_staging (LIKE job_transitions) ON COMMIT DELETE ROWS;

-- name: clear_jobs_staging
-- (batch.write_batch: new jobs' rows merged after all, the others' already were)
DELETE FROM jobs_staging

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
ORDER BY job_id COLLATE "C", version
ON CONFLICT (job_id, version, at) DO NOTHING

-- name: upsert_jobs
-- One row per job (the batch was collapsed to each job's highest version). The row only moves
-- forward in version: a replay, or an older batch committed after a newer one by another
-- persister, changes nothing. payload and idempotency_key are known only to the submit entry
-- and result only to the success entry; they are kept whichever version wrote them first,
-- but a newer payload wins (a debounced submit's entry carries the payload, priority and
-- attempts that replaced the first: docs/debounce-throttle.md).
-- Rows are locked in id order, the same in every persister and in batch.write_batch's COPY of
-- new jobs (byte order: COLLATE "C"): concurrent batches cannot deadlock.
INSERT INTO jobs AS j
    (id, tenant, type, priority, state, version, attempt, max_attempts, created_at, updated_at,
     run_at, payload, idempotency_key, result, result_size, error, progress, cancel_requested,
     worker, doc, queue, result_ref)
SELECT id, tenant, type, priority, state, version, attempt, max_attempts, created_at, updated_at,
       run_at, payload, idempotency_key, result, result_size, error, progress, cancel_requested,
       worker, doc, queue, result_ref
FROM jobs_staging
ORDER BY id COLLATE "C"
ON CONFLICT (id) DO UPDATE SET
    state = excluded.state,
    version = excluded.version,
    attempt = excluded.attempt,
    max_attempts = excluded.max_attempts,
    priority = excluded.priority,
    updated_at = excluded.updated_at,
    run_at = excluded.run_at,
    payload = coalesce(excluded.payload, j.payload),
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
-- write_batch runs it only when upsert_jobs left some row alone (its count is short).
UPDATE jobs AS j
SET payload = s.payload, idempotency_key = s.idempotency_key
FROM jobs_staging AS s
WHERE j.id = s.id AND j.payload IS NULL AND s.payload IS NOT NULL

-- name: insert_results
INSERT INTO job_results (job_id, result, size)
SELECT * FROM unnest($1::text[], $2::json[], $3::int[])
ON CONFLICT (job_id) DO NOTHING

-- name: insert_dependencies
-- From submit entries (their 'dp' and 'dk' fields); a replayed entry changes nothing.
INSERT INTO job_dependencies (job_id, depends_on, position, child)
SELECT * FROM unnest($1::text[], $2::text[], $3::int[], $4::bool[])
ORDER BY 1, 2
ON CONFLICT (job_id, depends_on) DO NOTHING

-- name: dependencies
-- A job's dependencies as Postgres knows them (the tenant's only), with their latest state.
-- (a result over 64 KiB is in job_results; one kept in the result store has only its ref)
SELECT d.depends_on, d.child, dj.state, coalesce(dj.result, r.result) AS result, dj.result_ref,
       dj.error
FROM jobs j
JOIN job_dependencies d ON d.job_id = j.id
LEFT JOIN jobs dj ON dj.id = d.depends_on
LEFT JOIN job_results r ON r.job_id = d.depends_on
WHERE j.id = $1 AND j.tenant = $2
ORDER BY d.position

-- name: status_doc
SELECT tenant, doc FROM jobs WHERE id = $1

-- name: status_docs
SELECT id, tenant, doc FROM jobs WHERE id = ANY($1::text[])

-- name: list_jobs
-- pg_reader.py puts the optional filters in place of /*filters*/ (fixed fragments such as
-- `AND type = $3`, never caller input) and the direction in place of /*dir*/. Each
-- combination is a statement of its own, so each gets a plan with the index that serves it:
-- (tenant, created_at, id), (tenant, type, created_at, id) or (tenant, queue, created_at, id).
-- The filters always include the tenant. By state: list_jobs_by_state, but for `succeeded`,
-- filtered here (nearly every job ends so: they are the many in created_at order).
SELECT doc, created_at, id
FROM jobs
WHERE true /*filters*/
ORDER BY created_at /*dir*/, id /*dir*/
LIMIT $1

-- name: admin_list_jobs
-- The console's listing across tenants (pg_reader.admin_list_jobs puts fixed fragments in
-- place of /*filters*/ and the direction in place of /*dir*/, as for list_jobs). Served by
-- jobs_created_idx, jobs_type_/queue_created_idx, the jobs_tenant_* indexes with a tenant,
-- or jobs_id_prefix_idx for an id prefix (bench/console.py shows the plans). By a state
-- other than `succeeded`: list_jobs_by_state.
SELECT tenant, doc, created_at, id
FROM jobs
WHERE true /*filters*/
ORDER BY created_at /*dir*/, id /*dir*/
LIMIT $1

-- name: list_jobs_by_state
-- list_jobs and admin_list_jobs by a state other than `succeeded` (their filters: jobs_by_state
-- has each column they name): the page is found in jobs_by_state, by jobs_by_state_tenant_idx
-- (tenant, state, created_at, id) with a tenant, else jobs_by_state_state_idx, or for a
-- failed, cancelled, waiting or scheduled state with a type or a queue by 0020's
-- jobs_by_state_type_idx or jobs_by_state_queue_idx (the planner picks by the statistics),
-- then each job's document in `jobs` by its key. The state is a literal (pg_reader._filters).
-- Queued or running jobs of a type (or queue) with fewer jobs than the state has are read by
-- list_jobs or admin_list_jobs instead, the state checked on each (persist/listing_stats.py).
SELECT p.tenant, j.doc, p.created_at, p.id
FROM (
    SELECT id, tenant, created_at
    FROM jobs_by_state
    WHERE true /*filters*/
    ORDER BY created_at /*dir*/, id /*dir*/
    LIMIT $1
) AS p
JOIN jobs AS j ON j.id = p.id
ORDER BY p.created_at /*dir*/, p.id /*dir*/

-- name: listing_stats
-- The statistics a listing of queued or running jobs with a type or a queue chooses its way by
-- (persist/listing_stats.py): for jobs.type, jobs.queue and jobs_by_state.state, the table's
-- estimated rows, the most common values with their share of the rows, the number of distinct
-- values (negative: a share of the rows) and the share of NULLs. The tables are found as the
-- listings' unqualified names resolve (to_regclass), whatever schema holds them. No row for a
-- column not yet analysed.
SELECT c.relname AS tablename, s.attname, greatest(c.reltuples, 0) AS rows,
       s.most_common_vals::text::text[] AS vals, s.most_common_freqs AS freqs,
       s.n_distinct, s.null_frac
FROM pg_class AS c
JOIN pg_namespace AS n ON n.oid = c.relnamespace
JOIN pg_stats AS s ON s.schemaname = n.nspname AND s.tablename = c.relname
WHERE c.oid IN (to_regclass('jobs'), to_regclass('jobs_by_state'))
  AND NOT s.inherited
  AND (c.relname, s.attname) IN (('jobs', 'type'), ('jobs', 'queue'), ('jobs_by_state', 'state'))

-- name: admin_job
-- One job for the console, whatever its tenant: its document, and its payload and result
-- when at most $2 bytes (else only their sizes; the console links to the whole value).
SELECT j.tenant, j.doc,
       octet_length(j.payload::text) AS payload_size,
       CASE WHEN octet_length(j.payload::text) <= $2 THEN j.payload END AS payload,
       coalesce(j.result_size, r.size) AS result_size,
       CASE WHEN coalesce(j.result_size, r.size) <= $2 THEN coalesce(j.result, r.result) END
           AS result,
       j.result_ref
FROM jobs j
LEFT JOIN job_results r ON r.job_id = j.id
WHERE j.id = $1

-- name: admin_job_value
-- The whole payload or result of one job (the console's download link); a result kept in
-- the result store is only named here (result_ref): the API streams it from there.
SELECT j.payload, coalesce(j.result, r.result) AS result, j.result_ref
FROM jobs j
LEFT JOIN job_results r ON r.job_id = j.id
WHERE j.id = $1

-- name: admin_history
-- history, whatever the job's tenant (the console). The error is returned as stored: every
-- member the worker recorded (a traceback too), not only the ones this version knows.
SELECT t.version, t.from_state, t.to_state, t.at, t.worker, t.attempt, t.error, t.progress,
       t.cancel_requested
FROM jobs j
JOIN job_transitions t ON t.job_id = j.id AND t.at >= j.created_at
WHERE j.id = $1
ORDER BY t.version

-- name: insert_audit
-- Records of admin actions; a record sent twice (deferred while Postgres was down, then
-- written by two API processes) is one row.
INSERT INTO audit (id, at, actor, action, target, status, detail, source)
SELECT * FROM unnest($1::text[], $2::timestamptz[], $3::text[], $4::text[], $5::text[],
                     $6::int[], $7::json[], $8::text[])
ON CONFLICT (id) DO NOTHING

-- name: list_audit
-- Newest first, keyset on id (a ULID: time-ordered); audit_store.py puts fixed fragments in
-- place of /*filters*/ (`AND target = $2`, `AND action = $3`, `AND id < $4`, numbered in
-- the order given), never caller input.
SELECT id, at, actor, action, target, status, detail, source
FROM audit
WHERE true /*filters*/
ORDER BY id DESC
LIMIT $1

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

-- name: lock_blockers
-- db.migrate, while a try waits for a lock: the sessions that block the migrating session $1
-- (pg_blocking_pids: those holding a conflicting lock, and those ahead of it in the lock's
-- queue; 0 for a prepared transaction), with the tables each holds locks on.
SELECT b.pid, coalesce(a.state, '?') AS state, coalesce(a.application_name, '') AS application_name,
       coalesce(a.usename::text, '') AS usename,
       coalesce(extract(epoch FROM now() - a.xact_start), 0)::float8 AS seconds,
       coalesce(a.query, '') AS query,
       ARRAY(
           SELECT DISTINCT c.relname::text
           FROM pg_locks l JOIN pg_class c ON c.oid = l.relation
           WHERE l.pid = b.pid AND l.granted AND c.relkind IN ('r', 'p')
           ORDER BY 1
       ) AS tables
FROM unnest(pg_blocking_pids($1)) AS b (pid)
LEFT JOIN pg_stat_activity a ON a.pid = b.pid

-- name: create_migrations_table
CREATE TABLE IF NOT EXISTS schema_migrations (
    name       text        PRIMARY KEY,
    applied_at timestamptz NOT NULL DEFAULT now()
)

-- name: database_collation
-- 'C' or 'POSIX' compares bytes, unless the database's locale provider is ICU (Postgres 15 on:
-- datlocprovider 'i'; read through to_jsonb, as older servers have no such column)
SELECT CASE WHEN to_jsonb(d) ->> 'datlocprovider' = 'i' THEN 'ICU ' || (to_jsonb(d) ->> 'daticulocale')
            ELSE datcollate END
FROM pg_database d WHERE datname = current_database()

-- name: applied_migrations
SELECT name FROM schema_migrations ORDER BY name

-- name: record_migration
INSERT INTO schema_migrations (name) VALUES ($1)

-- name: insert_schedule
INSERT INTO schedules (id, tenant, name, type, payload, priority, max_attempts, cron, timezone,
                       interval_seconds, misfire_policy, paused, next_fire_at, created_at,
                       updated_at, queue, start_at, end_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $14, $15, $16, $17)
RETURNING *

-- name: schedule_named
SELECT id FROM schedules WHERE tenant = $1 AND name = $2

-- name: get_schedule
SELECT * FROM schedules WHERE id = $1 AND tenant = $2

-- name: list_schedules
SELECT * FROM schedules WHERE tenant = $1 AND name > $2 ORDER BY name LIMIT $3

-- name: lock_schedule
-- A change's first read: held until its Redis copy is written too (api/schedules.py)
SELECT * FROM schedules WHERE id = $1 AND tenant = $2 FOR UPDATE

-- name: update_schedule
UPDATE schedules
SET name = $3, type = $4, payload = $5, priority = $6, max_attempts = $7, cron = $8,
    timezone = $9, interval_seconds = $10, misfire_policy = $11, paused = $12,
    next_fire_at = $13, queue = $14, start_at = $15, end_at = $16, updated_at = now()
WHERE id = $1 AND tenant = $2
RETURNING *

-- name: delete_schedule
DELETE FROM schedules WHERE id = $1 AND tenant = $2 RETURNING id

-- name: all_schedules
SELECT * FROM schedules ORDER BY id

-- name: sync_schedule_times
-- The scheduler copies the firing state it keeps in Redis back here, now and then: to rows
-- still as it read them (a change since wrote its own times; it is not waited for and undone).
UPDATE schedules AS s
SET next_fire_at = t.next_fire_at, last_fired_at = t.last_fired_at
FROM unnest($1::text[], $2::timestamptz[], $3::timestamptz[], $4::timestamptz[])
    AS t(id, next_fire_at, last_fired_at, updated_at)
WHERE s.id = t.id
  AND s.updated_at = t.updated_at
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
-- (a job finishes after it is created: created_at < $1 lets jobs_created_idx find them)
SELECT count(*) FROM jobs
WHERE created_at < $1 AND state IN ('succeeded', 'failed', 'cancelled') AND updated_at < $1

-- name: delete_finished_jobs
-- One window of jobs created before $1 in created_at order, after ($3, $4) (where the previous
-- window ended): $2 rows at most, read through jobs_created_idx. Of those, the jobs that
-- finished before $1 are deleted (no index covers `state` or `updated_at`: migrations/0001 says
-- why). A pass reads each job created before $1 once, so jobs that stay (waiting, scheduled
-- far ahead, running, or finished later) are never read again in that pass. Rows a persister
-- is writing are skipped, not waited for (the next pass takes them); the state is checked on
-- the locked row, so a job moving on meanwhile (a replayed dead letter) is not deleted.
-- job_results rows go with their job (ON DELETE CASCADE), jobs_by_state rows by its trigger.
WITH scanned AS (
    SELECT id, created_at FROM jobs
    WHERE created_at < $1 AND (created_at, id) > ($3, $4)
    ORDER BY created_at, id
    LIMIT $2
), gone AS (
    DELETE FROM jobs
    WHERE id IN (
        SELECT j.id FROM jobs AS j JOIN scanned AS s ON s.id = j.id
        WHERE j.state IN ('succeeded', 'failed', 'cancelled') AND j.updated_at < $1
        FOR UPDATE OF j SKIP LOCKED
    )
    RETURNING 1
), last AS (
    SELECT created_at, id FROM scanned ORDER BY created_at DESC, id DESC LIMIT 1
)
SELECT (SELECT count(*) FROM gone) AS deleted, (SELECT count(*) FROM scanned) AS scanned,
       (SELECT created_at FROM last) AS last_at, (SELECT id FROM last) AS last_id

-- 0001: jobtier's Postgres schema; migrations numbered after it change it from here.
-- Migrations run in order, each once, in one transaction with the others that are
-- pending (db.migrate), so none may use a statement that cannot run in a transaction. Never
-- edit one that has shipped: add the next number. The schema_migrations bookkeeping table
-- belongs to db.migrate().
--
-- payload, result, error and progress are `json`, not `jsonb`: they are stored and served back
-- verbatim (the bytes a client submitted or a task returned), and `jsonb` refuses valid JSON
-- such as "\u0000", which would stall the write-behind on one job's payload.

-- One row per job: its latest state, written behind from the shard log streams. `version` only
-- moves forward (see queries.sql: upsert_jobs).
CREATE TABLE jobs (
    id               text        NOT NULL,
    tenant           text        NOT NULL,
    type             text        NOT NULL,
    priority         text        NOT NULL,
    state            text        NOT NULL,
    version          integer     NOT NULL,
    attempt          integer     NOT NULL,
    max_attempts     integer     NOT NULL,
    created_at       timestamptz NOT NULL,
    updated_at       timestamptz NOT NULL,
    run_at           timestamptz,
    -- NULL only until the submit entry is written (another persister may commit a later
    -- version of the job first)
    payload          json,
    idempotency_key  text,
    -- inline when at most 64 KiB; larger results live in job_results and this stays NULL
    result           json,
    result_size      integer,
    error            json,
    progress         json,
    cancel_requested boolean     NOT NULL DEFAULT false,
    worker           text,
    -- the status document of `version`, byte for byte what Redis served
    doc              bytea       NOT NULL,
    queue            text        NOT NULL DEFAULT 'default',
    -- the result store's reference when the result is kept outside Redis (result_blobs, or
    -- a file): then result stays NULL
    result_ref       text,
    CONSTRAINT jobs_pkey PRIMARY KEY (id),
    CONSTRAINT jobs_state_check CHECK (
        state IN ('waiting', 'scheduled', 'queued', 'running', 'succeeded', 'failed', 'cancelled')
    ),
    CONSTRAINT jobs_priority_check CHECK (priority IN ('critical', 'high', 'normal', 'low'))
) WITH (fillfactor = 50);  -- room on each page for its rows' next versions (below)

-- The indexes of `jobs` cover only what a job keeps from its submit on, never `state` or
-- `updated_at`: so a transition's update is HOT (heap-only: the new version on the same page,
-- no index entry) where the page has room. While an index covered `state`, every transition
-- wrote an entry in each of the table's eleven indexes: most of Postgres's work per
-- transition (bench/persist.py --profile). fillfactor 50 keeps room on each page for a new
-- version of every row on it, as jobs submitted together (one page) tend to move on together,
-- in one batch of the persister; old versions are pruned from the page as it is next written.
-- Written as a persister writes a backlog, about a fifth of the updates were HOT with 80,
-- over nine in ten with 50; the `HOT updates` column of bench/compare.py --persister counts
-- them end to end. The price: the table's pages are half full (its indexes are not bigger).
-- Listings by state go through `jobs_by_state` below.
--
-- listing: a tenant's jobs newest (or oldest) first, keyset paginated by (created_at, id),
-- optionally filtered by type or queue (by state: jobs_by_state)
CREATE INDEX jobs_tenant_created_idx ON jobs (tenant, created_at, id);
CREATE INDEX jobs_tenant_type_created_idx ON jobs (tenant, type, created_at, id);
CREATE INDEX jobs_tenant_queue_created_idx ON jobs (tenant, queue, created_at, id);
-- the admin listing across tenants (the console): every job, or by type or queue, newest
-- first; an id prefix as a range in byte order, whatever the database's collation; retention
-- finds finished jobs in created_at order (a job finishes after it is created)
CREATE INDEX jobs_created_idx ON jobs (created_at, id);
CREATE INDEX jobs_type_created_idx ON jobs (type, created_at, id);
CREATE INDEX jobs_queue_created_idx ON jobs (queue, created_at, id);
CREATE INDEX jobs_id_prefix_idx ON jobs (id COLLATE "C");

-- The jobs a listing by state finds through an index: one row per job whose state is not
-- `succeeded` (a listing of succeeded jobs filters `jobs` in created_at order, where they are
-- the many). Triggers on `jobs` keep it in step in the same transaction, whoever writes: each
-- statement's inserted and updated rows (an update a newer version had already won against
-- changes no row, so nothing here), and its deleted ones; a TRUNCATE of jobs empties it.
CREATE TABLE jobs_by_state (
    id         text        NOT NULL,
    tenant     text        NOT NULL,
    state      text        NOT NULL,
    type       text        NOT NULL,
    queue      text        NOT NULL,
    created_at timestamptz NOT NULL,
    CONSTRAINT jobs_by_state_pkey PRIMARY KEY (id)
);

CREATE INDEX jobs_by_state_tenant_idx ON jobs_by_state (tenant, state, created_at, id);
CREATE INDEX jobs_by_state_state_idx ON jobs_by_state (state, created_at, id);

-- The triggers find jobs_by_state's rows by key, from the ids of the rows the statement
-- changed (ON CONFLICT, or = ANY of an array), and their deletes are planned at each call
-- (EXECUTE), from the table's size and the batch's then. A plan PL/pgSQL keeps for the
-- session is made from the sizes of its first calls: made on a fresh or just emptied table,
-- it read the whole table (or a whole index) once per batch or once per changed row, which
-- took seconds a batch once the table had grown.

-- new jobs (a row of theirs could be here only if jobs_by_state had outlived it: kept)
CREATE FUNCTION jobs_by_state_add() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO jobs_by_state (id, tenant, state, type, queue, created_at)
    SELECT id, tenant, state, type, queue, created_at FROM changed
    WHERE state <> 'succeeded'
    ORDER BY id
    ON CONFLICT (id) DO NOTHING;
    RETURN NULL;
END
$$;

-- jobs that moved on (a row whose columns did not change is not written: a progress-only
-- version, or fill_submitted's update, costs a look-up and a row lock)
CREATE FUNCTION jobs_by_state_follow() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    EXECUTE 'DELETE FROM jobs_by_state '
            'WHERE id = ANY (ARRAY(SELECT id FROM changed WHERE state = ''succeeded''))';
    INSERT INTO jobs_by_state AS b (id, tenant, state, type, queue, created_at)
    SELECT id, tenant, state, type, queue, created_at FROM changed
    WHERE state <> 'succeeded'
    ORDER BY id
    ON CONFLICT (id) DO UPDATE
    SET tenant = excluded.tenant, state = excluded.state, type = excluded.type,
        queue = excluded.queue, created_at = excluded.created_at
    WHERE (b.tenant, b.state, b.type, b.queue, b.created_at)
          IS DISTINCT FROM (excluded.tenant, excluded.state, excluded.type, excluded.queue,
                            excluded.created_at);
    RETURN NULL;
END
$$;

-- deleted jobs (retention, by hand)
CREATE FUNCTION jobs_by_state_forget() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    EXECUTE 'DELETE FROM jobs_by_state WHERE id = ANY (ARRAY(SELECT id FROM gone))';
    RETURN NULL;
END
$$;

CREATE FUNCTION jobs_by_state_empty() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM jobs_by_state;  -- (not TRUNCATE: a TRUNCATE of both tables runs this too)
    RETURN NULL;
END
$$;

CREATE TRIGGER jobs_by_state_inserted AFTER INSERT ON jobs
    REFERENCING NEW TABLE AS changed FOR EACH STATEMENT EXECUTE FUNCTION jobs_by_state_add();
CREATE TRIGGER jobs_by_state_updated AFTER UPDATE ON jobs
    REFERENCING NEW TABLE AS changed FOR EACH STATEMENT EXECUTE FUNCTION jobs_by_state_follow();
CREATE TRIGGER jobs_by_state_deleted AFTER DELETE ON jobs
    REFERENCING OLD TABLE AS gone FOR EACH STATEMENT EXECUTE FUNCTION jobs_by_state_forget();
CREATE TRIGGER jobs_by_state_truncated AFTER TRUNCATE ON jobs
    FOR EACH STATEMENT EXECUTE FUNCTION jobs_by_state_empty();

-- Every change of every job's status document that its shard log carried (a progress-only
-- change, or a waiting job's dependency count, may be left out of the log: store/lua/heartbeat.lua,
-- store/lua/resolve.lua), exactly once: the key makes replays harmless, as a replayed entry carries
-- the same `at`. `prev_version` is the version of the job's previous row (0 for its first;
-- NULL means version - 1: rows from before the column, when every version was logged).
-- Following it from the job's latest version down to version 1 proves the history complete
-- (queries.sql: history_gaps). `worker` is who made the change: a worker id, or 'api',
-- 'scheduler', 'admin', 'resolver'. No foreign key to jobs: the history is
-- append-only and written at tens of thousands of rows a second.
--
-- Partitioned by day (UTC) on `at`, so that retention drops whole days instead of deleting
-- rows (persist/retention.py creates the daily partitions ahead and drops the expired ones);
-- rows no daily partition covers land in job_transitions_default, so a write is never
-- refused for want of a partition. The key must include the partition key, hence `at`.
CREATE TABLE job_transitions (
    job_id           text        NOT NULL,
    version          integer     NOT NULL,
    prev_version     integer,
    from_state       text,
    to_state         text        NOT NULL,
    at               timestamptz NOT NULL,
    worker           text        NOT NULL,
    attempt          integer     NOT NULL,
    error            json,
    progress         json,
    cancel_requested boolean     NOT NULL,
    CONSTRAINT job_transitions_pkey PRIMARY KEY (job_id, version, at)
) PARTITION BY RANGE (at);

CREATE TABLE job_transitions_default PARTITION OF job_transitions DEFAULT;

-- Results larger than the inline limit.
CREATE TABLE job_results (
    job_id text    NOT NULL,
    result json    NOT NULL,
    size   integer NOT NULL,
    CONSTRAINT job_results_pkey PRIMARY KEY (job_id),
    CONSTRAINT job_results_job_id_fkey FOREIGN KEY (job_id) REFERENCES jobs (id) ON DELETE CASCADE
);

-- What each job waits for (flows), from its submit entry: one row per dependency, `position`
-- its place in the job's list, `child` true when it was created in the same flow (the job's
-- child). Rows go with their job (retention).
CREATE TABLE job_dependencies (
    job_id     text    NOT NULL,
    depends_on text    NOT NULL,
    position   integer NOT NULL,
    child      boolean NOT NULL,
    CONSTRAINT job_dependencies_pkey PRIMARY KEY (job_id, depends_on),
    CONSTRAINT job_dependencies_job_id_fkey FOREIGN KEY (job_id) REFERENCES jobs (id) ON DELETE CASCADE
);

-- who waits for a job
CREATE INDEX job_dependencies_depends_on_idx ON job_dependencies (depends_on);

-- Recurring jobs (cron expression or fixed interval), for the scheduler.
CREATE TABLE schedules (
    id               text        NOT NULL,
    tenant           text        NOT NULL,
    name             text        NOT NULL,
    type             text        NOT NULL,
    payload          json        NOT NULL,
    priority         text        NOT NULL DEFAULT 'normal',
    max_attempts     integer,
    cron             text,
    timezone         text        NOT NULL DEFAULT 'UTC',
    interval_seconds integer,
    -- what to do with firings missed while no scheduler ran: skip them, fire once, fire each
    misfire_policy   text        NOT NULL DEFAULT 'fire_once',
    paused           boolean     NOT NULL DEFAULT false,
    next_fire_at     timestamptz,
    last_fired_at    timestamptz,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    -- the queue of its jobs (NULL: the task's queue, else `default`)
    queue            text,
    CONSTRAINT schedules_pkey PRIMARY KEY (id),
    CONSTRAINT schedules_tenant_name_key UNIQUE (tenant, name),
    CONSTRAINT schedules_cron_or_interval_check CHECK ((cron IS NULL) <> (interval_seconds IS NULL)),
    CONSTRAINT schedules_interval_check CHECK (interval_seconds > 0),
    CONSTRAINT schedules_misfire_policy_check CHECK (misfire_policy IN ('skip', 'fire_once', 'fire_all')),
    CONSTRAINT schedules_priority_check CHECK (priority IN ('critical', 'high', 'normal', 'low'))
);

CREATE INDEX schedules_due_idx ON schedules (next_fire_at) WHERE NOT paused;

-- Every admin action (api/audit.py): who (a fingerprint of the admin key, never the key),
-- when, what, on what (a job id, a queue, a filter), the HTTP status it was answered with, and
-- details (how many jobs a purge cancelled, the limits set). `id` is a ULID made by the API
-- process: time-ordered, the listing's order and cursor. An action recorded while Postgres was
-- down waits in Redis and is written later with its own id and time (a replay is a duplicate
-- key, ignored).
CREATE TABLE audit (
    id      text        NOT NULL,
    at      timestamptz NOT NULL,
    actor   text        NOT NULL,
    action  text        NOT NULL,
    target  text        NOT NULL,
    status  integer     NOT NULL,
    detail  json,
    source  text,
    CONSTRAINT audit_pkey PRIMARY KEY (id)
);

CREATE INDEX audit_target_idx ON audit (target, id);

-- Webhooks (the dispatcher, src/jobtier/webhooks/) and results kept outside Redis.
--
-- Each tenant signs its deliveries with its own secret (Standard Webhooks, `whsec_` + base64);
-- after a rotation the previous one still signs, beside the new one, until previous_until.
CREATE TABLE webhook_secrets (
    tenant         text        NOT NULL,
    secret         text        NOT NULL,
    previous       text,
    previous_until timestamptz,
    created_at     timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT webhook_secrets_pkey PRIMARY KEY (tenant)
);

-- A tenant's subscriptions: every job of the tenant, terminal states or every transition.
CREATE TABLE webhook_subscriptions (
    id          text        NOT NULL,
    tenant      text        NOT NULL,
    url         text        NOT NULL,
    events      text        NOT NULL,
    description text,
    created_at  timestamptz NOT NULL DEFAULT now(),
    -- set when the receiver answered 410 Gone: nothing more is sent to it
    disabled_at timestamptz,
    CONSTRAINT webhook_subscriptions_pkey PRIMARY KEY (id),
    CONSTRAINT webhook_subscriptions_events_check CHECK (events IN ('terminal', 'all'))
);
CREATE INDEX webhook_subscriptions_tenant_idx ON webhook_subscriptions (tenant, created_at, id);

-- A job's own callback (the submit's `callback`), written by the API before the job exists in
-- Redis, so the dispatcher finds it for any of the job's transitions. No foreign key to jobs:
-- the job row is written behind, later. Retention deletes it with its job.
CREATE TABLE webhook_job_callbacks (
    job_id     text        NOT NULL,
    tenant     text        NOT NULL,
    url        text        NOT NULL,
    events     text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT webhook_job_callbacks_pkey PRIMARY KEY (job_id),
    CONSTRAINT webhook_job_callbacks_events_check CHECK (events IN ('terminal', 'all'))
);
-- does a tenant still have one (the dispatchers' clean-up of webhook marks)
CREATE INDEX webhook_job_callbacks_tenant_idx ON webhook_job_callbacks (tenant);

-- One row per (transition, target): `id` is the webhook-id receivers deduplicate by, made
-- from the job id, its version and the target, so a log entry read twice (a dispatcher that
-- died before acknowledging it) makes no second delivery. A delivery waits here between
-- attempts: `next_attempt_at` is when it is due, and also its lease while an attempt is in
-- flight (a dispatcher that dies mid-attempt leaves it due again when the lease ends).
-- `lease` fences the attempt's outcome: only the holder of the current lease records it.
CREATE TABLE webhook_deliveries (
    id              text        NOT NULL,
    tenant          text        NOT NULL,
    job_id          text        NOT NULL,
    job_version     integer     NOT NULL,
    subscription_id text,
    url             text        NOT NULL,
    event           text        NOT NULL,
    body            bytea       NOT NULL,
    state           text        NOT NULL DEFAULT 'pending',
    attempts        integer     NOT NULL DEFAULT 0,
    created_at      timestamptz NOT NULL DEFAULT now(),
    -- when the transition happened (the log entry's time): delivery latency counts from it
    occurred_at     timestamptz NOT NULL,
    next_attempt_at timestamptz,
    lease           text,
    last_status     integer,
    last_error      text,
    finished_at     timestamptz,
    CONSTRAINT webhook_deliveries_pkey PRIMARY KEY (id),
    CONSTRAINT webhook_deliveries_state_check CHECK (
        state IN ('pending', 'delivered', 'failed', 'cancelled')
    )
);
CREATE INDEX webhook_deliveries_due_idx ON webhook_deliveries (next_attempt_at)
    WHERE state = 'pending';
CREATE INDEX webhook_deliveries_job_idx ON webhook_deliveries (job_id, created_at);
CREATE INDEX webhook_deliveries_subscription_idx ON webhook_deliveries (subscription_id, created_at)
    WHERE subscription_id IS NOT NULL;

-- Every attempt of a delivery: when, how long, what the receiver answered (or why none).
CREATE TABLE webhook_attempts (
    delivery_id text        NOT NULL,
    attempt     integer     NOT NULL,
    at          timestamptz NOT NULL,
    duration_ms real        NOT NULL,
    status      integer,
    error       text,
    response    text,
    CONSTRAINT webhook_attempts_pkey PRIMARY KEY (delivery_id, attempt),
    CONSTRAINT webhook_attempts_delivery_id_fkey FOREIGN KEY (delivery_id)
        REFERENCES webhook_deliveries (id) ON DELETE CASCADE
);

-- Results over JOBTIER_RESULT_STORE_THRESHOLD_BYTES with JOBTIER_RESULT_STORE=postgres: the
-- worker writes them here before it reports the success, one row per attempt (`token`, the
-- attempt's fencing token), so that an attempt whose success Redis refused (its lease was
-- lost) cannot overwrite the result of the one that won. jobs.result_ref names the winner.
-- No foreign key to jobs: the job row may not be written yet. Retention deletes them with
-- their job.
CREATE TABLE result_blobs (
    job_id     text        NOT NULL,
    token      integer     NOT NULL,
    data       bytea       NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT result_blobs_pkey PRIMARY KEY (job_id, token)
);
-- stored uncompressed: the API streams a blob in slices (substring), which Postgres then
-- reads slice by slice instead of decompressing the whole value for each
ALTER TABLE result_blobs ALTER COLUMN data SET STORAGE EXTERNAL;

-- Whatever deletes jobs (retention, by hand) deletes what belongs to them and has no foreign
-- key to them (their rows may be written before the job's): large results, callbacks,
-- deliveries (whose attempts go with them). One statement-level trigger per DELETE.
CREATE FUNCTION jobs_deleted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM result_blobs WHERE job_id IN (SELECT id FROM gone);
    DELETE FROM webhook_job_callbacks WHERE job_id IN (SELECT id FROM gone);
    DELETE FROM webhook_deliveries WHERE job_id IN (SELECT id FROM gone);
    RETURN NULL;
END
$$;
CREATE TRIGGER jobs_deleted AFTER DELETE ON jobs
    REFERENCING OLD TABLE AS gone FOR EACH STATEMENT EXECUTE FUNCTION jobs_deleted();

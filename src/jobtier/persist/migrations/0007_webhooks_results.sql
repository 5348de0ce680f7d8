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

-- The result store's reference of a job's result when it is kept outside Redis (see above).
ALTER TABLE jobs ADD COLUMN result_ref text;

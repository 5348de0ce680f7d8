-- 0005: the operator's console. Indexes for the admin listing of jobs across tenants
-- (GET /v1/admin/jobs: newest first by (created_at, id), optionally by state, type, queue,
-- a time range or an id prefix; a tenant filter uses the jobs_tenant_* indexes of 0001/0003),
-- and the audit table of admin actions (GET /v1/admin/audit).
--
-- Cost: the indexes are built in the migration's transaction, which holds writes to `jobs`
-- back while it runs (the persisters wait; nothing is lost). Afterwards every new version of a
-- job row writes five more index entries (bench/console.py measures both costs).

-- every job, newest first; a time range
CREATE INDEX jobs_created_idx ON jobs (created_at, id);
-- by state (failed, running, ... across every tenant), type or queue, newest first
CREATE INDEX jobs_state_created_idx ON jobs (state, created_at, id);
CREATE INDEX jobs_type_created_idx ON jobs (type, created_at, id);
CREATE INDEX jobs_queue_created_idx ON jobs (queue, created_at, id);
-- an id prefix ("01HV3K…"): a range in byte order, whatever the database's collation (the
-- primary key's order is the collation's, which a prefix range cannot use unless it is "C")
CREATE INDEX jobs_id_prefix_idx ON jobs (id COLLATE "C");

-- Every admin action: who (a fingerprint of the admin key, never the key), when, what, on
-- what, and the answer it got. `id` is a ULID made by the API process (time-ordered: the
-- listing's order and cursor); an action recorded while Postgres was down is written later
-- with its own id and time (api/audit.py), so a replayed record is a duplicate key, ignored.
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
-- one job's or one queue's actions (the job page shows them)
CREATE INDEX audit_target_idx ON audit (target, id);

-- 0002: job_transitions partitioned by day on `at`, with prev_version (the previous logged
-- version: progress reports are coalesced in the log); an index to prune finished jobs.
--
-- The existing rows are not copied: the old table becomes one partition,
-- job_transitions_legacy, covering everything before the UTC day after its newest row
-- (retention drops it whole once that day is past JOBTIER_PG_HISTORY_RETENTION_DAYS); on an
-- empty table it is simply dropped. Its rows get prev_version NULL, which means version - 1:
-- every version was logged then. The old key (job_id, version) becomes (job_id, version, at):
-- a partitioned table's keys must include the partition key.
--
-- Cost on a large deployment, all inside this one transaction while the persisters wait
-- (their entries stay in Redis): one scan for the newest row, one to build the new key, one
-- to check the partition bound, and an index build on jobs. Persisters of the previous
-- version cannot write to the new table (their ON CONFLICT names the old key): they retry
-- until the new version replaces them, and nothing is lost.

ALTER TABLE job_transitions RENAME TO job_transitions_legacy;
ALTER TABLE job_transitions_legacy
    RENAME CONSTRAINT job_transitions_pkey TO job_transitions_legacy_old_key;
ALTER TABLE job_transitions_legacy ADD COLUMN prev_version integer;

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

DO $$
DECLARE
    newest timestamptz;
BEGIN
    SELECT max(at) INTO newest FROM job_transitions_legacy;
    IF newest IS NULL THEN
        DROP TABLE job_transitions_legacy;
        RETURN;
    END IF;
    ALTER TABLE job_transitions_legacy DROP CONSTRAINT job_transitions_legacy_old_key;
    ALTER TABLE job_transitions_legacy
        ADD CONSTRAINT job_transitions_legacy_pkey PRIMARY KEY (job_id, version, at);
    EXECUTE format(
        'ALTER TABLE job_transitions ATTACH PARTITION job_transitions_legacy '
        'FOR VALUES FROM (MINVALUE) TO (%L)',
        (date_trunc('day', newest AT TIME ZONE 'UTC') + interval '1 day') AT TIME ZONE 'UTC'
    );
END
$$;

CREATE INDEX jobs_finished_idx ON jobs (updated_at)
    WHERE state IN ('succeeded', 'failed', 'cancelled');

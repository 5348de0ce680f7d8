-- Flows: a job may wait for others (state `waiting`), and the jobs it waits for are kept.
-- The state check is replaced (dropping and adding a CHECK holds writes to `jobs` back while
-- the existing rows are checked; the persisters wait, nothing is lost).
ALTER TABLE jobs DROP CONSTRAINT jobs_state_check;
ALTER TABLE jobs ADD CONSTRAINT jobs_state_check CHECK (
    state IN ('waiting', 'scheduled', 'queued', 'running', 'succeeded', 'failed', 'cancelled')
);
-- One row per (job, job it waits for), from the job's submit entry: `position` is its place
-- in the job's list, `child` says it was created in the same flow (a flow's child).
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

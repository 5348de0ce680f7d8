-- Checkpoints (ctx.checkpoint; docs/checkpoints-and-shedding.md): each state a job saved,
-- from the log entry of the transition that saved it ('cp'), keyed as that transition is
-- (job_id, version). Rows go with their job (retention), as job_results' do.
CREATE TABLE job_checkpoints (
    job_id  text        NOT NULL,
    version integer     NOT NULL,
    at      timestamptz NOT NULL,
    attempt integer     NOT NULL,
    worker  text        NOT NULL,
    state   json        NOT NULL,
    CONSTRAINT job_checkpoints_pkey PRIMARY KEY (job_id, version),
    CONSTRAINT job_checkpoints_job_id_fkey FOREIGN KEY (job_id) REFERENCES jobs (id) ON DELETE CASCADE
);

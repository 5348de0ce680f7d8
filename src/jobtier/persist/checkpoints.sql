-- Named queries of checkpoints (migrations/0011_checkpoints.sql); db.query(name) finds them.

-- name: insert_checkpoints
-- From the log entries that saved one ('cp'), after their jobs' rows are written (the
-- foreign key); a replayed entry changes nothing.
INSERT INTO job_checkpoints (job_id, version, at, attempt, worker, state)
SELECT * FROM unnest($1::text[], $2::int[], $3::timestamptz[], $4::int[], $5::text[], $6::json[])
ORDER BY 1, 2
ON CONFLICT (job_id, version) DO NOTHING

-- name: latest_checkpoint
-- The last state a job saved, the tenant's job only.
SELECT c.state, c.at, c.attempt, c.version
FROM job_checkpoints c
JOIN jobs j ON j.id = c.job_id
WHERE c.job_id = $1 AND j.tenant = $2
ORDER BY c.version DESC
LIMIT 1

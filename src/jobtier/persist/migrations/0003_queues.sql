-- Named queues: each job belongs to one (its status document says which), and a schedule's
-- jobs go to the queue it names (NULL: the task's queue, else `default`). Adding a column
-- with a constant default is instant; the index is built in the migration's transaction,
-- which holds writes to `jobs` back while it runs (the persisters wait; nothing is lost).
ALTER TABLE jobs ADD COLUMN queue text NOT NULL DEFAULT 'default';
CREATE INDEX jobs_tenant_queue_created_idx ON jobs (tenant, queue, created_at, id);
ALTER TABLE schedules ADD COLUMN queue text;

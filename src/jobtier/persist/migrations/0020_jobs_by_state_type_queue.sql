-- 0020: list the jobs of one type, or of one queue, in a state that jobs collect in (failed,
-- cancelled; waiting, scheduled) without reading every job in that state. Before it, such a
-- listing across tenants paged through jobs_by_state_state_idx (or read the whole table) and
-- kept the rows of the type: on 1M jobs, `state=failed & type=<a rare type>` took 7-10 ms a
-- page where every other filter took under 4 (bench/results/console.md).
-- Partial: a job that is only queued and then running, the path of nearly every job, writes
-- no entry here (a partial index is written only for rows its predicate holds for), so the
-- write-behind pays for these only on the jobs that fail, are cancelled, wait for others or
-- are scheduled. Queued and running jobs of one type are read either among that state's rows
-- or among that type's jobs in `jobs` (by its type index), whichever Postgres's statistics
-- say are fewer (persist/listing_stats.py). The listing names the state as a literal
-- (pg_reader._filters), which is what lets every plan, generic ones included, use them.
CREATE INDEX jobs_by_state_type_idx ON jobs_by_state (type, state, created_at, id)
    WHERE state IN ('failed', 'cancelled', 'waiting', 'scheduled');
CREATE INDEX jobs_by_state_queue_idx ON jobs_by_state (queue, state, created_at, id)
    WHERE state IN ('failed', 'cancelled', 'waiting', 'scheduled');

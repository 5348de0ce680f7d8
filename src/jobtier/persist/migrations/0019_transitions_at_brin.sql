-- 0019: find the jobs Postgres changed recently without reading a day's history (jobtier
-- reconcile, persist/reconcile.py: the jobs with a transition since a moment). A BRIN index
-- on `at`: the history is written in time order, so a range of pages summarises a range of
-- times; it costs next to nothing per row written (pages appended since the last summary are
-- simply read), where a B-tree would add an index entry to every transition. Created on the
-- partitioned table, it is on every partition, and on those attached later (retention.py).
CREATE INDEX job_transitions_at_brin ON job_transitions USING brin (at);

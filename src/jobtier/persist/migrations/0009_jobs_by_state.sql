-- 0009: listings by state from a table of their own, so that a job's row changes in place.
--
-- Every transition changes a job's `state` (and `updated_at`). While an index of `jobs`
-- covered either, no update of a job's row could be HOT (heap-only: the new version on the
-- same page, no index entry), so every transition wrote an entry in each of the table's
-- eleven indexes: most of Postgres's work per transition (bench/persist.py --profile).
-- Now `jobs` indexes only what a job keeps from its submit on (tenant, type, queue,
-- created_at, id), and its updates are HOT where the page has room: fillfactor 50 keeps room
-- on each page for a new version of every row on it, since jobs submitted together (one
-- page) tend to move on together, in one batch of the persister; the old versions are pruned
-- from the page as it is next written. Written as a persister writes a backlog (a batch
-- moves every job of many pages on), about a fifth of the updates were HOT with 80, over
-- nine in ten with 50 (60K transitions written both ways); end to end, the `HOT updates`
-- column of bench/compare.py --persister counts them (84 % in its set after this change).
-- The price: the table's pages are half full (its indexes are not bigger).
--
-- A listing by state finds its jobs in `jobs_by_state`: one row per job whose state is not
-- `succeeded`, the state nearly every job ends in (a listing of succeeded jobs filters
-- `jobs` in created_at order, where they are the many). A job that succeeds leaves it. Two
-- statement-level triggers keep it in step with `jobs` in the same transaction, whatever
-- writes the rows (a persister of this version or the previous one, an operator), from the
-- rows each statement inserted or updated: an update a newer version had won against (an
-- older batch committed late) changes no row and so nothing here. Retention's deletes take
-- the rows along (a third trigger), and so does a TRUNCATE of jobs (a fourth).
--
-- Retention finds finished jobs in created_at order now (a job finishes after it is
-- created), so jobs_finished_idx goes too.
--
-- Cost on a large deployment, inside this one transaction while the persisters wait (their
-- entries stay in Redis; the first statement makes them wait, so that no batch commits
-- between the copy below and the triggers): one read of the jobs not succeeded through the
-- old state index, and two index builds on that many rows. Readers of `jobs` are not held up.
--
-- In a rolling deploy, the previous version's processes lose the indexes they used: its
-- listings by state filter `jobs` in created_at order, and its persisters' retention passes
-- (at their start, then hourly) read the whole table per batch. Nothing is wrong, only slow
-- until they are replaced: upgrade the persisters first.

LOCK TABLE jobs IN SHARE ROW EXCLUSIVE MODE;

CREATE TABLE jobs_by_state (
    id         text        NOT NULL,
    tenant     text        NOT NULL,
    state      text        NOT NULL,
    type       text        NOT NULL,
    queue      text        NOT NULL,
    created_at timestamptz NOT NULL,
    CONSTRAINT jobs_by_state_pkey PRIMARY KEY (id)
);

INSERT INTO jobs_by_state (id, tenant, state, type, queue, created_at)
SELECT id, tenant, state, type, queue, created_at FROM jobs
WHERE state IN ('waiting', 'scheduled', 'queued', 'running', 'failed', 'cancelled');

CREATE INDEX jobs_by_state_tenant_idx ON jobs_by_state (tenant, state, created_at, id);
CREATE INDEX jobs_by_state_state_idx ON jobs_by_state (state, created_at, id);
ANALYZE jobs_by_state;  -- its listings are planned from its first use

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

DROP INDEX jobs_tenant_state_created_idx;
DROP INDEX jobs_state_created_idx;
DROP INDEX jobs_finished_idx;

-- room on each page for its rows' next versions (HOT); pages written from now on
ALTER TABLE jobs SET (fillfactor = 50);

-- 0024: a job still only in the outbox (committed with jobtier.submit, not relayed yet) can be
-- cancelled: its row is marked relayed and cancelled in one UPDATE that only a row not relayed
-- yet matches (api/http.py: outbox_transition), so the relay, which holds the rows it takes
-- locked, and a cancel cannot both have it. The relay then never takes it; a status read
-- answers it `cancelled`; it is kept as long as finished jobs, as a refused row is. NULL: not
-- cancelled. A column without a default: no row is rewritten.
ALTER TABLE jobtier.outbox ADD COLUMN cancelled_at timestamptz;

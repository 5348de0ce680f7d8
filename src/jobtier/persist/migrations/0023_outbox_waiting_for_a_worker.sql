-- 0023: an outbox row whose type no worker has advertised yet is not refused at once: the
-- caller's transaction has committed, and a task's producer deployed before its first worker
-- would lose its jobs to the refusal. The relay leaves such a row pending, looked at again
-- from `not_before` on, and refuses it only once it has waited its patience
-- (persist/outbox.py: UNKNOWN_TYPE_PATIENCE). NULL: the row is to be taken as soon as read.
-- A column without a default: no row is rewritten.
ALTER TABLE jobtier.outbox ADD COLUMN not_before timestamptz;

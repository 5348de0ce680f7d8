-- 0025: a schedule may have dates: no slot before start_at nor after end_at (engine/cron.py;
-- an interval's slots are counted from its start). NULL: none, as every schedule before had.
-- Columns without a default: no row is rewritten.
ALTER TABLE schedules
    ADD COLUMN start_at timestamptz,
    ADD COLUMN end_at timestamptz,
    ADD CONSTRAINT schedules_dates_check CHECK (end_at > start_at);

-- 0004: reserved. Another change of this release adds its migration under this number;
-- 0005 (the console) follows it. Until it is merged this file keeps the numbers without a
-- gap (db.migrations insists) and does nothing; delete it when the real 0004 arrives.
SELECT 1;

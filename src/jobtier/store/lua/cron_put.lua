-- cron_put.lua: write a schedule's copy in Redis in one step (engine/cron.py CronMirror.put,
--   for the API's changes and the scheduler's reconcile): its definition, payload, paused
--   flag and revision, and unless kept its next slot and its place in the shard's due set;
--   the schedulers woken for that slot.
--   Not a transition: it neither includes lib.lua nor follows its KEYS[1]/ARGV[1] convention.
--   Why a script: written by a pipeline, a copy could land in part (its due set changed and
--   its hash not, the revision still the old row's), and nothing would mend it.
--
-- KEYS[1]  the copy, jt:{s}:cron:<id>
-- KEYS[2]  the shard's due set, jt:{s}:cron
-- ARGV[1]  schedule id
-- ARGV[2]  definition (JSON), ARGV[3] payload (JSON), ARGV[4] paused ('1' or '0'),
--          ARGV[5] revision (the Postgres row's)
-- ARGV[6]  next slot, ms ('' none; 'keep': as the copy has it, a firing may advance it)
-- ARGV[7]  the shard's wake channel
-- Returns  1

redis.call('HSET', KEYS[1], 'def', ARGV[2], 'payload', ARGV[3], 'paused', ARGV[4],
           'rev', ARGV[5])
local nxt = ARGV[6]
if nxt ~= 'keep' then
  redis.call('HSET', KEYS[1], 'next', nxt)
  if ARGV[4] == '1' or nxt == '' then
    redis.call('ZREM', KEYS[2], ARGV[1])
  else
    redis.call('ZADD', KEYS[2], nxt, ARGV[1])
    redis.call('SPUBLISH', ARGV[7], 'c ' .. nxt)
  end
end
return 1

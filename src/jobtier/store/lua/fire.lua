-- fire.lua: fire one recurring schedule: create the jobs of its due slots and advance it.
--
-- KEYS[1]  shard log stream (routing)
-- ARGV[1]  shard key base, jt:{s}:
-- ARGV[2]  schedule id
-- ARGV[3]  the next-fire time (ms) the caller read: the schedule advances only if it is
--          still that (compare-and-set), so two schedulers never both fire a slot
-- ARGV[4]  new next-fire time, ms (-1: the schedule has no further slot)
-- ARGV[5]  the slot to record as last fired, ms ('' when nothing fires: missed slots skipped)
-- ARGV[6]  tenant, ARGV[7] type, ARGV[8] priority, ARGV[9] payload, ARGV[10] max attempts,
--          ARGV[11] queue
-- ARGV[12] number of slots n, then 2 fields per slot: job id (derived from schedule and
--          slot), slot time ms (the job's run-at)
-- Returns  {code, jobs created, slots whose job already existed}
--            OK; VERSION_CONFLICT (another scheduler advanced it first); NOT_FOUND (deleted);
--            WRONG_STATE (paused)
-- A slot's job id is a function of (schedule, slot): even a replayed firing finds the job
-- there (EXISTS) and creates nothing.
--!include lib.lua

local id, expected = ARGV[2], ARGV[3]
local key = BASE .. 'cron:' .. id
local current = redis.call('HMGET', key, 'next', 'paused')
if not current[1] then
  return {NOT_FOUND, 0, 0}
end
if current[2] == '1' then
  return {WRONG_STATE, 0, 0}
end
if current[1] ~= expected then
  return {VERSION_CONFLICT, 0, 0}
end
local created, existed = 0, 0
local n = tonumber(ARGV[12])
for i = 0, n - 1 do
  local a = 13 + i * 2
  local job_id = ARGV[a]
  if redis.call('EXISTS', job_key(job_id)) == 1 then
    existed = existed + 1
  else
    create_job(job_id, ARGV[6], ARGV[7], ARGV[11], ARGV[8], ARGV[9], ARGV[10],
               tonumber(ARGV[a + 1]), '', 'scheduler', '', 1)
    created = created + 1
  end
end
local new_next = ARGV[4]
if ARGV[5] ~= '' then
  redis.call('HSET', key, 'last', ARGV[5])
end
if new_next == '-1' then
  redis.call('HSET', key, 'next', '')
  redis.call('ZREM', BASE .. 'cron', id)
else
  redis.call('HSET', key, 'next', new_next)
  redis.call('ZADD', BASE .. 'cron', new_next, id)
end
flush()
return {OK, created, existed}

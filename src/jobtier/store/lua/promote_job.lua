-- promote_job.lua: run a scheduled job now (scheduled -> queued): a delayed job before its
-- run-at, or one waiting out a retry's back-off. Its run-at becomes now; its attempts are
-- as they were (a retry's next attempt is the one it was waiting for).
--
-- KEYS[1]  shard log stream (routing)
-- ARGV[1]  shard key base, jt:{s}:
-- ARGV[2]  tenant asking ('' = any: admin); another tenant's job is NOT_FOUND
-- ARGV[3]  job id
-- Returns  {code, status document}: OK, NOT_FOUND, WRONG_STATE (not scheduled)
--!include lib.lua

local tenant, id = ARGV[2], ARGV[3]
local j = load(id)
if not j or (tenant ~= '' and j.tenant ~= tenant) then
  return {NOT_FOUND, ''}
end
if j.state ~= 'scheduled' then
  return {WRONG_STATE, (select(2, status_of(j._key)))}
end
redis.call('ZREM', BASE .. 'sched', id)
j.state = 'queued'
j.run_at = int(NOW)
local doc = commit(j, 'scheduled', 'api')
make_ready(j, false)
flush()
return {OK, doc}

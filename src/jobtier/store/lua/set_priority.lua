-- set_priority.lua: change the priority of a job not started yet (queued, scheduled,
-- waiting). A ready job moves to the back of its new priority's list (behind the jobs
-- already waiting there); a job held behind its concurrency key, parked, scheduled or
-- waiting for its dependencies keeps its place and is ready later at the new priority.
--
-- KEYS[1]  shard log stream (routing)
-- ARGV[1]  shard key base, jt:{s}:
-- ARGV[2]  tenant asking ('' = any: admin); another tenant's job is NOT_FOUND
-- ARGV[3]  job id
-- ARGV[4]  the priority (critical, high, normal, low: checked by the caller)
-- Returns  {code, status document}: OK (also when it had that priority: nothing changes),
--          NOT_FOUND, WRONG_STATE (running or finished)
--!include lib.lua

local tenant, id, prio = ARGV[2], ARGV[3], ARGV[4]
local j = load(id)
if not j or (tenant ~= '' and j.tenant ~= tenant) then
  return {NOT_FOUND, ''}
end
if not WAITING[j.state] or j.prio == prio then
  return {WAITING[j.state] and OK or WRONG_STATE, (select(2, status_of(j._key)))}
end
local ready = j.state == 'queued' and unready(j)
j.prio = prio
if ready then
  push_ready(j, false)
end
j._set = {'c', packed_c(j)}
local doc = commit(j, j.state, 'api')
flush()
return {OK, doc}

-- cancel.lua: cancel a job.
--   queued / scheduled / waiting -> cancelled (a waiting parent's children that have not
--                         started go with it: lib.lua flow_finished)
--   running            -> running with cancel_requested, and the worker holding the lease is
--                         told at once on the shard's wake channel ('x <job id> <worker id>');
--                         its next heartbeat tells it too, should the push be missed. The
--                         worker stops the task; a task that returned before the request
--                         reached the worker succeeds (worker/attempt.py states the rule)
-- A cancelled job's error is a Cancelled error, not an earlier attempt's (lib.lua).
--
-- KEYS[1]  shard log stream (routing)
-- ARGV[1]  shard key base, jt:{s}:
-- ARGV[2]  tenant asking ('' = any: admin); another tenant's job is NOT_FOUND
-- ARGV[3]  job id
-- ARGV[4]  retention of finished jobs, s
-- Returns  {code, status document}: OK (also when a cancel was already requested), NOT_FOUND,
--          WRONG_STATE (already finished)
--!include lib.lua

local tenant, id = ARGV[2], ARGV[3]
local j = load(id)
if not j or (tenant ~= '' and j.tenant ~= tenant) then
  return {NOT_FOUND, ''}
end
if j.state == 'running' then
  if j.cancel ~= '1' then
    j.cancel = '1'
    local doc = commit(j, 'running', 'api')
    -- the push: only the worker named here acts on it (worker/runner.py _on_wake)
    redis.call('SPUBLISH', BASE .. 'wake', 'x ' .. id .. ' ' .. j.worker)
    flush()
    return {OK, doc}
  end
  return {OK, (select(2, status_of(j._key)))}
elseif not WAITING[j.state] then
  return {WRONG_STATE, (select(2, status_of(j._key)))}
end
-- a waiting one (for its dependencies): finish cancels its unstarted children
local why = 'cancelled on request while ' .. j.state
local doc = cancel_unstarted(j, 'api', ARGV[4], error_json('Cancelled', why))
flush()
return {OK, doc}

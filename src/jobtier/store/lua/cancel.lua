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
local key = job_key(id)
local from = j.state
if from == 'queued' then
  remove_ready(j)
elseif from == 'scheduled' then
  redis.call('ZREM', BASE .. 'sched', id)
elseif from == 'waiting' then  -- for its dependencies (finish cancels its unstarted children)
  unwait(j)
elseif from == 'running' then
  if j.cancel ~= '1' then
    j.cancel = '1'
    local doc = commit(j, from, 'api')
    -- the push: only the worker named here acts on it (worker/runner.py _on_wake)
    redis.call('SPUBLISH', BASE .. 'wake', 'x ' .. id .. ' ' .. j.worker)
    flush()
    return {OK, doc}
  end
  return {OK, (select(2, status_of(key)))}
else
  return {WRONG_STATE, (select(2, status_of(key)))}
end
j.state = 'cancelled'
j.cancel = '1'
j.error = cancelled_error('cancelled on request while ' .. from)
local doc = commit(j, from, 'api')
finish(j, ARGV[4])
flush()
return {OK, doc}

-- batch_cancel.lua: cancel a batch's children in one shard, a slice of them per call.
--   queued / scheduled / waiting -> cancelled
--   running -> running with cancel requested (the worker is told, as cancel.lua does)
--   finished children are left as they are
--
-- KEYS[1]  shard log stream (routing)
-- ARGV[1]  shard key base, jt:{s}:
-- ARGV[2]  batch id
-- ARGV[3]  tenant ('' = any: admin); another tenant's child is left alone
-- ARGV[4]  first index in the shard's list of the batch's children (jt:{s}:bk:<batch>)
-- ARGV[5]  most children to look at
-- ARGV[6]  retention of finished jobs, s
-- Returns  {cancelled, cancel requested (running), children looked at}
--!include lib.lua

local bid, tenant, first, most, ttl = ARGV[2], ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5]),
  ARGV[6]
local ids = redis.call('LRANGE', BASE .. 'bk:' .. bid, first, first + most - 1)
local cancelled, requested = 0, 0
local why = error_json('Cancelled', 'cancelled with its batch ' .. bid)
for _, id in ipairs(ids) do
  local j = load(id)
  if j and (tenant == '' or j.tenant == tenant) then
    if WAITING[j.state] then
      cancel_unstarted(j, 'api', ttl, why)
      cancelled = cancelled + 1
    elseif j.state == 'running' and j.cancel ~= '1' then
      j.cancel = '1'
      commit(j, 'running', 'api')
      redis.call('SPUBLISH', BASE .. 'wake', 'x ' .. id .. ' ' .. j.worker)
      requested = requested + 1
    end
  end
end
flush()
return {cancelled, requested, #ids}

-- batch_cancel.lua: cancel children of a batch in one shard (the caller derives their ids
-- from the batch's: flows/batches.py child_ids).
--   queued / scheduled / waiting -> cancelled
--   running -> running with cancel requested (the worker is told, as cancel.lua does)
--   finished children are left as they are
--
-- KEYS[1]  shard log stream (routing)
-- ARGV[1]  shard key base, jt:{s}:
-- ARGV[2]  batch id
-- ARGV[3]  tenant ('' = any: admin); another tenant's child is left alone
-- ARGV[4]  retention of finished jobs, s
-- ARGV[5]  number of children n, then their ids
-- Returns  {cancelled, cancel requested (running)}
--!include lib.lua

local bid, tenant, ttl, n = ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5])
local cancelled, requested = 0, 0
local why = error_json('Cancelled', 'cancelled with its batch ' .. bid)
for i = 6, 5 + n do
  local id = ARGV[i]
  local j = load(id)
  if j and has_flag(j, 'b') and (tenant == '' or j.tenant == tenant) then
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
return {cancelled, requested}

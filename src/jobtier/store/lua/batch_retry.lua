-- batch_retry.lua: send a batch's failed children in one shard back to their queue
-- (failed -> queued, attempts reset, as replay.lua does), a slice of them per call.
--
-- KEYS[1]  shard log stream (routing)
-- ARGV[1]  shard key base, jt:{s}:
-- ARGV[2]  batch id
-- ARGV[3]  tenant ('' = any: admin); another tenant's child is left alone
-- ARGV[4]  first index in the shard's list of the batch's children (jt:{s}:bk:<batch>)
-- ARGV[5]  most children to look at
-- Returns  {children retried, children looked at}
--!include lib.lua

local bid, tenant, first, most = ARGV[2], ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
local ids = redis.call('LRANGE', BASE .. 'bk:' .. bid, first, first + most - 1)
local retried = 0
for _, id in ipairs(ids) do
  local j = load(id)
  if j and j.state == 'failed' and (tenant == '' or j.tenant == tenant) then
    redis.call('ZREM', BASE .. 'dead', id)
    redis.call('PERSIST', j._key)
    flow_revived(j)
    j.state = 'queued'
    j.attempt = '0'
    j.error = ''
    j.worker = ''
    commit(j, 'failed', 'api')
    make_ready(j, false)
    retried = retried + 1
  end
end
flush()
return {retried, #ids}

-- batch_retry.lua: send failed children of a batch in one shard back to their queue
-- (failed -> queued, attempts reset, as replay.lua does); the caller derives their ids from
-- the batch's (flows/batches.py child_ids).
--
-- KEYS[1]  shard log stream (routing)
-- ARGV[1]  shard key base, jt:{s}:
-- ARGV[2]  batch id
-- ARGV[3]  tenant ('' = any: admin); another tenant's child is left alone
-- ARGV[4]  number of children n, then their ids
-- Returns  {children retried}
--!include lib.lua

local tenant, n = ARGV[3], tonumber(ARGV[4])
local retried = 0
for i = 5, 4 + n do
  local id = ARGV[i]
  local j = load(id)
  if j and j.state == 'failed' and has_flag(j, 'b') and (tenant == '' or j.tenant == tenant) then
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
return {retried}

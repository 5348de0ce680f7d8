-- replay.lua: an operator sends a dead-lettered job back to its queue (failed -> queued),
-- with its attempts reset.
--
-- KEYS[1]  shard log stream (routing)
-- ARGV[1]  shard key base, jt:{s}:
-- ARGV[2]  tenant ('' = any: admin)
-- ARGV[3]  job id
-- Returns  {code, status document}: OK, NOT_FOUND, WRONG_STATE (not failed)
--!include lib.lua

local tenant, id = ARGV[2], ARGV[3]
local j = load(id)
if not j or (tenant ~= '' and j.tenant ~= tenant) then
  return {NOT_FOUND, ''}
end
if j.state ~= 'failed' then
  return {WRONG_STATE, (select(2, status_of(job_key(id))))}
end
redis.call('ZREM', BASE .. 'dead', id)
redis.call('PERSIST', job_key(id))
flow_revived(j)
j.state = 'queued'
j.attempt = '0'
j.error = ''
j.worker = ''
local doc = commit(j, 'failed', 'admin')
make_ready(j, false)
flush()
return {OK, doc}

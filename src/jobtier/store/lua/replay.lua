-- replay.lua: an operator sends a dead-lettered job back to its queue (failed -> queued),
-- with its attempts reset, and without the expiry it was submitted with (an operator's replay
-- means to run it: claim.lua would cancel it at once past that time).
--
-- KEYS[1]  shard log stream (routing)
-- ARGV[1]  shard key base, jt:{s}:
-- ARGV[2]  tenant ('' = any: admin)
-- ARGV[3]  job id
-- Returns  {code, status document}: OK, NOT_FOUND, WRONG_STATE (not failed); {EXISTS, id}:
--          its unique key (keyed.lua) is held by job `id`, which a replay must not run beside
--          (a replayed unique job takes its key back: its failure freed it)
--!include lib.lua

local tenant, id = ARGV[2], ARGV[3]
local j = load(id)
if not j or (tenant ~= '' and j.tenant ~= tenant) then
  return {NOT_FOUND, ''}
end
if j.state ~= 'failed' then
  return {WRONG_STATE, (select(2, status_of(job_key(id))))}
end
if string.find(j.wf, '[Uu]') then
  local uq = redis.call('HGET', j._key, 'uq')
  if uq then
    local holder = unique_holder(uq)
    if holder and holder.id ~= id then
      return {EXISTS, holder.id}
    end
    redis.call('SET', uq, id)
  end
end
redis.call('ZREM', BASE .. 'dead', id)
redis.call('PERSIST', job_key(id))
redis.call('HDEL', j._key, 'ex')
flow_revived(j)
j.state = 'queued'
j.attempt = '0'
j.error = ''
j.worker = ''
local doc = commit(j, 'failed', 'admin')
make_ready(j, false)
flush()
return {OK, doc}

-- link.lua: make jobs of this shard tell their new dependents (jobs of any shard that wait for
-- them) when they finish.
--
-- KEYS[1]  shard log stream (routing)
-- ARGV[1]  shard key base, jt:{s}:
-- ARGV[2]  the dependents' tenant: a job of another tenant counts as missing
-- ARGV[3]  number of links n, then 2 fields per link: dependency id (a job of this shard),
--          dependent id
-- Returns  per link: OK (linked; or it had already finished: handed off now), NOT_FOUND (no
--          such job of the tenant: handed off as missing, so the dependent learns it)
-- Idempotent (a set, and hand-offs the dependent applies once): the submitter links after it
-- created the dependent, and the resolver links again a dependent whose submitter did not say
-- it was done (linked.lua) by its deadline. A dependency that finishes before its dependent
-- is linked is handed off here, at the link: that order cannot lose it.
--!include lib.lua

local tenant, n = ARGV[2], tonumber(ARGV[3])
local out = {}
for i = 0, n - 1 do
  local a = 4 + i * 2
  local id, dependent = ARGV[a], ARGV[a + 1]
  local j = load(id)
  if not j or j.tenant ~= tenant then
    handoff('r', id, 'missing', '', dependent)
    out[#out + 1] = NOT_FOUND
  elseif TERMINAL[j.state] then
    local data = j.error
    if j.state == 'succeeded' then
      data = redis.call('HGET', job_key(id), 'result') or ''
    end
    handoff('r', id, j.state, data, dependent)
    out[#out + 1] = OK
  else
    redis.call('SADD', BASE .. 'dnt:' .. id, dependent)
    if not has_flag(j, 'd') then
      redis.call('HSET', job_key(id), 'wf', j.wf .. 'd')
      j.wf = j.wf .. 'd'
    end
    out[#out + 1] = OK
  end
end
flush()
return out

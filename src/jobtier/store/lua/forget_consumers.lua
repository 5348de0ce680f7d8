-- forget_consumers.lua: remove the members of the persisters' group that hold nothing and
--   have been idle for a while (persisters that stopped; a restart under a new name leaves
--   the old name behind).
--   Not a transition: it neither includes lib.lua nor follows its KEYS[1]/ARGV[1] convention.
--   Why a script: XGROUP DELCONSUMER drops the consumer's pending entries with it. Checked
--   and removed in one atomic step, a consumer that read entries between a client's XINFO
--   CONSUMERS and its DELCONSUMER cannot lose them (delivered, no longer pending: never
--   written, then trimmed). A live persister that holds nothing may be removed too, which
--   is harmless: its next XREADGROUP that delivers creates it again. (Redis 7.0 refreshes a
--   consumer's idle time only when a read delivers, so an idle live persister looks old.)
--
-- KEYS[1]  a shard's log stream (jt:{s}:log)
-- ARGV[1]  the persisters' consumer group
-- ARGV[2]  least idle time, ms, of a consumer removed
-- ARGV[3]  a consumer never removed (the caller)
-- Returns  the names of the consumers removed

local removed = {}
local ok, consumers = pcall(redis.call, 'XINFO', 'CONSUMERS', KEYS[1], ARGV[1])
if not ok then -- no stream or no group yet: nobody to forget
  return removed
end
local idle_ms = tonumber(ARGV[2])
for _, flat in ipairs(consumers) do
  local c = {}
  for i = 1, #flat, 2 do c[flat[i]] = flat[i + 1] end
  if c['name'] ~= ARGV[3] and c['pending'] == 0 and c['idle'] >= idle_ms then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], c['name'])
    removed[#removed + 1] = c['name']
  end
end
return removed

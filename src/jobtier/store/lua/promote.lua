-- promote.lua: move due scheduled jobs of one shard to their ready queues (scheduled -> queued).
--
-- KEYS[1]  shard log stream (routing)
-- ARGV[1]  shard key base, jt:{s}:
-- ARGV[2]  most jobs to promote in this call
-- Returns  {promoted, next run-at ms (-1: none left), now ms}
-- Safe with any number of schedulers: each due id is taken out of the set by exactly one call.
--!include lib.lua

local ids = redis.call('ZRANGEBYSCORE', BASE .. 'sched', '-inf', NOW, 'LIMIT', 0, tonumber(ARGV[2]))
local promoted = 0
for _, id in ipairs(ids) do
  redis.call('ZREM', BASE .. 'sched', id)
  local j = load(id)
  if j and j.state == 'scheduled' then
    j.state = 'queued'
    commit(j, 'scheduled', 'scheduler')
    make_ready(j, false)
    promoted = promoted + 1
  end
end
flush()
return {promoted, next_score('sched'), NOW}

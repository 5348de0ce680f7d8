-- upgrade.lua: move one shard's ready jobs from the layout before named queues into today's.
--   Before named queues, ready jobs waited in jt:{s}:q:<priority> (LPUSH new, RPOP oldest)
--   and a string jt:{s}:wrr held the priority rotation. This moves them, oldest first, into
--   their queue's ready lists (push_ready: the `default` queue, their tenant's list), so jobs
--   acknowledged by an older jobtier run after an upgrade. Schedulers run it when they start;
--   with nothing left it costs four RPOPs on missing keys.
--
-- KEYS[1]  shard log stream (routing)
-- ARGV[1]  shard key base, jt:{s}:
-- ARGV[2]  most jobs to move in this call
-- Returns  {jobs moved, jobs still in the old lists}
--!include lib.lua

local budget = tonumber(ARGV[2])
local moved, left = 0, 0
for _, p in ipairs(PRIORITIES) do
  local old = BASE .. 'q:' .. p
  if budget > moved then
    local ids = redis.call('RPOP', old, budget - moved) or {}
    for _, id in ipairs(ids) do
      local j = load(id)
      if j and j.state == 'queued' then
        push_ready(j, false)
        moved = moved + 1
      end
    end
  end
  left = left + redis.call('LLEN', old)
end
if left == 0 then
  redis.call('DEL', BASE .. 'wrr')
end
flush()
return {moved, left}

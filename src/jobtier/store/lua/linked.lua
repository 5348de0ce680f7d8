-- linked.lua: the submitter of dependents of this shard has linked every dependency of theirs
-- (link.lua): take them off the set the resolver reconciles, and mark the flow done.
--
-- KEYS[1]  shard log stream (routing)
-- ARGV[1]  shard key base, jt:{s}:
-- ARGV[2]  the flow's head job (the one its idempotency record names) if it lives in this
--          shard, else '': marked 'fd' (done), so a repeated submit with the key has nothing
--          left to finish
-- ARGV[3]  number of dependents n, then their ids
-- Returns  {dependents taken off the set}
--!include lib.lua

local head, n = ARGV[2], tonumber(ARGV[3])
local removed = 0
local ids = {}
for i = 1, n do
  ids[#ids + 1] = ARGV[3 + i]
  if #ids >= CHUNK then
    removed = removed + redis.call('ZREM', UNLINKED, unpack(ids))
    ids = {}
  end
end
if #ids > 0 then
  removed = removed + redis.call('ZREM', UNLINKED, unpack(ids))
end
if head ~= '' and redis.call('EXISTS', job_key(head)) == 1 then
  redis.call('HSET', job_key(head), 'fd', '1')
end
flush()
return {removed}

#!lua flags=no-writes
-- read_status.lua: the tenant and status document of many jobs in one call (read-only).
--   The status reader's batched load: one script call reads every job hash of a batch, where
--   a pipeline of HMGETs costs the client ~13 us of CPU per job (redis-py parses, allocates
--   and matches a reply object per command) against ~2 us per job here.
--   Not a transition: it neither includes lib.lua nor follows its KEYS[1]/ARGV[1] convention.
--   `no-writes` (the shebang line above): it declares that it only reads, so Redis refuses
--   any write in it and runs it wherever plain reads may run (a replica, a server that
--   refuses writes for lack of memory under noeviction).
--
-- KEYS[1..n]  job hashes (jt:{s}:job:<id>). On a Redis Cluster they must share one hash tag
--             (one call per shard); on a single server one call may span every shard.
-- ARGV        none
-- Returns     a flat array of 2n values: tenant, status document of each key in order;
--             nil, nil for a job Redis does not hold (or no longer holds).

local out = {}
for i = 1, #KEYS do
  local v = redis.call('HMGET', KEYS[i], 'tenant', 'doc')
  -- a missing field is false here, and false goes back to the client as nil
  out[2 * i - 1] = v[1]
  out[2 * i] = v[2]
end
return out

-- batch_seal.lua: the submit of a batch has added all its children to this shard: release
-- the hold it put on the shard's 'left' before the first of them (flows/batches.py), so that
-- children finishing while others were still being added could not end the shard's share.
--
-- KEYS[1]  shard log stream (routing)
-- ARGV[1]  shard key base, jt:{s}:
-- ARGV[2]  batch id
-- ARGV[3]  retention of finished jobs, s (the shard's batch keys then expire)
-- Returns  the shard's children not finished
--!include lib.lua

local bid, ttl = ARGV[2], ARGV[3]
local key = batch_key(bid)
local left = redis.call('HINCRBY', key, 'left', -1)
if left == 0 then
  batch_handoff(key, 'done', ttl)
end
flush()
return left

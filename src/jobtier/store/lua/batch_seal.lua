-- batch_seal.lua: the submit of a batch has added all its children to this shard: release
-- the hold it put on the shard's 'left' before the first of them (flows/batches.py), so that
-- children finishing while others were still being added could not end the shard's share.
-- A hold is released once: a cancel may have released it first (batch_cancel.lua).
--
-- KEYS[1]  shard log stream (routing)
-- ARGV[1]  shard key base, jt:{s}:
-- ARGV[2]  batch id
-- Returns  the shard's children not finished
--!include lib.lua

local key = batch_key(ARGV[2])
local left
if redis.call('HDEL', key, 'hold') == 1 then
  left = redis.call('HINCRBY', key, 'left', -1)
  if left == 0 then
    batch_handoff(key, 'done')
  end
else
  left = tonumber(redis.call('HGET', key, 'left') or '0')
end
flush()
return left

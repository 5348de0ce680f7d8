-- batch_expire.lua: a batch has finished (batch_done.lua): its counts in this shard now
-- expire, unless a retry has already brought one of its children back here.
--
-- KEYS[1]  shard log stream (routing)
-- ARGV[1]  shard key base, jt:{s}:
-- ARGV[2]  batch id
-- ARGV[3]  seconds they are kept (the dead-letter retention: its failed children's)
-- Returns  1 if they now expire, else 0
--!include lib.lua

local key = batch_key(ARGV[2])
if redis.call('HGET', key, 'left') == '0' and redis.call('HEXISTS', key, 'hold') == 0 then
  redis.call('EXPIRE', key, ARGV[3])
  return 1
end
return 0

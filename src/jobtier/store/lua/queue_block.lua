-- queue_block.lua: a queue's claims on one shard start nothing until now + ARGV[2] ms
--   (store/context.py, block_queue: a task raised RateLimited, or an HTTP worker held a job
--   with block_queue), unless a later end is set already.
--   Not a transition: it neither includes lib.lua nor follows its KEYS[1]/ARGV[1] convention.
--   Why a script: the end is taken from Redis's clock, as claim.lua's comparison with it,
--   not from a caller's host; and compared and written in one step, so of two blocks asked
--   at once the later end stands (a read then a write let a 1 s block shorten a 600 s one).
--
-- KEYS[1]  a shard's queue counts hash (jt:{s}:queues)
-- ARGV[1]  the queue's field in it ("<queue>:blocked")
-- ARGV[2]  milliseconds from now
-- Returns  the end of the queue's block on this shard, ms since the epoch

local t = redis.call('TIME')
local until_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[2])
local current = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0') or 0
if until_ms > current then
  redis.call('HSET', KEYS[1], ARGV[1], until_ms)
  return until_ms
end
return current

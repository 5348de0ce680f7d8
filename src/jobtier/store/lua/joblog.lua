-- joblog.lua: append tasks' log lines (ctx.log) to their jobs' line lists, keeping the latest.
-- Not a transition: the status document, its version and the transition log stay untouched,
-- so a chatty task costs the transition path nothing (and Postgres never sees the lines).
-- Lines are not fenced: a worker that lost its lease may still add the lines of its attempt,
-- each of which names its attempt.
--
-- KEYS[1]  shard log stream (routing only: nothing is appended to it)
-- ARGV[1]  shard key base, jt:{s}:
-- ARGV[2]  most lines a job keeps (its latest)
-- ARGV[3]  number of jobs n, then per job: id, ttl s (the lines expire with the job: the
--          retention of the state it is heading for), k, then k lines (JSON each)
-- Returns  n
--!include lib.lua

local keep, n = tonumber(ARGV[2]), tonumber(ARGV[3])
local a = 4
for _ = 1, n do
  local key = BASE .. 'lines:' .. ARGV[a]
  local ttl, k = ARGV[a + 1], tonumber(ARGV[a + 2])
  if k > 0 then
    redis.call('RPUSH', key, unpack(ARGV, a + 3, a + 2 + k))
    redis.call('LTRIM', key, -keep, -1)
    redis.call('EXPIRE', key, ttl)
  end
  a = a + 3 + k
end
return n

-- limit.lua: the permits of a limited queue (global concurrency, rate), kept in its home shard.
--
-- A queue's jobs live in every shard, so its limits cannot be checked by the claim script of
-- one shard: a worker first takes permits here, in the one shard the queue's name hashes to,
-- then claims at most that many jobs of the queue (claim.lua caps), gives back the permits it
-- did not use, and returns each used one when its job ends. A permit is leased like a job:
-- it expires at its deadline unless extended, so a worker that dies gives its permits back
-- when its jobs' leases expire. Not a transition: no job changes, nothing is logged.
--
-- KEYS[1]  shard log stream of the home shard (routing)
-- ARGV[1]  shard key base, jt:{h}:
-- ARGV[2]  operation: acquire | extend | release | block
-- ARGV[3]  queue name
--   acquire  ARGV[4] worker id, ARGV[5] permits wanted, ARGV[6] lease ms, ARGV[7] the
--            call's token (unique per call; '' or absent: none)
--            Returns {granted n, wait ms (-1: none; else when a rate token is next due or a
--                     block ends), then the n permit ids}
--            The permits granted under a token are kept under jt:{h}:pt:<token> (msgpack:
--            wait ms, then the ids) for a lease. The same token sent again (the client library
--            resends a call whose connection died before its reply; the worker sends an
--            unanswered acquire again at its next round) is answered with those of them still
--            held, not with more: permits its worker never heard of would hold the queue's
--            capacity until their lease ran out. When none is held any more, it is answered
--            afresh.
--   extend   ARGV[4] lease ms, then permit ids       Returns the number still held
--   release  ARGV[4] '1' if the permits were never used (they count as no start), then ids
--            Returns the number released
--   settle   after a claim: ARGV[4] number of used permits u, then u pairs (permit id, when
--            its job was claimed, ms); then the unused permit ids (released, no start)
--   block    ARGV[4] ms: no permit is granted before now + ms (a task said the downstream
--            asked us to wait: RateLimited)                          Returns the end, ms
--
-- jt:{h}:limit:<queue> (hash): 'concurrency' (most permits held at once; absent: none),
-- 'rate' and 'period' ms (most permits granted in any window of that length; absent: none),
-- 'blocked' (ms), 'seq' (permit ids).
-- jt:{h}:permits:<queue> (zset): permit id -> lease deadline, ms.
-- jt:{h}:starts:<queue> (zset): permit id -> when its job started, ms, for the last period: a
-- sliding log, so no window of `period` ever holds more than `rate` starts (a token bucket
-- would allow twice that across a refill). A permit just granted counts as starting at the
-- end of its lease until the worker says when its job was claimed (`settle`): another grant
-- must not see the window free before the start it holds has happened.
--!include lib.lua

local op, queue = ARGV[2], ARGV[3]
local conf_key = BASE .. 'limit:' .. queue
local permits = BASE .. 'permits:' .. queue
local starts = BASE .. 'starts:' .. queue

if op == 'acquire' then
  local worker, wanted, lease = ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6])
  local token_key = ARGV[7] and ARGV[7] ~= '' and BASE .. 'pt:' .. ARGV[7] or nil
  local kept = token_key and redis.call('GET', token_key)
  if kept then
    local was = cmsgpack.unpack(kept)
    local out = {0, was[1]}
    for i = 2, #was do
      local deadline = redis.call('ZSCORE', permits, was[i])
      if deadline and tonumber(deadline) > NOW then
        out[#out + 1] = was[i]
      end
    end
    out[1] = #out - 2
    if out[1] > 0 then
      return out
    end
    -- none of them is held any more (their lease ran out): its worker never used them, so
    -- the call is answered afresh
  end
  local conf = redis.call('HMGET', conf_key, 'concurrency', 'rate', 'period', 'blocked')
  local blocked = tonumber(conf[4]) or 0
  if blocked > NOW then
    return {0, blocked - NOW}
  end
  redis.call('ZREMRANGEBYSCORE', permits, '-inf', NOW)  -- their holders died
  local n = wanted
  local concurrency = tonumber(conf[1])
  if concurrency then
    n = math.min(n, concurrency - redis.call('ZCARD', permits))
  end
  local wait = -1
  local rate, period = tonumber(conf[2]), tonumber(conf[3])
  if rate and period then
    redis.call('ZREMRANGEBYSCORE', starts, '-inf', NOW - period)
    local room = rate - redis.call('ZCARD', starts)
    if room < n then
      n = room
      local oldest = redis.call('ZRANGE', starts, 0, 0, 'WITHSCORES')
      wait = oldest[2] and math.max(tonumber(oldest[2]) + period - NOW, 1) or 1
    end
  end
  if n <= 0 then
    return {0, wait}
  end
  local last = redis.call('HINCRBY', conf_key, 'seq', n)
  local out, leases, started = {n, wait}, {}, {}
  local deadline = NOW + lease
  for i = last - n + 1, last do
    local id = worker .. '|' .. i
    out[#out + 1] = id
    leases[#leases + 1], leases[#leases + 2] = deadline, id
    started[#started + 1], started[#started + 2] = deadline, id
  end
  redis.call('ZADD', permits, unpack(leases))
  if token_key then
    local was = {wait}
    for i = 3, #out do
      was[#was + 1] = out[i]
    end
    redis.call('SET', token_key, cmsgpack.pack(was), 'PX', lease)
  end
  if rate and period then
    redis.call('ZADD', starts, unpack(started))
    redis.call('PEXPIRE', starts, period + lease)
  end
  return out
elseif op == 'extend' then
  local deadline, held = NOW + tonumber(ARGV[4]), 0
  for i = 5, #ARGV do
    held = held + redis.call('ZADD', permits, 'XX', 'CH', deadline, ARGV[i])
  end
  return held
elseif op == 'release' then
  local ids = {}
  for i = 5, #ARGV do
    ids[#ids + 1] = ARGV[i]
  end
  local released = #ids > 0 and redis.call('ZREM', permits, unpack(ids)) or 0
  if ARGV[4] ~= '0' and #ids > 0 then  -- never used: they started nothing
    redis.call('ZREM', starts, unpack(ids))
  end
  -- capacity came free: workers waiting for this queue's permits may claim again
  redis.call('SPUBLISH', BASE .. 'wake', 'l ' .. queue)
  return released
elseif op == 'settle' then
  local used = tonumber(ARGV[4])
  for i = 0, used - 1 do
    redis.call('ZADD', starts, 'XX', ARGV[6 + 2 * i], ARGV[5 + 2 * i])
  end
  local unused = {}
  for i = 5 + 2 * used, #ARGV do
    unused[#unused + 1] = ARGV[i]
  end
  if #unused > 0 then
    redis.call('ZREM', permits, unpack(unused))
    redis.call('ZREM', starts, unpack(unused))
  end
  -- the window may open sooner than a waiting worker computed (its oldest start was only
  -- pending then), and unused permits are capacity back: let waiting workers look again
  redis.call('SPUBLISH', BASE .. 'wake', 'l ' .. queue)
  return used
elseif op == 'block' then
  local until_ms = NOW + tonumber(ARGV[4])
  local blocked = tonumber(redis.call('HGET', conf_key, 'blocked') or '0') or 0
  if until_ms > blocked then
    redis.call('HSET', conf_key, 'blocked', until_ms)
    blocked = until_ms
  end
  return blocked
end
return redis.error_reply('limit.lua: unknown operation ' .. tostring(op))

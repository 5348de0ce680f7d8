-- breaker.lua: a circuit breaker per downstream, kept in the shard its name hashes to.
--
-- Not a transition: no job changes, nothing is logged. Workers ask it before they start a
-- job of a breaker (admit) and tell it how the job's call to the downstream went (record);
-- the admin API opens and closes it by hand.
--
-- KEYS[1]  shard log stream of the home shard (routing)
-- ARGV[1]  shard key base, jt:{h}:
-- ARGV[2]  operation: admit | record | extend | open | close
-- ARGV[3]  breaker name
--   admit   ARGV[4..11] thresholds (below), ARGV[12] worker id, ARGV[13] probe lease ms,
--           ARGV[14] the job's task type (kept in 'types' when the job must wait)
--           Returns {verdict (1 run, 2 run as a probe, 0 wait), wait ms, state, probe id}
--   record  ARGV[4..11] thresholds, ARGV[12] outcome (f: the downstream failed, s: it
--           answered, n: neither, a probe given back), ARGV[13] probe id or '',
--           ARGV[14] the failure's text, ARGV[15] the job's task type
--                                          Returns {state, until ms[, 1 when it changed]}
--   extend  ARGV[4] probe id, ARGV[5] lease ms: a probe still running keeps its place
--           (its worker extends it as it heartbeats the job)   Returns 1, 0 when it is gone
--   open    ARGV[4] ms (0: until closed by hand), ARGV[5] reason  Returns {state, until ms}
--   close   ARGV[4] reason                                        Returns {state, until ms}
-- Thresholds: failures, window ms, ratio ('' none), min calls, open ms, back-off factor,
-- most open ms, probes (core/breaker.py Breaker.args).
--
-- jt:{h}:breaker:<name> (hash): 'state' closed|open|half_open, 'until' (ms: the open period's
-- end), 'trips' (opens since it last closed: the back-off's exponent), 'manual' ('1': opened
-- by hand, stays open until closed by hand), 'changed' (ms), 'reason', 'seq' (probe ids),
-- the thresholds it last saw ('conf'), and the task types that recorded ('types', each
-- between spaces: the explain answer finds a job's breaker by its type).
-- jt:{h}:bfail:<name>, jt:{h}:bok:<name> (zsets): the window's failures and successes (the
-- successes only with a ratio), member an id, score ms.
-- jt:{h}:bprobe:<name> (zset): half-open probes out, by lease deadline (a dead worker's
-- probe expires, so the breaker does not wait on it for ever).
-- jt:{h}:breakers (set): the breakers homed in this shard (the admin list).
--!include lib.lua

local op, name = ARGV[2], ARGV[3]
local key = BASE .. 'breaker:' .. name
local fails, oks = BASE .. 'bfail:' .. name, BASE .. 'bok:' .. name
local probes = BASE .. 'bprobe:' .. name

local function conf_of(i)
  return {
    failures = tonumber(ARGV[i]), window = tonumber(ARGV[i + 1]),
    ratio = tonumber(ARGV[i + 2]), min_calls = tonumber(ARGV[i + 3]),
    open = tonumber(ARGV[i + 4]), backoff = tonumber(ARGV[i + 5]),
    max_open = tonumber(ARGV[i + 6]), probes = tonumber(ARGV[i + 7]),
  }
end

local function conf_text(i)
  return table.concat({ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4],
                       ARGV[i + 5], ARGV[i + 6], ARGV[i + 7]}, ' ')
end

-- open for the period its trips call for: open * backoff ^ (trips - 1), at most max_open
local function trip(c, trips, reason)
  local period = math.min(c.open * c.backoff ^ (trips - 1), c.max_open)
  local until_ms = NOW + math.floor(period)
  redis.call('HSET', key, 'state', 'open', 'until', int(until_ms), 'trips', trips,
             'changed', NOW_STR, 'reason', reason, 'manual', '')
  redis.call('DEL', fails, oks, probes)
  redis.call('SADD', BASE .. 'breakers', name)
  return {'open', until_ms, 1}
end

-- the task type `t` among those of the breaker ('types'), once
local function add_type(t, types)
  types = types or redis.call('HGET', key, 'types') or ' '
  if t ~= '' and not string.find(types, ' ' .. t .. ' ', 1, true) then
    redis.call('HSET', key, 'types', types .. t .. ' ')
  end
end

local function close(reason)
  redis.call('HSET', key, 'state', 'closed', 'until', 0, 'trips', 0, 'changed', NOW_STR,
             'reason', reason, 'manual', '')
  redis.call('DEL', fails, oks, probes)
  return {'closed', 0, 1}
end

if op == 'admit' then
  local h = redis.call('HMGET', key, 'state', 'until', 'manual')
  local state = h[1]
  if not state or state == 'closed' then
    return {1, 0, 'closed', ''}  -- the common case writes nothing
  end
  local c = conf_of(4)
  if state == 'open' then
    local until_ms = tonumber(h[2]) or 0
    if h[3] == '1' then
      add_type(ARGV[14])
      return {0, c.open, 'open', ''}  -- opened by hand: look again after an open period
    end
    if until_ms > NOW then
      add_type(ARGV[14])
      return {0, until_ms - NOW, 'open', ''}
    end
    redis.call('HSET', key, 'state', 'half_open', 'changed', NOW_STR)
    redis.call('DEL', probes)
  end
  redis.call('ZREMRANGEBYSCORE', probes, '-inf', NOW)
  if redis.call('ZCARD', probes) < c.probes then
    local id = ARGV[12] .. '|' .. redis.call('HINCRBY', key, 'seq', 1)
    redis.call('ZADD', probes, NOW + tonumber(ARGV[13]), id)
    redis.call('PEXPIRE', probes, tonumber(ARGV[13]))
    return {2, 0, 'half_open', id}
  end
  -- the probes are out: the others wait an open period, by when the probes have answered
  add_type(ARGV[14])
  return {0, c.open, 'half_open', ''}
elseif op == 'record' then
  local c = conf_of(4)
  local outcome, probe = ARGV[12], ARGV[13]
  redis.call('SADD', BASE .. 'breakers', name)
  local h = redis.call('HMGET', key, 'state', 'until', 'trips', 'conf', 'types')
  local state = h[1] or 'closed'
  local conf = conf_text(4)
  if h[4] ~= conf then
    redis.call('HSET', key, 'conf', conf)
  end
  add_type(ARGV[15], h[5] or ' ')
  if not h[1] then
    redis.call('HSET', key, 'state', 'closed', 'until', 0, 'trips', 0, 'changed', NOW_STR)
  end
  local was_probe = probe ~= '' and redis.call('ZREM', probes, probe) == 1
  if outcome == 'n' then
    return {state, tonumber(h[2]) or 0}
  end
  if state == 'half_open' then
    if outcome == 's' and was_probe then
      return close('a probe succeeded')
    elseif outcome == 'f' then
      -- a probe (or a job that started before the breaker opened) failed: open again, longer
      return trip(c, (tonumber(h[3]) or 0) + 1, ARGV[14])
    end
    return {state, tonumber(h[2]) or 0}
  end
  if state ~= 'closed' then
    return {state, tonumber(h[2]) or 0}  -- open: a job that started before it opened
  end
  local from = NOW - c.window
  if outcome ~= 'f' then
    -- successes count only toward a ratio; trimmed here too, or steady traffic with no
    -- failure would grow the set for ever (its expiry is pushed back by every success)
    if c.ratio then
      redis.call('ZADD', oks, NOW, redis.call('HINCRBY', key, 'seq', 1))
      redis.call('ZREMRANGEBYSCORE', oks, '-inf', from)
      redis.call('PEXPIRE', oks, c.window)
    end
    return {'closed', 0}
  end
  redis.call('ZADD', fails, NOW, redis.call('HINCRBY', key, 'seq', 1))
  redis.call('ZREMRANGEBYSCORE', fails, '-inf', from)
  redis.call('PEXPIRE', fails, c.window)
  local failed = redis.call('ZCARD', fails)
  local opens
  if c.ratio then
    redis.call('ZREMRANGEBYSCORE', oks, '-inf', from)
    local total = failed + redis.call('ZCARD', oks)
    opens = total >= c.min_calls and failed >= c.ratio * total
  else
    opens = failed >= c.failures
  end
  if opens then
    return trip(c, 1, ARGV[14])
  end
  return {'closed', 0}
elseif op == 'extend' then
  local lease = tonumber(ARGV[5])
  -- a probe already answered, or expired and dropped, is not brought back
  if not redis.call('ZSCORE', probes, ARGV[4]) then
    return 0
  end
  redis.call('ZADD', probes, NOW + lease, ARGV[4])
  if redis.call('PTTL', probes) < lease then
    redis.call('PEXPIRE', probes, lease)
  end
  return 1
elseif op == 'open' then
  local ms = tonumber(ARGV[4])
  local until_ms = ms > 0 and NOW + ms or 0
  redis.call('HSET', key, 'state', 'open', 'until', int(until_ms), 'changed', NOW_STR,
             'reason', ARGV[5], 'manual', ms > 0 and '' or '1')
  redis.call('HSETNX', key, 'trips', 0)
  redis.call('DEL', fails, oks, probes)
  redis.call('SADD', BASE .. 'breakers', name)
  return {'open', until_ms}
elseif op == 'close' then
  redis.call('SADD', BASE .. 'breakers', name)
  return close(ARGV[4])
end
return redis.error_reply('breaker.lua: unknown operation ' .. tostring(op))

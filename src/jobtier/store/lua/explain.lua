-- explain.lua: why a job has not started, read from the keys claim.lua and limit.lua read, by
-- their rules (read-only: registered with the no-writes flag and run by FCALL_RO).
--
-- KEYS[1]  shard log stream (routing)
-- ARGV[1]  shard key base, jt:{s}:
-- ARGV[2]  'job': the job's own shard; ARGV[3] job id, ARGV[4] most ids listed (dependencies,
--          holders of its concurrency key), ARGV[5] most tenants read, ARGV[6] most jobs
--          read to find its key's holders (running jobs of the shard, ready jobs of its
--          tenant), ARGV[7] most entries LPOS reads from each end of a line to find the job
--          'limit': a limited queue's home shard (limit.lua); ARGV[3] the queue
-- Returns  a JSON object. 'job': now (ms); nothing more for a job Redis does not hold; else
--          tenant, state, queue, type, prio, attempt, worker, run_at (ms, 0: none), expires (its
--          expiry, ms, 0: none: claim.lua); for a job
--          not started: paused, limited, blocked (ms, 0: none) of its queue in this shard, and
--          where it waits:
--            'ready'  in its ready list: own (its tenant's older jobs, taken first), others
--                     (other tenants' jobs the tenants' turns take first), tenants (in the
--                     turn ring), by_priority (jobs taken before it from each priority, with
--                     those two), parked (handed-back jobs of its type, taken first), ahead
--                     (own, others and ahead are lower bounds when at_least is set: the job
--                     is deeper in its line than ARGV[7] from either end)
--            'parked' handed back by a worker without its type: ahead (parked before it)
--            'key'    held behind its concurrency key: key, admitted (ready or running under
--                     it), limit, ahead (held before it), holders ({id, state} found)
--            'scheduled' (run_at), 'waiting' (dependencies: total, pending, failed, pending_ids
--                     in their order), 'unknown' (queued, yet in none of those lists)
--          'limit': now, concurrency, rate, period (ms; absent: no such limit), blocked (ms),
--          held (permits held now), started (starts in the last period), next_start (ms: when
--          the oldest of them leaves the window)
--!include lib.lua

local ROTATION = {1, 2, 1, 3, 1, 2, 1, 4, 1, 2, 1, 3, 1, 2, 1}  -- claim.lua's
local SHARE = {8, 4, 2, 1}  -- turns of each priority in the 15 of ROTATION
local what = ARGV[2]

if what == 'limit' then
  -- limit.lua acquire: permits whose lease ended and starts older than the period no longer
  -- count (it deletes them first; here they are left out of the counts)
  local q = ARGV[3]
  local starts = BASE .. 'starts:' .. q
  local conf = redis.call('HMGET', BASE .. 'limit:' .. q, 'concurrency', 'rate', 'period', 'blocked')
  local out = {now = NOW, concurrency = tonumber(conf[1]), rate = tonumber(conf[2]),
               period = tonumber(conf[3]), blocked = tonumber(conf[4]) or 0}
  out.held = redis.call('ZCOUNT', BASE .. 'permits:' .. q, '(' .. NOW_STR, '+inf')
  if out.rate and out.period then
    local since = '(' .. int(NOW - out.period)
    out.started = redis.call('ZCOUNT', starts, since, '+inf')
    local oldest = redis.call('ZRANGEBYSCORE', starts, since, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
    if oldest[2] then
      out.next_start = tonumber(oldest[2]) + out.period
    end
  end
  return cjson.encode(out)
end

local BOUND = tonumber(ARGV[7])

-- the place of `id` in the list `key` counted from its tail, where RPOP takes the oldest: how
-- many leave the list before it; nil when it is not within BOUND of either end. A scan of a
-- whole line would hold Redis's one thread for as long as the line is: LPOS reads at most
-- BOUND entries from the tail (the oldest) and BOUND from the head (the newest).
local function from_tail(key, id)
  local i = redis.call('LPOS', key, id, 'RANK', -1, 'MAXLEN', BOUND)
    or redis.call('LPOS', key, id, 'MAXLEN', BOUND)
  if not i then
    return nil
  end
  return redis.call('LLEN', key) - 1 - i
end

-- whether `key` has entries neither end's LPOS reads: a job not found may be there, with at
-- least BOUND jobs before it
local function deep(key)
  return redis.call('LLEN', key) > 2 * BOUND
end

-- The claims taken before a job of priority p that has `ahead` jobs of p before it, as
-- claim.lua turns its cursor: each claim the rotation's priority, or the highest non-empty one
-- when that one is empty. `lens`: the ready jobs of each priority (its own counted). Whole
-- rounds of 15, in which no priority empties and the job is not reached, are counted at once.
local function turns_before(lens, p, ahead, cursor)
  local before, by = 0, {0, 0, 0, 0}
  while true do
    local use, highest, spare = {0, 0, 0, 0}, nil, 0
    for k = 1, 4 do
      if lens[k] > 0 then
        use[k] = SHARE[k]
        highest = highest or k
      else
        spare = spare + SHARE[k]
      end
    end
    use[highest] = use[highest] + spare
    local rounds = math.floor(ahead / use[p])
    for k = 1, 4 do
      if k ~= p and use[k] > 0 then
        rounds = math.min(rounds, math.floor(lens[k] / use[k]))
      end
    end
    for k = 1, 4 do
      local n = rounds * use[k]
      lens[k], by[k], before = lens[k] - n, by[k] + n, before + n
    end
    ahead = ahead - rounds * use[p]
    -- then one claim
    local pick = ROTATION[cursor % 15 + 1]
    cursor = cursor + 1
    if lens[pick] == 0 then
      for k = 1, 4 do
        if lens[k] > 0 then
          pick = k
          break
        end
      end
    end
    if pick == p then
      if ahead == 0 then
        return before, by
      end
      ahead = ahead - 1
    end
    lens[pick], by[pick], before = lens[pick] - 1, by[pick] + 1, before + 1
  end
end

local function key_of(c)
  local _, _, _, _, _, key = string.match(c or '', C_PATTERN)
  return key
end

local id, most, scanned, reads = ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local j = load(id, 'ex')
if not j then
  return cjson.encode({now = NOW})
end
local out = {now = NOW, tenant = j.tenant, state = j.state, queue = j.queue, type = j.type,
             prio = j.prio, attempt = tonumber(j.attempt), worker = j.worker,
             run_at = tonumber(j.run_at) or 0, expires = tonumber(j.more) or 0}
if not WAITING[j.state] then
  return cjson.encode(out)
end
local q = j.queue
local v = redis.call('HMGET', QUEUES, q .. ':paused', q .. ':limited', q .. ':blocked', q .. ':wrr',
                     q .. ':critical', q .. ':high', q .. ':normal', q .. ':low')
out.paused, out.limited, out.blocked = v[1] == '1', v[2] == '1', tonumber(v[3]) or 0

if j.state == 'scheduled' then
  out.where = 'scheduled'
  return cjson.encode(out)
end
if j.state == 'waiting' then
  out.where = 'waiting'
  local d = redis.call('HMGET', j._key, 'dn', 'dpend', 'dfail', 'dids')
  out.total, out.pending, out.failed = tonumber(d[1]) or 0, tonumber(d[2]) or 0, tonumber(d[3]) or 0
  local marks = redis.call('HGETALL', BASE .. 'deps:' .. id)
  local pending = {}
  for k = 1, #marks, 2 do
    if marks[k + 1] == '0' or marks[k + 1] == '1' then
      pending[marks[k]] = true
    end
  end
  local ids = {}
  for dep in string.gmatch(d[4] or '', '%S+') do
    if #ids >= most then
      break
    end
    if pending[dep] then
      ids[#ids + 1] = dep
    end
  end
  if #ids > 0 then
    out.pending_ids = ids
  end
  return cjson.encode(out)
end

-- queued: in its ready list, parked, or held behind its concurrency key
local function in_ready(own, at_least)
  out.where, out.at_least = 'ready', at_least
  -- tenants take turns (lib.lua pop_ready), one job each a turn in the ring's order: a tenant
  -- before this one in the ring has a job taken in each of the own + 1 turns up to this job's,
  -- a tenant after it in the own turns before
  local ring = ring_key(q, j.prio)
  local others, passed = 0, false
  for _, t in ipairs(redis.call('LRANGE', ring, 0, scanned - 1)) do
    if t == j.tenant then
      passed = true
    else
      local n = redis.call('LLEN', ready_list(q, j.prio, t))
      others = others + math.min(n, passed and own or own + 1)
    end
  end
  out.own, out.others, out.tenants = own, others, redis.call('LLEN', ring)
  local p = 3
  for k, name in ipairs(PRIORITIES) do
    if name == j.prio then
      p = k
    end
  end
  local lens = {}
  for k = 1, 4 do
    lens[k] = math.max(tonumber(v[4 + k] or '0') or 0, 0)
  end
  lens[p] = math.max(lens[p], own + others + 1)
  local before, by = turns_before(lens, p, own + others, tonumber(v[4] or '0') or 0)
  -- claim.lua takes the parked jobs a worker can run before any ready one
  out.parked = tonumber(redis.call('HGET', PARKED, q .. ':' .. j.type) or '0') or 0
  out.by_priority, out.ahead = by, before + out.parked
  return cjson.encode(out)
end

local function behind_key(ck, own, at_least)
  out.where, out.key, out.ahead, out.at_least = 'key', j.ckey, own, at_least
  local c = redis.call('HMGET', CKEYS, ck, ck .. ':limit')
  out.admitted, out.limit = tonumber(c[1] or '0') or 0, tonumber(c[2] or '1') or 1
  -- who holds its places: running jobs of the shard and its tenant's ready jobs of its queue
  -- with the same key (a key's jobs live in one shard: engine/produce.py); at most `reads`
  -- jobs read in all, each an HMGET
  local holders, left = {}, reads
  local function hold(hid, state)
    if #holders < most and left > 0 then
      left = left - 1
      local h = redis.call('HMGET', job_key(hid), 'tenant', 'c')
      if h[1] == j.tenant and key_of(h[2]) == j.ckey then
        holders[#holders + 1] = {hid, state}
      end
    end
  end
  for _, hid in ipairs(redis.call('ZRANGE', BASE .. 'active', 0, reads - 1)) do
    hold(hid, 'running')
  end
  for _, prio in ipairs(PRIORITIES) do
    if left > 0 then
      for _, hid in ipairs(redis.call('LRANGE', ready_list(q, prio, j.tenant), 0, left - 1)) do
        hold(hid, 'queued')
      end
    end
  end
  if #holders > 0 then
    out.holders = holders
  end
  return cjson.encode(out)
end

local ready = ready_list(q, j.prio, j.tenant)
local own = from_tail(ready, id)
if own then
  return in_ready(own, false)
end
local park = BASE .. 'park:' .. q .. ':' .. j.type
own = from_tail(park, id)
if own then
  out.where, out.ahead, out.at_least = 'parked', own, false
  return cjson.encode(out)
end
local ck = j.ckey ~= '' and ck_name(j) or nil
if ck then
  own = from_tail(BASE .. 'ck:' .. ck, id)
  if own then
    return behind_key(ck, own, false)
  end
end
-- at neither end of any of its lines: in the middle of a long one, BOUND or more from its tail
if deep(ready) then
  return in_ready(BOUND, true)
end
if deep(park) then
  out.where, out.ahead, out.at_least = 'parked', BOUND, true
  return cjson.encode(out)
end
if ck and deep(BASE .. 'ck:' .. ck) then
  return behind_key(ck, BOUND, true)
end
out.where = 'unknown'
return cjson.encode(out)

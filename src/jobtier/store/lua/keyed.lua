-- keyed.lua: submit one job under a debounce, throttle or unique key
-- (docs/debounce-throttle.md).
-- The job's id names the key's shard (engine/produce.py routes it), so the key and the job
-- it governs are one slot: the decision and the job's creation or change are one atomic step.
--
-- KEYS[1]  shard log stream (routing)
-- ARGV[1]  shard key base, jt:{s}:
-- ARGV[2]  the submit's W3C traceparent ('' none)
-- ARGV[3]  id, ARGV[4] tenant, ARGV[5] type, ARGV[6] queue, ARGV[7] priority,
-- ARGV[8]  payload (JSON), ARGV[9] max_attempts
-- ARGV[10] kind: 'debounce' | 'throttle' | 'unique'
-- ARGV[11] key, as given (the key names below scope it to the tenant, and a debounce key to
--          the queue and type too)
--   unique    ARGV[12] '1': the job it makes holds the key until it finishes, '0': while it
--             waits to run; ARGV[13] run-at ms, ARGV[14] delay ms (0: none; as submit.lua's)
-- ARGV[#ARGV] (last, for every kind) the job's flow part, as submit.lua's (lib.lua
--          flow_create: a keyed job has no dependencies, but may have a compensation); ''
--          none
--   debounce  ARGV[12] quiet period ms, ARGV[13] most total delay ms (0: none)
--   throttle  ARGV[12] limit, ARGV[13] period ms, ARGV[14] 'refuse' | 'delay',
--             ARGV[15] the furthest a 'delay' may put the job, ms (further: refused),
--             ARGV[16] idempotency key ('' none), ARGV[17] request hash, ARGV[18] the
--             record's lifetime, ms (as submit.lua's; the record lives in this shard)
-- Returns  {outcome, job id, status document, ms}
--   created   a new job (ms: when it runs; a throttle's 'delay' may put it later than now)
--   replaced  debounce: the key's pending job took this payload and its wait restarted (the
--             job id is that job's, not ARGV[3]); ms: when it now runs
--   refused   throttle 'refuse', or 'delay' past ARGV[15]: no job made, '' doc; ms: how long
--             until a slot is free (for 'delay': until one is within ARGV[15])
--   duplicate throttle: the idempotency key was used by the same request: that job, its doc
--             (no slot taken)
--   conflict  throttle: the idempotency key was used by another request: that job's id, ''
--   existing  unique: a job holds the key (by its own mode: lib.lua unique_holder), so no job
--             was made: that job, its doc, unchanged
--
-- jt:{s}:db:<tenant>:<queue>:<type> <key> (hash; a type has no space, nor has a key): 'id'
-- the pending job, 'first' when its first submit came (ms: max_wait counts from it). It outlives the job's due time, never less:
-- an early expiry would let a second job in while the first still waits.
-- jt:{s}:th:<tenant>:<key> (zset): job id -> the time its slot starts (ms), the slots of the
-- last period and of the future (delayed jobs). Slots are handed out in time order, so no
-- window of `period` ever holds more than `limit` of them.
-- jt:{s}:uq:<tenant>:<key> (string): the key's job, the latest made. The job carries the
-- record's name ('uq') and its mode in its flags ('U' until it finishes, 'u' while it waits),
-- and lib.lua's finish deletes the record when that job ends (if it still names it): no
-- expiry, which could let a second job in while the first still waits. A replayed job takes
-- its key back (replay.lua).
--!include lib.lua

local trace = ARGV[2]
local id, tenant, typ, queue, prio = ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7]
local payload, max_attempts = ARGV[8], ARGV[9]
local kind, key = ARGV[10], ARGV[11]
local flow = ARGV[#ARGV]

local function create(due, idem)
  local doc = create_job(id, tenant, typ, queue, prio, payload, max_attempts, due, idem or '',
                         'api', '', 1, flow, trace)
  return doc
end

if kind == 'debounce' then
  local quiet, max_wait = tonumber(ARGV[12]), tonumber(ARGV[13])
  local db = BASE .. 'db:' .. tenant .. ':' .. queue .. ':' .. typ .. ' ' .. key
  local rec = redis.call('HMGET', db, 'id', 'first')
  local j = rec[1] and load(rec[1])
  -- pending: scheduled and never claimed (a scheduled retry has run: its payload is spent).
  -- Its lease version, not its attempt: a refunded attempt (RateLimited, BreakerOpen) is
  -- given back, yet the task may have run part-way (and saved a checkpoint) on that payload
  if j and j.state == 'scheduled' and j.lease_version == '0' then
    local first = tonumber(rec[2]) or NOW
    local due = NOW + quiet
    if max_wait > 0 then
      due = math.min(due, first + max_wait)
    end
    -- the last submit wins: its priority and attempts as well as its payload
    j.prio, j.max_attempts = prio, max_attempts
    j._set = {'c', packed_c(j), 'payload', payload}
    local extra = {'p', payload}
    j.run_at = int(due)
    if due <= NOW then  -- max_wait is spent: it runs now, and the key is free again
      redis.call('ZREM', BASE .. 'sched', j.id)
      redis.call('DEL', db)
      j.state = 'queued'
      local doc = commit(j, 'scheduled', 'api', extra)
      make_ready(j, false)
      flush()
      return {'replaced', j.id, doc, due}
    end
    local doc = commit(j, 'scheduled', 'api', extra)
    add_timed('sched', j, due)
    redis.call('PEXPIRE', db, due - NOW + quiet)
    flush()
    return {'replaced', j.id, doc, due}
  end
  -- no pending job of the key (none yet, or it started, ended or was cancelled): a new one
  local due = NOW + quiet
  local doc = create(due)
  redis.call('DEL', db)
  redis.call('HSET', db, 'id', id, 'first', NOW)
  redis.call('PEXPIRE', db, quiet + quiet)
  flush()
  return {'created', id, doc, due}
elseif kind == 'throttle' then
  local limit, period, mode, furthest = tonumber(ARGV[12]), tonumber(ARGV[13]), ARGV[14],
    tonumber(ARGV[15])
  local th = BASE .. 'th:' .. tenant .. ':' .. key
  local idem, hash = ARGV[16], ARGV[17]
  local idem_key
  if idem ~= '' then  -- a repeat takes no slot, as a refused submit takes none
    idem_key = BASE .. 'idem:' .. tenant .. ':' .. idem
    local rec = redis.call('GET', idem_key)
    if rec then
      local sp = string.find(rec, ' ', 1, true)
      local old_id, old_hash = string.sub(rec, 1, sp - 1), string.sub(rec, sp + 1)
      if old_hash ~= hash then
        return {'conflict', old_id, '', 0}
      end
      local _, doc = status_of(job_key(old_id))
      return {'duplicate', old_id, doc or '', 0}
    end
  end
  redis.call('ZREMRANGEBYSCORE', th, '-inf', NOW - period)
  local slot = NOW
  if redis.call('ZCARD', th) >= limit then
    -- the limit-th newest slot: a window of `period` after it holds limit - 1 slots at most
    local nth = redis.call('ZRANGE', th, -limit, -limit, 'WITHSCORES')
    slot = math.max(NOW, tonumber(nth[2]) + period)
  end
  if slot > NOW and mode ~= 'delay' then
    return {'refused', id, '', slot - NOW}
  end
  if slot - NOW > furthest then  -- a 'delay' may ask again once its slot comes near enough
    return {'refused', id, '', slot - NOW - furthest}
  end
  local doc = create(slot > NOW and slot or '', idem)
  if idem_key then
    redis.call('SET', idem_key, id .. ' ' .. hash, 'PX', ARGV[18])
  end
  redis.call('ZADD', th, slot, id)
  redis.call('PEXPIRE', th, slot - NOW + period)
  flush()
  return {'created', id, doc, slot}
elseif kind == 'unique' then
  local mode = ARGV[12] == '1' and 'U' or 'u'
  local uq = BASE .. 'uq:' .. tenant .. ':' .. key
  local j = unique_holder(uq)
  if j then
    local _, doc = status_of(j._key)
    return {'existing', j.id, doc or '', 0}
  end
  local due = due_of(tonumber(ARGV[13]), tonumber(ARGV[14]))
  NEW_FIELDS = {'uq', uq}
  local doc = create(due)
  NEW_FIELDS = nil
  -- its mode beside the flags flow_create may have given it (a compensation's 'c')
  local made = job_key(id)
  redis.call('HSET', made, 'wf', (redis.call('HGET', made, 'wf') or '') .. mode)
  redis.call('SET', uq, id)
  flush()
  return {'created', id, doc, due == '' and NOW or due}
end
return redis.error_reply('keyed.lua: unknown kind ' .. tostring(kind))

-- reconcile.lua: put back jobs Redis lost and Postgres kept (persist/reconcile.py).
-- After a failover to a replica that lacked the primary's last writes, a job may be absent
-- from Redis, or present at an older version, while Postgres already holds its later
-- transitions. Each job given is written back as Postgres has it, at Postgres's version,
-- only if Redis still lacks it or holds an older version (never a regression: a job Redis has
-- at that version or later, persisted or not, is left alone):
--   queued / scheduled / waiting  back where a submit puts it (its ready list, the
--                                 scheduled set; a waiting job is relinked by the resolver)
--   running                       when Redis holds it running under the same lease (same
--                                 worker, attempt and claim): moved forward where it is (its
--                                 version, progress, error, cancel request), lease and
--                                 deadline kept: only a heartbeat's write was lost and the
--                                 worker still runs it, its next write accepted. Otherwise
--                                 back to the front of its queue (or cancelled, when a cancel
--                                 was requested), attempts kept: the worker that held it
--                                 lost its lease with the lost write (at-least-once)
--   succeeded / failed / cancelled its final state, result (or result reference) and
--                                 expiry; its dependents are handed the outcome again
--                                 (resolve.lua applies a dependency once) and a batch's
--                                 counts move, as finish() does
-- The restored version is one Postgres holds: it is published (the status tier's near caches
-- take it) but not logged, and its 'lv' is that version, so the job's next logged entry
-- links to it (history_gaps). A running job's move back to its queue is a transition of its
-- own (version + 1, logged as released: 'rl', not an attempt's failure).
--
-- KEYS[1]  shard log stream (routing)
-- ARGV[1]  shard key base, jt:{s}:
-- ARGV[2]  number of jobs n, then 25 fields per job:
--            id, tenant, type, priority, max_attempts, created_at (ISO, as its document),
--            queue, state, version, attempt, updated ms, run_at ms ('' none), cancel
--            requested (0/1), worker ('' none), error JSON ('' none), progress JSON ('' none),
--            payload JSON, idempotency key ('' none), result ('' none; '@<ref>' kept in the
--            result store), seconds a finished job stays, then the ids it waits for and
--            their kinds (a waiting job: space-separated ids, one '0'/'1' per id; '' none)
--            then the ids of its dependents ('' none) and last, for a running job, the
--            version of its latest claim in Postgres's history (its lease version; '' none);
--            then its idempotency record, '<request hash> <ms left>' ('' none: no key, its
--            time is up, or its hash cannot be made again), put back when Redis lost the job
--            whole and has no record under its key (a submit retried with the key, the
--            remedy for a failover, then answers this job rather than making another)
-- Returns  per job: its outcome ('restored' absent before, 'advanced' older before,
--            'requeued' running in Postgres and not under Redis's lease, 'skipped' Redis
--            already as new), what Redis
--            held ('' absent, else '<state> <version>'), what it holds now
--            ('<state> <version>')
-- The concurrency key of a job Redis lost whole is not in Postgres: it comes back without one.
--!include lib.lua

local n = tonumber(ARGV[2])
local WIDTH = 25
local RELEASED = {'rl', '1'}
local out = {}

-- the job hash gets ``fields`` and j's error and progress (each removed when empty)
local function write_fields(j, fields)
  local gone = {}
  for _, field in ipairs({'error', 'progress'}) do
    if j[field] ~= '' then
      fields[#fields + 1], fields[#fields + 2] = field, j[field]
    else
      gone[#gone + 1] = field
    end
  end
  redis.call('HSET', j._key, unpack(fields))
  if #gone > 0 then
    redis.call('HDEL', j._key, unpack(gone))
  end
end

-- j (Redis's older copy) leaves wherever its state keeps it, with its counts
local function take_out(j)
  local state = j.state
  if state == 'queued' then
    remove_ready(j)
  elseif state == 'scheduled' then
    redis.call('ZREM', BASE .. 'sched', j.id)
  elseif state == 'waiting' then
    unwait(j)
  elseif state == 'running' then
    redis.call('ZREM', BASE .. 'active', j.id)
    count(QUEUES, j.queue .. ':running', -1)
    ck_release(j)
  elseif state == 'failed' then
    redis.call('ZREM', BASE .. 'dead', j.id)
  end
  if WAITING[state] then
    count(WAITING_COUNTS, j.tenant, -1)
  end
end

local function with_flag(wf, flag)
  if string.find(wf, flag, 1, true) then
    return wf
  end
  return wf .. flag
end

-- a waiting job Redis lost whole: its dependencies as pending, for the resolver to link
-- again (link.lua hands off at once those that finished)
local function restore_deps(j, ids, kinds)
  local fields, k = {}, 0
  for dep in string.gmatch(ids, '%S+') do
    k = k + 1
    fields[#fields + 1] = dep
    fields[#fields + 1] = string.sub(kinds, k, k) == '1' and '1' or '0'
  end
  if k == 0 then
    return
  end
  redis.call('DEL', BASE .. 'deps:' .. j.id)
  chunked('HSET', BASE .. 'deps:' .. j.id, fields)
  j.dd = deps_doc(k, k, 0)
  redis.call('HSET', j._key, 'dd', j.dd, 'dids', ids, 'dn', k, 'dpend', k, 'dfail', 0)
  j.wf = with_flag(j.wf, 'w')
end

-- Redis holds j running under the lease Postgres's running copy at a is under: the same
-- worker and attempt, and the same claim (an attempt can be given back and taken again by
-- the same worker: stopped.lua, a refunded failure)
local function same_lease(j, a)
  local claimed = ARGV[a + 23]
  return j.state == 'running' and ARGV[a + 7] == 'running' and j.worker == ARGV[a + 13]
    and j.attempt == ARGV[a + 9] and (claimed == '' or claimed == j.lease_version)
end

-- j, running under its worker's lease, moved forward to Postgres's copy at a where it is: the
-- lease (its version, worker, deadline in the active set) and the counts stay as they are,
-- so the worker's next heartbeat or outcome is accepted. Its 'lv' is the version restored,
-- which Postgres holds: the worker's next logged entry links to it. Returns its document.
local function advance_running(j, a)
  j.version = int(tonumber(ARGV[a + 8]))
  j.lv, j.updated, j.lt = j.version, ARGV[a + 10], ARGV[a + 10]
  if ARGV[a + 12] == '1' then
    j.cancel = '1'  -- a cancel request is never withdrawn
  end
  j.error, j.progress = ARGV[a + 14], ARGV[a + 15]
  local doc = render(j)
  write_fields(j, {'t', packed_t(j)})
  return doc
end

for i = 0, n - 1 do
  local a = 3 + i * WIDTH
  local id, version = ARGV[a], tonumber(ARGV[a + 8])
  local old = load(id)
  if old and tonumber(old.version) >= version then
    local was = old.state .. ' ' .. old.version
    out[#out + 1], out[#out + 2], out[#out + 3] = 'skipped', was, was
  elseif old and same_lease(old, a) then
    local was = old.state .. ' ' .. old.version
    local doc = advance_running(old, a)
    redis.call('SPUBLISH', EV, id .. ' ' .. old.version .. ' ' .. old.tenant .. '\n' .. doc)
    out[#out + 1], out[#out + 2], out[#out + 3] = 'advanced', was, 'running ' .. old.version
  else
    local was = ''
    if old then
      was = old.state .. ' ' .. old.version
      take_out(old)
    end
    local state, result, ttl = ARGV[a + 7], ARGV[a + 18], ARGV[a + 19]
    local j = {id = id, tenant = ARGV[a + 1], type = ARGV[a + 2], prio = ARGV[a + 3],
               max_attempts = ARGV[a + 4], created_iso = ARGV[a + 5], queue = ARGV[a + 6],
               ckey = old and old.ckey or '', wf = old and old.wf or '', state = state,
               version = int(version), attempt = ARGV[a + 9], updated = ARGV[a + 10],
               run_at = ARGV[a + 11], run_at_iso = '', cancel = ARGV[a + 12],
               worker = ARGV[a + 13], error = ARGV[a + 14], progress = ARGV[a + 15],
               lease_version = old and old.lease_version or '0', lv = int(version),
               lt = ARGV[a + 10], dd = old and old.dd, cpm = old and old.cpm,
               _key = job_key(id)}
    if tonumber(j.attempt) > 0 and j.lease_version == '0' then
      j.lease_version = j.version  -- claimed once (keyed.lua: '0' is never claimed)
    end
    if state == 'succeeded' and string.byte(result, 1) == 64 then
      j.wf = with_flag(j.wf, 'R')
    end
    if state == 'waiting' and not has_flag(j, 'w') then
      restore_deps(j, ARGV[a + 20], ARGV[a + 21])
    end
    local dependents = ARGV[a + 22]
    if TERMINAL[state] and dependents ~= '' and not has_flag(j, 'd') then
      local ids = {}
      for dep in string.gmatch(dependents, '%S+') do
        ids[#ids + 1] = dep
      end
      chunked('SADD', BASE .. 'dnt:' .. id, ids)
      j.wf = with_flag(j.wf, 'd')
    end
    local doc = render(j)  -- (fills run_at_iso before 't' is packed)
    local c, t = packed_c(j), packed_t(j)
    local fields = {'id', id, 'tenant', j.tenant, 'c', c, 't', t, 'wf', j.wf,
                    'payload', ARGV[a + 16]}
    if ARGV[a + 17] ~= '' then
      fields[#fields + 1], fields[#fields + 2] = 'idem', ARGV[a + 17]
    end
    if result ~= '' then
      fields[#fields + 1], fields[#fields + 2] = 'result', result
    end
    write_fields(j, fields)
    redis.call('PERSIST', j._key)
    local kind = old and 'advanced' or 'restored'
    local idem = ARGV[a + 24]
    if not old and idem ~= '' then
      local sp = string.find(idem, ' ', 1, true)
      redis.call('SET', BASE .. 'idem:' .. j.tenant .. ':' .. ARGV[a + 17],
                 id .. ' ' .. string.sub(idem, 1, sp - 1), 'PX', string.sub(idem, sp + 1), 'NX')
    end
    if WAITING[state] then
      count(WAITING_COUNTS, j.tenant, 1)
    end
    if state == 'queued' then
      make_ready(j, true)
    elseif state == 'scheduled' then
      add_timed('sched', j, tonumber(j.run_at))
    elseif state == 'waiting' then
      count(QUEUES, j.queue .. ':waiting', 1)
      if has_flag(j, 'w') then
        redis.call('ZADD', BASE .. 'unlinked', NOW, id)
      end
    elseif state == 'running' then
      kind = 'requeued'
      j._was = {id, j.tenant, c, t, j.wf, j.error, j.progress}
      count(QUEUES, j.queue .. ':running', 1)  -- commit() counts it leaving running
      local lost = j.worker
      j.worker = ''
      if j.cancel == '1' then
        local why = 'cancelled on request; its worker ' .. lost .. ' lost the job in a failover'
        doc = cancel_job(j, 'running', 'reconciler', ttl, error_json('Cancelled', why))
      else
        j.state = 'queued'
        doc = commit(j, 'running', 'reconciler', RELEASED)
        make_ready(j, true)
      end
    else
      if state == 'failed' then
        redis.call('ZADD', BASE .. 'dead', tonumber(j.updated), id)
      end
      -- finish() without the compensation: the failure's own script created that job, and
      -- Postgres, which has the failure, has its submit too
      local wf = j.wf
      j.wf = string.gsub(wf, 'c', '')
      finish(j, ttl)
      j.wf = wf
    end
    if kind ~= 'requeued' then
      redis.call('SPUBLISH', EV, id .. ' ' .. j.version .. ' ' .. j.tenant .. '\n' .. doc)
    end
    out[#out + 1], out[#out + 2], out[#out + 3] = kind, was, j.state .. ' ' .. j.version
  end
end
flush()
return out

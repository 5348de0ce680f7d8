-- lib.lua: shared by every script; store/scripts.py puts it where a script says --!include lib.lua
--
-- Conventions of every script:
--   KEYS[1]  the shard's transition log stream (jt:{s}:log). It routes the script to the
--            shard's node; every other key the script touches is built from ARGV[1], the
--            shard's key base (jt:{s}:), so it carries the same hash tag and lives in the same
--            slot. core/keys.py documents the layout.
--   Times are Redis's own clock (TIME) in milliseconds: one clock for every process.
--   Each transition goes through commit(): version + 1, the job's fields stored, its status
--   document rendered (readers render it again from the fields), the new status published,
--   and its log entry kept for the call's end, where every transition the call made goes to
--   the log stream in one entry (logged(), below).
--   A progress-only change may be left out of the log (commit's `quiet`); every log entry
--   names the version of the job's previous logged entry, so the history Postgres keeps can
--   be proven complete (persist/queries.sql: history_gaps).

-- Result codes: core/errors.py Code holds the same names and values (a unit test checks).
local OK = 0
local NOT_FOUND = 1
local VERSION_CONFLICT = 2
local WRONG_STATE = 3
local NOT_OWNER = 4
local IDEMPOTENCY_CONFLICT = 5
local DUPLICATE = 6
local EXISTS = 7

-- What a call sets (begin(), at the end of this file): the shard's key base, Redis's clock
-- in ms, and what follows from them.
local BASE, NOW

local PRIORITIES = {'critical', 'high', 'normal', 'low'}
local PRIORITY_AT = {critical = 1, high = 2, normal = 3, low = 4}  -- each one's place in it
-- waiting: for its dependencies (flows, below); it counts as waiting like queued and scheduled
local WAITING = {scheduled = true, queued = true, waiting = true}
local TERMINAL = {succeeded = true, failed = true, cancelled = true}

-- A job's hash, jt:{s}:job:<id> (core/keys.py, "Job hashes"): 'c' the fields fixed at
-- creation, 't' those a transition changes, each packed in one string of space-separated
-- values (the last one free text: a concurrency key, a worker id), beside 'id', 'tenant',
-- 'wf', 'error', 'progress' ('', absent, when empty), 'payload', 'result' and the flow fields.
-- No status document: readers render it from the fields (render.lua status_of), byte for
-- byte the one commit() logged and published. Packed, a transition reads 7 fields and writes
-- 2 or 3: fewer values for Redis to look up, for Lua to convert and for the AOF to store.
--
-- created_iso keeps the rendered creation time, run_at_iso the rendered run-at (see render):
-- formatting a date is a large share of a transition's work in Redis. lv and lt are the
-- version and time (ms) of the job's last logged entry (see commit). wf: the job's flow flags
-- ('' for a job with no dependency, dependent or compensation: the only field a plain job
-- pays for flows; see the flows section).
local FIELDS = {'id', 'tenant', 'c', 't', 'wf', 'error', 'progress'}
-- job_fields() reads them, C_PATTERN and T_PATTERN unpack 'c' and 't', render() renders the
-- document: render.lua's.
--!include render.lua

local function job_key(id)
  return BASE .. 'job:' .. id
end

-- The job `id` as a table of its fields, or nil when the shard does not hold it. load() keeps
-- the HMGET reply in j._was: commit() writes only what changed ('t', and 'error' or
-- 'progress' when they moved), less for the AOF to store and for Lua to hand over. j._key is
-- the hash's key (create_job sets it too), built once per job.
-- The table is built by one constructor that names every field: Lua sizes it once, where
-- filling it in a loop rehashes it as it grows. `more` (optional): one more field to read in
-- the same HMGET, as j.more (claim.lua reads the payload so rather than with an HGET after),
-- `more2` as j.more2 (claim.lua: the trace context, 'tp'), `more3` as j.more3 (claim.lua:
-- the expiry, 'ex') and `more4` as j.more4 (claim.lua: the job's own timeout, 'to').
local function load(id, more, more2, more3, more4)
  local key = job_key(id)
  local v = job_fields(key, more, more2, more3, more4)
  if not v[1] then
    return nil
  end
  if not v[T_AT] then
    -- written by a jobtier before format 3 (store/format.py adopt refuses such a deployment)
    error('job hash ' .. key .. ' is in a format before 3: run `jobtier job-format --upgrade`')
  end
  local typ, prio, max_attempts, created_iso, queue, ckey = string.match(v[C_AT], C_PATTERN)
  local state, version, attempt, updated, run_at, run_at_iso, cancel, lease_version, lv, lt,
    worker = string.match(v[T_AT], T_PATTERN)
  -- keep in step with FIELDS, C_PATTERN and T_PATTERN (a unit test checks)
  local j = {id = v[1], tenant = v[2] or '', type = typ, prio = prio,
             max_attempts = max_attempts, created_iso = created_iso, queue = queue,
             ckey = ckey, wf = v[5] or '', error = v[6] or '', progress = v[7] or '',
             state = state, version = version, attempt = attempt, updated = updated,
             run_at = run_at, run_at_iso = run_at_iso, cancel = cancel,
             lease_version = lease_version, lv = lv, lt = lt, worker = worker, more = v[8],
             more2 = v[9], more3 = v[10], more4 = v[11], _was = v, _key = key}
  read_deps(j, key)
  read_checkpoint(j, key)
  return j
end

-- Counters kept in hashes (ready jobs per queue and priority, running jobs per queue, waiting
-- jobs per tenant) are summed here and written once per script by flush(): a batch of 500
-- jobs costs one HINCRBY per counter touched, not one per job. Every script that changes a
-- job calls flush() before it returns (a unit test checks).
local COUNTS  -- begin() empties it
-- batches' children finished by this call, summed like COUNTS and written by flush() (the
-- batches section below): BATCH_DONE[counts key] = {s, f, c, n}
local BATCH_DONE, batch_flush
local function count(key, field, delta)
  local h = COUNTS[key]
  if not h then
    h = {}
    COUNTS[key] = h
  end
  h[field] = (h[field] or 0) + delta
end

-- Per shard, the hash jt:{s}:queues holds for each queue q: 'q:<priority>' ready jobs,
-- 'q:running' running jobs, 'q:held' jobs held behind concurrency keys, 'q:paused' ('1'
-- while paused), 'q:wrr' its claim rotation cursor.
local QUEUES, PARKED
-- keys every transition touches, built once per call rather than once per job (begin())
local LOG, EV, WAITING_COUNTS
local PRIORITY_SUFFIX = {[':critical'] = true, [':high'] = true, [':normal'] = true,
                         [':low'] = true}

local function flush()
  local woken = {}
  for key, fields in pairs(COUNTS) do
    for field, delta in pairs(fields) do
      if delta ~= 0 then
        local now = redis.call('HINCRBY', key, field, delta)
        -- workers sleep on the wake channel only when every queue they serve was empty:
        -- wake them when a queue's ready count leaves zero (once per queue per script)
        if delta > 0 and now == delta then
          local q
          if key == QUEUES then
            local name, suffix = string.match(field, '^(.*)(:[a-z]+)$')
            if PRIORITY_SUFFIX[suffix] then
              q = name
            end
          elseif key == PARKED then  -- '<queue>:<type>': a worker that has the task may sleep
            q = string.match(field, '^([^:]+):')
          end
          if q and not woken[q] then
            woken[q] = true
            redis.call('SPUBLISH', BASE .. 'wake', 'q ' .. q)
          end
        end
      end
    end
  end
  COUNTS = {}
  if next(BATCH_DONE) then
    batch_flush()
  end
end

-- Versions, attempts and lease versions are small integers, the same for most jobs of a
-- batch: each is formatted once per script
local INT_STR = {}
local function int(n)
  local s = INT_STR[n]
  if not s then
    s = string.format('%d', n)
    if n >= 0 and n < 1024 then
      INT_STR[n] = s
    end
  end
  return s
end

-- NOW as the fields store it (begin())
local NOW_STR

-- The log entries of a call: commit() keeps each transition's (6 values: its document,
-- tenant, previous state, actor, previous logged version and extra fields or false), and
-- they are appended to the log together when the call ends (logged(), which store/scripts.py
-- wraps around every script), or sooner once they hold LOG_MOST transitions or LOG_BYTES
-- bytes. One transition is an entry of its own fields, as it always was; several are one
-- entry, 'n' their number and each one's fields named with its place after the name ('d1',
-- 'tn1', 'fr1', …, 'd2', …): streams/entries.py reads both. A batch of jobs then costs the
-- log one stream id, one pending entry and one acknowledgement in each consumer group and
-- one XCLAIM in the append-only file, where each of its transitions cost all of those.
local LOG_MOST, LOG_BYTES = 100, 256 * 1024
local LOGGED, LOGGED_N, LOGGED_SIZE  -- begin() empties them
local LOG_ARGS = {}  -- write_log()'s scratch table
local LOG_NAMES = {}  -- place -> {'d<place>', 'tn<place>', 'fr<place>', 'w<place>', 'pv<place>'}

local function log_names(i)
  local names = LOG_NAMES[i]
  if not names then
    local s = tostring(i)
    names = {'d' .. s, 'tn' .. s, 'fr' .. s, 'w' .. s, 'pv' .. s, s}
    LOG_NAMES[i] = names
  end
  return names
end

local function write_log()
  local n, L = LOGGED_N, LOGGED
  if n == 0 then
    return
  end
  if n == 1 then
    if L[6] then
      redis.call('XADD', LOG, '*', 'd', L[1], 'tn', L[2], 'fr', L[3], 'w', L[4], 'pv', L[5],
                 unpack(L[6]))
    else
      redis.call('XADD', LOG, '*', 'd', L[1], 'tn', L[2], 'fr', L[3], 'w', L[4], 'pv', L[5])
    end
  else
    local a, k = LOG_ARGS, 2
    a[1], a[2] = 'n', int(n)
    for i = 1, n do
      local b, names = (i - 1) * 6, log_names(i)
      a[k + 1], a[k + 2], a[k + 3], a[k + 4], a[k + 5] = names[1], L[b + 1], names[2], L[b + 2],
        names[3]
      a[k + 6], a[k + 7], a[k + 8], a[k + 9], a[k + 10] = L[b + 3], names[4], L[b + 4], names[5],
        L[b + 5]
      k = k + 10
      local extra = L[b + 6]
      if extra then
        local s = names[6]
        for x = 1, #extra, 2 do
          a[k + 1], a[k + 2] = extra[x] .. s, extra[x + 1]
          k = k + 2
        end
      end
    end
    redis.call('XADD', LOG, '*', unpack(a, 1, k))
  end
  LOGGED, LOGGED_N, LOGGED_SIZE = {}, 0, 0
end

-- Keep a transition's log entry (commit()).
local function log_entry(doc, tenant, from, actor, prev, extra)
  local L, b = LOGGED, LOGGED_N * 6
  L[b + 1], L[b + 2], L[b + 3], L[b + 4], L[b + 5], L[b + 6] = doc, tenant, from, actor, prev,
    extra or false
  LOGGED_N = LOGGED_N + 1
  local size = #doc
  if extra then
    for x = 2, #extra, 2 do
      size = size + #extra[x]
    end
  end
  LOGGED_SIZE = LOGGED_SIZE + size
  if LOGGED_N >= LOG_MOST or LOGGED_SIZE >= LOG_BYTES then
    write_log()
  end
end

-- Every script's end (store/scripts.py runs each script's body as ``logged(pcall(body))``):
-- the call's log entries appended, whether it returned or failed half-way (what it changed
-- before an error stays changed, as Redis does not roll a script back: so is its log), then
-- its reply or its error.
local function logged(ok, reply)
  write_log()
  if ok then
    return reply
  end
  -- pcall gives a failed command's error as its text: an error reply again, its code (ERR,
  -- READONLY, OOM, …) kept, as it was before pcall caught it; any other error, raised again
  if type(reply) == 'string' and string.find(reply, '^%u[%u_]* ') then
    return redis.error_reply(reply)
  end
  error(reply, 0)
end

-- queue -> its running count's field in the queues hash, built once per queue per script
local RUNNING_FIELD = {}
local HSET_ARGS = {}  -- commit()'s scratch table

-- the packed values (see FIELDS): j's fixed fields and its changing ones
local function packed_c(j)
  return j.type .. ' ' .. j.prio .. ' ' .. j.max_attempts .. ' ' .. j.created_iso .. ' '
    .. j.queue .. ' ' .. j.ckey
end

local function packed_t(j)
  return j.state .. ' ' .. j.version .. ' ' .. j.attempt .. ' ' .. j.updated .. ' ' .. j.run_at
    .. ' ' .. j.run_at_iso .. ' ' .. j.cancel .. ' ' .. j.lease_version .. ' ' .. j.lv .. ' '
    .. j.lt .. ' ' .. j.worker
end

-- commit()'s HSET arguments for j, after the n already in args: 't', and 'error' and
-- 'progress' where they changed since load() (for a new job: where not empty). Returns the
-- new n.
local function changed(j, args, n)
  local was, t = j._was, packed_t(j)
  if not was then
    args[n + 1], args[n + 2] = 't', t
    n = n + 2
    if j.error ~= '' then
      args[n + 1], args[n + 2] = 'error', j.error
      n = n + 2
    end
    if j.progress ~= '' then
      args[n + 1], args[n + 2] = 'progress', j.progress
      n = n + 2
    end
    return n
  end
  -- a value compared as unchanged is exactly what the hash holds (was is updated as it is
  -- written, so a second commit of j in the same script compares with the first)
  if was[T_AT] ~= t then
    args[n + 1], args[n + 2] = 't', t
    n = n + 2
    was[T_AT] = t
  end
  if (was[ERROR_AT] or '') ~= j.error then
    args[n + 1], args[n + 2] = 'error', j.error
    n = n + 2
    was[ERROR_AT] = j.error
  end
  if (was[PROGRESS_AT] or '') ~= j.progress then
    args[n + 1], args[n + 2] = 'progress', j.progress
    n = n + 2
    was[PROGRESS_AT] = j.progress
  end
  return n
end

-- Apply a transition already made to j (state and fields): bump the version, store the
-- fields, render the document, keep the per-tenant waiting count, append to the log,
-- publish. `actor` is who made it (worker id, 'scheduler', 'api'); `extra` adds fields to
-- the log entry (payload at submit, result at success).
-- Every log entry carries 'pv', the version of the job's previous logged entry (0 for the
-- submit): Postgres follows these links to prove that no logged entry went missing. `quiet`
-- (only a change within a state may ask it: progress, heartbeat.lua; a dependency count
-- moving, resolve.lua) stores and publishes the change like any other but leaves it out of
-- the log; the next logged entry's document carries it, so only intermediate values are
-- missing from the history, provably.
local function commit(j, from, actor, extra, quiet)
  local prev = j.lv  -- the version of its last logged entry ('0' for a new job: create_job)
  j.version = int(tonumber(j.version) + 1)
  j.updated = NOW_STR
  local doc = render(j)
  if not quiet then
    j.lv, j.lt = j.version, NOW_STR
  end
  -- One HSET of what changed since load() (j._was), or for a new job (create_job: no _was)
  -- of its fixed fields (j._new) and every non-empty one. A script that changes a field
  -- behind j's back must not rely on commit() to overwrite it (none does).
  -- (`_set`: more fields for this HSET, given by the caller, e.g. a success's result.)
  -- A loaded job's arguments go into one table kept for the whole script (HSET_ARGS, read
  -- up to n by unpack; commit() never runs inside itself): a new table per job would be
  -- grown one append at a time, resized as it grows, and left to the collector.
  local args = j._new or j._set
  local n = 0
  if args then
    n = #args
  else
    args = HSET_ARGS
  end
  n = changed(j, args, n)
  j._new, j._set = nil, nil
  redis.call('HSET', j._key, unpack(args, 1, n))
  if WAITING[from] ~= WAITING[j.state] then
    count(WAITING_COUNTS, j.tenant, WAITING[j.state] and 1 or -1)
  end
  if (from == 'running') ~= (j.state == 'running') then
    local field = RUNNING_FIELD[j.queue]
    if not field then
      field = j.queue .. ':running'
      RUNNING_FIELD[j.queue] = field
    end
    count(QUEUES, field, j.state == 'running' and 1 or -1)
  end
  if not quiet then
    log_entry(doc, j.tenant, from, actor, prev, extra)
  end
  redis.call('SPUBLISH', EV, j.id .. ' ' .. j.version .. ' ' .. j.tenant .. '\n' .. doc)
  return doc
end

-- Ready jobs: one list per (queue, priority, tenant), jt:{s}:q:<queue>:<priority>:<tenant>
-- (LPUSH new, RPOP oldest: FIFO), and per (queue, priority) a ring of the tenants whose
-- list is not empty, jt:{s}:ring:<queue>:<priority>, which claims rotate through so that one
-- tenant's backlog cannot starve another tenant's job. A tenant is in the ring exactly while
-- its list is not empty.
local function ready_list(queue, prio, tenant)
  return BASE .. 'q:' .. queue .. ':' .. prio .. ':' .. tenant
end

local function ring_key(queue, prio)
  return BASE .. 'ring:' .. queue .. ':' .. prio
end

-- Make j ready to claim. Front = the job already waited its turn (reclaimed, released).
local function push_ready(j, front)
  local list = ready_list(j.queue, j.prio, j.tenant)
  local n
  if front then
    n = redis.call('RPUSH', list, j.id)
  else
    n = redis.call('LPUSH', list, j.id)
  end
  if n == 1 then
    redis.call('RPUSH', ring_key(j.queue, j.prio), j.tenant)
  end
  count(QUEUES, j.queue .. ':' .. j.prio, 1)
end

-- Concurrency keys: at most `limit` jobs of one key (per tenant) are ready or running at
-- once; the others wait, oldest first, in jt:{s}:ck:<tenant>:<key> (they stay `queued`).
-- jt:{s}:ckeys holds per '<tenant>:<key>' how many are ready or running, and under
-- '<tenant>:<key>:limit' the limit last submitted. A job with a key lives in the key's shard
-- (engine/produce.py routes it), so all of this is one script's atomic work.
local CKEYS  -- BASE .. 'ckeys' (begin())

local function ck_name(j)
  return j.tenant .. ':' .. j.ckey
end

-- The jobs of each queue held behind their concurrency keys, counted under 'q:held' in
-- jt:{s}:queues (queued, but in no ready list: the queue's figures show them apart). A job
-- counted there is marked so in its hash ('h'), and only a marked job leaves the count: one
-- held before the count was kept (an upgrade) neither counts nor takes another's place.
local function held(j)
  redis.call('HSET', j._key, 'h', '1')
  count(QUEUES, j.queue .. ':held', 1)
end

local function unheld(id, queue)
  if redis.call('HDEL', job_key(id), 'h') == 1 then
    count(QUEUES, queue .. ':held', -1)
  end
end

-- Make j ready to claim, or hold it behind its concurrency key. Front = the job already
-- waited its turn (reclaimed, released): it goes first.
local function make_ready(j, front)
  if j.ckey == '' then
    push_ready(j, front)
    return
  end
  local name = ck_name(j)
  local v = redis.call('HMGET', CKEYS, name, name .. ':limit')
  local admitted, limit = tonumber(v[1] or '0'), tonumber(v[2] or '1')
  if admitted < limit then
    redis.call('HINCRBY', CKEYS, name, 1)
    push_ready(j, front)
  else
    redis.call(front and 'RPUSH' or 'LPUSH', BASE .. 'ck:' .. name, j.id)
    held(j)
  end
end

-- j (ready or running under its key) is leaving: free its place and admit the oldest held
-- job of the key, if any. `admitted` (optional): called with each job made ready so.
local function ck_release(j, admitted)
  if j.ckey == '' then
    return
  end
  local name = ck_name(j)
  local left = redis.call('HINCRBY', CKEYS, name, -1)
  if left < 0 then  -- never below zero, whatever happened before (a guard, not a path)
    redis.call('HSET', CKEYS, name, 0)
    left = 0
  end
  local limit = tonumber(redis.call('HGET', CKEYS, name .. ':limit') or '1')
  while left < limit do
    local next_id = redis.call('RPOP', BASE .. 'ck:' .. name)
    if not next_id then
      break
    end
    local n = load(next_id)
    if n then
      unheld(next_id, n.queue)
    end
    if n and n.state == 'queued' then
      redis.call('HINCRBY', CKEYS, name, 1)
      left = left + 1
      push_ready(n, true)
      if admitted then
        admitted(n)
      end
    end
  end
  if left == 0 and redis.call('LLEN', BASE .. 'ck:' .. name) == 0 then
    redis.call('HDEL', CKEYS, name, name .. ':limit')  -- an idle key costs nothing
  end
end

-- Take j out of its ready list (counts and its tenant's place in the ring with it), if it is
-- there: push_ready's undoing. Returns whether it was.
local function unready(j)
  local list = ready_list(j.queue, j.prio, j.tenant)
  if redis.call('LREM', list, -1, j.id) == 0 then
    return false
  end
  count(QUEUES, j.queue .. ':' .. j.prio, -1)
  if redis.call('LLEN', list) == 0 then
    redis.call('LREM', ring_key(j.queue, j.prio), 0, j.tenant)
  end
  return true
end

-- Take a queued job out of wherever it waits (cancel): its ready list, the parked jobs of its
-- type (handed back by a worker that cannot run it: claim.lua), or its key's queue.
local function remove_ready(j)
  local field = j.queue .. ':' .. j.type
  if unready(j) then
    ck_release(j)
  elseif redis.call('LREM', BASE .. 'park:' .. field, -1, j.id) > 0 then
    count(PARKED, field, -1)
    ck_release(j)
  elseif j.ckey ~= '' and redis.call('LREM', BASE .. 'ck:' .. ck_name(j), -1, j.id) > 0 then
    unheld(j.id, j.queue)
  end
end

-- Pop up to n of the oldest ready jobs of (queue, prio), rotating through the tenants that
-- have some: each tenant in the ring gets an equal share in turn, and the tenants served go
-- to the back of the ring. One tenant (the common case) costs an LRANGE, an RPOP and an LLEN.
-- Appends the ids to `out`; returns how many.
local function pop_ready(queue, prio, n, out)
  local ring = ring_key(queue, prio)
  local got = 0
  for _ = 1, 4 do  -- a pass serves up to n tenants; a short tenant leaves room for another pass
    if got >= n then
      break
    end
    -- two tenants at least: a claim of one job must see whether its tenant is alone in the
    -- ring, or it would keep its place and be served until its list is empty
    local tenants = redis.call('LRANGE', ring, 0, math.max(n - got - 1, 1))
    if #tenants == 0 then
      break
    end
    local per = math.max(1, math.floor((n - got) / #tenants))
    local served, keep = 0, {}
    for _, tenant in ipairs(tenants) do
      if got >= n then
        break
      end
      served = served + 1
      local list = ready_list(queue, prio, tenant)
      local take = math.min(per, n - got)
      local ids = redis.call('RPOP', list, take)
      local k = ids and #ids or 0
      for i = 1, k do
        out[#out + 1] = ids[i]
      end
      got = got + k
      if k == take and redis.call('LLEN', list) > 0 then
        keep[#keep + 1] = tenant
      end
    end
    if #tenants > 1 or #keep == 0 then  -- a lone tenant with jobs left keeps its place
      redis.call('LPOP', ring, served)
      if #keep > 0 then
        redis.call('RPUSH', ring, unpack(keep))
      end
    end
  end
  count(QUEUES, queue .. ':' .. prio, -got)
  return got
end

-- Run `command key ...` over `values` in calls of up to CHUNK of them: a few calls for many
-- values (each redis.call has a fixed cost), and never so many at once that unpack() passes
-- Lua's C-stack limit (a fan-in's 10,000 ids).
local CHUNK = 1000  -- even: (score, member) pairs stay whole
local function chunked(command, key, values)
  for i = 1, #values, CHUNK do
    redis.call(command, key, unpack(values, i, math.min(i + CHUNK - 1, #values)))
  end
end

-- Put j in a sorted set scored by `at`; tell the scheduler when `at` is the new earliest.
local function add_timed(set, j, at)
  redis.call('ZADD', BASE .. set, at, j.id)
  local first = redis.call('ZRANGE', BASE .. set, 0, 0)
  if first[1] == j.id then
    redis.call('SPUBLISH', BASE .. 'wake', 's ' .. int(at))
  end
end

-- Defined in the flows section below, used by create_job and finish.
local flow_create, flow_finished

-- more fields for every job create_job makes in this call (batch_submit.lua: the batch's),
-- written by the same HSET; begin() clears it
local NEW_FIELDS

-- When a submitted job is due: its run-at (ms), else now plus its delay (ms), else '' (no
-- time of its own: now). 0 is none for either.
local function due_of(run_at, delay)
  if run_at > 0 then
    return run_at
  elseif delay > 0 then
    return NOW + delay
  end
  return ''
end

-- A new job: queued, or scheduled when `due` (ms, '' for none) is in the future, or waiting
-- when `flow` (JSON, '' or nil for none: see flow_create) gives it dependencies. `trace`: the
-- W3C traceparent of the submit ('tp'; '' or nil for none: an untraced job stores nothing).
-- Returns its status document.
local function create_job(id, tenant, type, queue, prio, payload, max_attempts, due, idem, actor,
                          ckey, climit, flow, trace)
  local j = {id = id, tenant = tenant, type = type, queue = queue, prio = prio,
             state = 'queued', version = '0', attempt = '0', max_attempts = max_attempts,
             run_at = '', error = '', progress = '', cancel = '0', worker = '',
             lease_version = '0', created_iso = iso_str(NOW_STR), run_at_iso = '', lv = '0',
             lt = '', ckey = ckey or '', _key = job_key(id)}
  if due ~= '' then
    j.run_at = int(due)
    if due > NOW then
      j.state = 'scheduled'
    end
  end
  -- written by commit()'s one HSET, with the fields every transition stores (FIELDS)
  j._new = {'id', id, 'tenant', tenant, 'c', packed_c(j), 'payload', payload}
  if idem ~= '' then
    j._new[#j._new + 1], j._new[#j._new + 2] = 'idem', idem
  end
  if trace and trace ~= '' then
    j._new[#j._new + 1], j._new[#j._new + 2] = 'tp', trace
  end
  if NEW_FIELDS then
    for _, v in ipairs(NEW_FIELDS) do
      j._new[#j._new + 1] = v
    end
  end
  if j.ckey ~= '' then
    redis.call('HSET', CKEYS, ck_name(j) .. ':limit', climit)
  end
  local extra = {'p', payload}
  if idem ~= '' then
    extra[3], extra[4] = 'ik', idem
  end
  if flow and flow ~= '' then
    flow_create(j, flow, extra)
  end
  local doc = commit(j, '', actor, extra)
  if j.state == 'scheduled' then
    add_timed('sched', j, due)
  elseif j.state ~= 'waiting' then  -- a waiting job is made ready by its last dependency
    make_ready(j, false)
  end
  return doc
end

-- The fencing check of every write a worker makes about a job it was given.
local function check_lease(j, lease_version, worker)
  if not j then
    return NOT_FOUND
  end
  if j.state ~= 'running' then
    return WRONG_STATE
  end
  if j.lease_version ~= lease_version then
    return VERSION_CONFLICT
  end
  if j.worker ~= worker then
    return NOT_OWNER
  end
  return OK
end

-- j reached a terminal state: its hash expires (Postgres keeps the record), and its flow
-- hand-offs are made in this same script (a crash cannot separate them from the transition).
-- A unique key's job ('U' or 'u': keyed.lua) frees its key, unless a later job of the key has
-- it.
local function finish(j, ttl)
  redis.call('EXPIRE', j._key, ttl)
  if j.wf ~= '' then
    if string.find(j.wf, '[Uu]') then
      local uq = redis.call('HGET', j._key, 'uq')
      if uq and redis.call('GET', uq) == j.id then
        redis.call('DEL', uq)
      end
    end
    flow_finished(j, ttl)
  end
end

local function next_score(set)
  local first = redis.call('ZRANGE', BASE .. set, 0, 0, 'WITHSCORES')
  if first[2] then
    return tonumber(first[2])
  end
  return -1
end

-- A job's error as its document shows it (core/model.py JobError); `traceback` may be nil.
local function error_json(kind, message, traceback)
  local tb = ''
  if type(traceback) == 'string' then
    tb = ',"traceback":' .. cjson.encode(traceback)
  end
  return '{"type":"' .. kind .. '","message":' .. cjson.encode(message) .. tb .. '}'
end

-- j is cancelled (from state `from`, by `actor`). `error` (JSON; nil keeps j's) replaces
-- whatever an earlier attempt left, which would otherwise read as why the job ended: a
-- cancel on request's is a Cancelled error (error_json('Cancelled', ...)), with the
-- traceback of the attempt that failed after the request (fail.lua). `extra` (optional):
-- more fields of its log entry, as commit() takes them (fail.lua: an attempt's 'rf').
-- Returns its document.
local function cancel_job(j, from, actor, ttl, error, extra)
  j.state = 'cancelled'
  j.cancel = '1'
  if error then
    j.error = error
  end
  local doc = commit(j, from, actor, extra)
  finish(j, ttl)
  return doc
end

-- A worker's batch about jobs it holds (complete.lua, fail.lua, stopped.lua): argv[2] its id,
-- argv[4] how many jobs, then `width` values per job from argv[5], the first two its id and
-- lease version. Each job whose lease holds (check_lease) leaves the active set (one ZREM per
-- CHUNK ids) and its concurrency key's place, and apply(j, a) moves it (a: the place of its
-- first value in argv) and returns its new state. Returns per job: its code, then, when
-- `with_state`, that state ('' when refused).
local function let_go(argv, width, apply, with_state)
  local worker, n = argv[2], tonumber(argv[4])
  local out, gone = {}, {}
  for i = 0, n - 1 do
    local a = 5 + i * width
    local j = load(argv[a])
    local code = check_lease(j, argv[a + 1], worker)
    local state = ''
    if code == OK then
      gone[#gone + 1] = j.id
      ck_release(j)
      state = apply(j, a)
    end
    out[#out + 1] = code
    if with_state then
      out[#out + 1] = state
    end
  end
  chunked('ZREM', BASE .. 'active', gone)
  return out
end

-- --- Flows: dependencies, fan-in, compensation ------------------------------------------
-- A job's 'wf' field holds its flow flags; '' (most jobs) costs nothing more than reading it:
--   'w'  it has dependencies. jt:{s}:deps:<id> maps each dependency id to '0' (pending),
--        '1' (pending, and a child: created in the same flow, cancelled with this job), or,
--        once resolved, a state mark (STATE_MARK; upper case for a child) followed by the
--        dependency's result (succeeded) or error (JSON). Fields: 'dids' the ids in order (space-separated), 'dn'
--        their number, 'dpend' still pending, 'dfail' resolved without success, 'odf' what a
--        failed dependency does ('run': nothing; '': cancels this job), 'dd' the summary the
--        status document shows ({"total","done","failed"}).
--   'd'  it has dependents: jt:{s}:dnt:<id> holds their ids (any shard).
--   'c'  it has a compensation: 'comp' holds "<type> <queue> <max attempts>", the job created
--        (in the same script) when this one fails for good.
--   'R'  not a flow flag: its success's result is kept outside Redis (complete.lua, render).
--   'K'  not a flow flag: it saved a checkpoint, 'cp' its state, 'cpm' what its document
--        shows of it (heartbeat.lua, render.lua read_checkpoint).
-- Dependents live on any shard, so a finishing job does not touch them: its script appends a
-- hand-off to its own shard's stream jt:{s}:flow, in the same atomic step as the transition,
-- and the resolver (flows/resolver.py) applies it on the dependent's shard (resolve.lua),
-- acknowledging it only after. resolve.lua is idempotent (a dependency resolves once), so a
-- hand-off applied twice (a resolver died before acknowledging) changes nothing.
local FLOW, UNLINKED  -- BASE .. 'flow', BASE .. 'unlinked' (begin())
local STATE_MARK = {succeeded = 's', failed = 'f', cancelled = 'c', missing = 'm'}

local function has_flag(j, flag)
  return j.wf ~= '' and string.find(j.wf, flag, 1, true) ~= nil
end

-- The job that holds a unique key, its record `uq` (keyed.lua), or nil: the job the record
-- names, if it lives and holds it by its own mode ('U': until it finishes; 'u': while it
-- waits to run, queued or scheduled, for its first attempt or a later one).
local function unique_holder(uq)
  local held = redis.call('GET', uq)
  local j = held and load(held)
  if j and not TERMINAL[j.state] and (has_flag(j, 'U') or j.state ~= 'running') then
    return j
  end
  return nil
end

-- One hand-off in this shard's flow stream: kind 'r' (`source` finished in `state`, with
-- `data`: result or error) or 'x' (`source` was cancelled: cancel its children that have not
-- started), for `targets` (ids, space-separated). The resolver is woken once per script.
local flow_woken  -- begin() sets it false
local function handoff(kind, source, state, data, targets)
  redis.call('XADD', FLOW, '*', 'k', kind, 'j', source, 's', state, 'v', data, 't', targets)
  if not flow_woken then
    flow_woken = true
    redis.call('SPUBLISH', BASE .. 'wake', 'f')
  end
end

local function deps_doc(total, pending, failed)
  return '{"total":' .. total .. ',"done":' .. (total - pending) .. ',"failed":' .. failed .. '}'
end

-- j's dependencies as the worker hands them to the task (claim.lua): {ids in order
-- (space-separated), the flat HGETALL of jt:{s}:deps:<id>}; '' for a job without any. The
-- worker builds the mapping (flows/reads.py): for a large fan-in, far less Redis time than a
-- JSON document assembled here.
local function flow_inputs(j)
  if not has_flag(j, 'w') then
    return ''
  end
  return {redis.call('HGET', job_key(j.id), 'dids') or '',
          redis.call('HGETALL', BASE .. 'deps:' .. j.id)}
end

-- A new job's flow part (create_job): `blob` is JSON, every member optional:
--   d  dependency ids; k  one '0'/'1' per dependency ('1': a child, see above);
--   o  on dependency failure ('run' or ''); u  ms until the resolver checks its links;
--   t  dependent ids (created in the same flow: linked at birth); c  the compensation.
-- A job with dependencies is created waiting (whatever its run-at, which applies once they
-- are done) and in jt:{s}:unlinked until its submitter says every dependency knows of it
-- (linked.lua); past the deadline the resolver links them itself (link.lua is idempotent),
-- so a submitter that died halfway loses nothing. The log entry names the dependencies
-- ('dp' ids, 'dk' kinds) for Postgres.
flow_create = function(j, blob, extra)
  local f = cjson.decode(blob)
  local key = job_key(j.id)
  local flags = ''
  if type(f.d) == 'table' and #f.d > 0 then
    flags = 'w'
    local n, kinds = #f.d, f.k or ''
    local fields = {}
    for i, dep in ipairs(f.d) do
      fields[#fields + 1] = dep
      fields[#fields + 1] = string.sub(kinds, i, i) == '1' and '1' or '0'
    end
    chunked('HSET', BASE .. 'deps:' .. j.id, fields)
    local ids = table.concat(f.d, ' ')
    j.state = 'waiting'
    j.dd = deps_doc(n, n, 0)
    redis.call('HSET', key, 'dd', j.dd, 'dids', ids, 'dn', n, 'dpend', n, 'dfail', 0,
               'odf', f.o or '')
    redis.call('ZADD', UNLINKED, NOW + (tonumber(f.u) or 0), j.id)
    count(QUEUES, j.queue .. ':waiting', 1)
    extra[#extra + 1], extra[#extra + 2] = 'dp', ids
    extra[#extra + 1], extra[#extra + 2] = 'dk', kinds
  end
  if type(f.t) == 'table' and #f.t > 0 then
    flags = flags .. 'd'
    chunked('SADD', BASE .. 'dnt:' .. j.id, f.t)
  end
  if type(f.c) == 'string' and f.c ~= '' then
    flags = flags .. 'c'
    redis.call('HSET', key, 'comp', f.c)
  end
  if flags ~= '' then
    j.wf = flags
    redis.call('HSET', key, 'wf', flags)
  end
end

-- A waiting job leaves the waiting state (ready, or cancelled).
local function unwait(j)
  count(QUEUES, j.queue .. ':waiting', -1)
  redis.call('ZREM', UNLINKED, j.id)
end

-- j, not started (queued, scheduled or waiting), leaves where it waits and is cancelled
-- (cancel_job): cancel.lua, resolve.lua.
local function cancel_unstarted(j, actor, ttl, error)
  local from = j.state
  if from == 'queued' then
    remove_ready(j)
  elseif from == 'scheduled' then
    redis.call('ZREM', BASE .. 'sched', j.id)
  else
    unwait(j)
  end
  return cancel_job(j, from, actor, ttl, error)
end

-- Crockford base32 of a millisecond time: the first 10 characters of a ULID (core/keys.py ulid).
local CROCKFORD = '0123456789ABCDEFGHJKMNPQRSTVWXYZ'
local function ulid_time(ms)
  local out = {}
  for i = 10, 1, -1 do
    local d = ms % 32
    out[i] = string.sub(CROCKFORD, d + 1, d + 1)
    ms = (ms - d) / 32
  end
  return table.concat(out)
end

-- A new job id in j's shard (scripts cannot draw random numbers): now's time and j's id's
-- randomness, a millisecond later while it is taken.
local function derived_id(j)
  local ulid, shard = string.match(j.id, '^(%w+)%-(%d+)$')
  local ms = NOW
  while true do
    local id = ulid_time(ms) .. string.sub(ulid, 11) .. '-' .. shard
    if redis.call('EXISTS', job_key(id)) == 0 then
      return id
    end
    ms = ms + 1
  end
end

-- j failed for good and names a compensation task: create its job now, in this script.
local function compensate(j)
  local key = job_key(j.id)
  -- its trace context too: the compensation runs in the trace of the job it compensates
  local v = redis.call('HMGET', key, 'comp', 'payload', 'tp')
  local ctype, cqueue, attempts = string.match(v[1] or '', '^(%S+) (%S+) (%d+)$')
  if not ctype then
    return
  end
  local payload = '{"job_id":' .. cjson.encode(j.id) .. ',"type":' .. cjson.encode(j.type)
    .. ',"payload":' .. raw_or_null(v[2] or '') .. ',"error":' .. raw_or_null(j.error) .. '}'
  local id = derived_id(j)
  create_job(id, j.tenant, ctype, cqueue, j.prio, payload, attempts, '', '', 'compensation', '',
             1, nil, v[3])
  redis.call('HSET', key, 'cjob', id)
  -- 'cof': the job it compensates, written only here: claim.lua hands it to the worker, which
  -- opens an encrypted payload inside a payload only for a job that has it (a submitter can
  -- write a payload of this shape, never this field)
  redis.call('HSET', job_key(id), 'cof', j.id)
end

-- --- Batches: children counted where they finish ---------------------------------------
-- A batch's child has 'b' in its wf, and an id that starts with its batch's first 18
-- characters (its time and 8 random digits: flows/batches.py draws them so), which names the
-- shard's share of the batch's counts without a field to read. Children spread over every
-- shard, so each shard keeps its own share, in the child's slot: jt:{s}:bt:<prefix> holds
-- 'bid' the batch's id, 'n' children here, 'left' not finished (plus the 'hold', one while
-- the submit is still adding children: batch_seal.lua), 'mk' children made, 'x' cancelled
-- (batch_cancel.lua), 's'/'f'/'c' finished by state, and 'e' the epoch of the shard's last
-- hand-off. A shard whose 'left' reaches 0 tells the batch's shard through its flow stream
-- (one hand-off per shard, not per child: batch_done.lua); a retry that brings one back
-- reopens it. Readers sum the shards' counts (flows/batches.py). The key outlives the
-- shard's share: it expires only once the whole batch has finished (batch_expire.lua), as a
-- retry elsewhere may still bring the batch back.
local function batch_key(id)
  return BASE .. 'bt:' .. string.sub(id, 1, 18)
end

local function batch_handoff(key, state)
  local e = redis.call('HINCRBY', key, 'e', 1)
  local v = redis.call('HMGET', key, 's', 'f', 'c', 'bid')
  local shard = string.match(BASE, '{(%d+)}')
  handoff('b', shard, state, e .. ' ' .. (v[1] or 0) .. ' ' .. (v[2] or 0) .. ' '
          .. (v[3] or 0), v[4] or '')
  if state == 'open' then
    redis.call('PERSIST', key)  -- a retry after the batch had finished and expired its keys
  end
end

-- j, a child, finished (finish() via flow_finished): its shard's counts move, summed over
-- the call and written once per batch by flush() (a worker reports its jobs in batches)
local function batch_finished(j)
  local key = batch_key(j.id)
  local b = BATCH_DONE[key]
  if not b then
    b = {s = 0, f = 0, c = 0, n = 0}
    BATCH_DONE[key] = b
  end
  local mark = STATE_MARK[j.state]
  b[mark] = b[mark] + 1
  b.n = b.n + 1
end

batch_flush = function()
  for key, b in pairs(BATCH_DONE) do
    for _, mark in ipairs({'s', 'f', 'c'}) do
      if b[mark] > 0 then
        redis.call('HINCRBY', key, mark, b[mark])
      end
    end
    if redis.call('HINCRBY', key, 'left', -b.n) == 0 then
      batch_handoff(key, 'done')
    end
  end
  BATCH_DONE = {}
end

-- j, a finished child, is back in play (a replay): its count returns to 'left'. Counts no
-- longer kept (the batch finished and they expired) are not rebuilt: a key without its
-- 'bid' would send a hand-off no batch can take, and its counts would be wrong.
local function batch_revived(j)
  local key = batch_key(j.id)
  if redis.call('HEXISTS', key, 'bid') == 0 then
    return
  end
  redis.call('HINCRBY', key, STATE_MARK[j.state], -1)
  if redis.call('HINCRBY', key, 'left', 1) == 1 then
    batch_handoff(key, 'open')
  end
end

flow_finished = function(j, ttl)
  local key = job_key(j.id)
  if has_flag(j, 'd') then
    local targets = redis.call('SMEMBERS', BASE .. 'dnt:' .. j.id)
    if #targets > 0 then
      local data = j.error
      if j.state == 'succeeded' then
        data = redis.call('HGET', key, 'result') or ''
      end
      handoff('r', j.id, j.state, data, table.concat(targets, ' '))
    end
    redis.call('EXPIRE', BASE .. 'dnt:' .. j.id, ttl)
  end
  if has_flag(j, 'w') then
    if j.state == 'cancelled' then
      -- its children that have not started go with it (their own children with them)
      local flat = redis.call('HGETALL', BASE .. 'deps:' .. j.id)
      local kids = {}
      for i = 1, #flat, 2 do
        if flat[i + 1] == '1' then
          kids[#kids + 1] = flat[i]
        end
      end
      if #kids > 0 then
        handoff('x', j.id, 'cancelled', '', table.concat(kids, ' '))
      end
    end
    redis.call('EXPIRE', BASE .. 'deps:' .. j.id, ttl)
  end
  if j.state == 'failed' and has_flag(j, 'c') then
    compensate(j)
  end
  if has_flag(j, 'b') then
    batch_finished(j)
  end
end

-- A finished job back in play (replay.lua): its flow keys stop expiring with it.
local function flow_revived(j)
  if has_flag(j, 'b') then
    batch_revived(j)
  end
  if has_flag(j, 'd') then
    redis.call('PERSIST', BASE .. 'dnt:' .. j.id)
  end
  if has_flag(j, 'w') then
    redis.call('PERSIST', BASE .. 'deps:' .. j.id)
  end
end

-- The start of every call, before its script's own code: the per-call values above, from
-- `argv` (ARGV: its first value is the shard's key base) and Redis's clock. A script run by
-- EVALSHA runs this file's top level and then begin(ARGV) at each call; the function library
-- (store/scripts.py) runs the top level once, when it is loaded, and each function begins with
-- begin(ARGV): so every value a call may change is set here, and nothing is left over from
-- the call before (a call that failed half-way leaves COUNTS half-summed).
local function begin(argv)
  BASE = argv[1]
  local t = redis.call('TIME')
  NOW = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  NOW_STR = int(NOW)
  COUNTS = {}
  BATCH_DONE, NEW_FIELDS = {}, nil
  QUEUES, PARKED, CKEYS = BASE .. 'queues', BASE .. 'parked', BASE .. 'ckeys'
  LOG, EV, WAITING_COUNTS = BASE .. 'log', BASE .. 'ev', BASE .. 'waiting'
  LOGGED, LOGGED_N, LOGGED_SIZE = {}, 0, 0
  FLOW, UNLINKED = BASE .. 'flow', BASE .. 'unlinked'
  flow_woken = false
  RUNNING_FIELD = {}  -- a cache by queue name: emptied, so that a library kept for weeks
  -- does not hoard every queue name it has met
  ISO_OF = {}  -- render.lua's dates of this call: a library kept for days must not hoard them
end

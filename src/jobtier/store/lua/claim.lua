-- claim.lua: lease up to `count` ready jobs of one shard to a worker (queued -> running).
--
-- KEYS[1]  shard log stream (routing)
-- ARGV[1]  shard key base, jt:{s}:
-- ARGV[2]  worker id
-- ARGV[3]  count: most jobs to claim
-- ARGV[4]  lease, ms
-- ARGV[5]  number of queues the worker serves, m, then 2 fields per queue:
--            name, most jobs to take from it in this call (-1: no cap; for a limited
--            queue, the permits the worker holds for this call: limit.lua)
-- then     number of task types t the worker can run, then the t names (t = 0: any type;
--          for tools and tests, never a worker)
-- then     the claim's token: unique per call ('' or absent: none; see below)
-- then     the retention of finished jobs, s (absent: a day): an expired job's (below)
-- Returns  {now ms, ready jobs left in the shard's served queues (that this worker could
--           run, for parked ones; a limited queue's only when the worker had permits for it),
--           jobs claimed k, jobs handed back h, limited queues asked without a cap l,
--           when to look at the shard again (ms; -1: no need): when the first block of a
--           served queue ends, or now when the call stopped at its bound on expired jobs
--           (below) with ready jobs left,
--           then per job: id, type, payload, attempt, max_attempts, lease_version,
--           queued at ms, queue, dependencies (lib.lua flow_inputs: '' for none, else
--           {ids, flat id/outcome pairs}), the submit's traceparent ('' for none),
--           the compensated job's id ('' for none), the last checkpoint ('' for none),
--           the job's own timeout, ms ('' for none: its task's; 'to', submit.lua);
--           then the h ids handed back; then the l queue names}
--
-- A queue with a global concurrency or rate limit is flagged limited in every shard
-- ('q:limited' in the queues hash): a worker that asks it without a cap (it has not heard of
-- the limit yet) gets nothing from it and is told, so it takes permits first.
--
-- Queues share the call in turn (the worker rotates the order of its list between calls): each
-- queue with ready jobs gets an equal share, a queue short of jobs leaves its share to the
-- others. A paused queue gives nothing. Within a queue, priorities are served by a smooth
-- weighted rotation, critical:high:normal:low = 8:4:2:1, kept per queue in the queues hash: a
-- turn whose priority is empty goes to the highest non-empty one, so low gets at least one
-- claim in 15 however many higher jobs wait, and nothing idles while work is ready. Within a
-- priority, tenants take turns (lib.lua pop_ready), and each tenant's oldest job goes first.
--
-- A job whose type the worker cannot run (two worker pools sharing a queue, a deploy in
-- progress) is handed back untouched — no transition, no attempt used — and parked in
-- jt:{s}:park:<queue>:<type>, counted in jt:{s}:parked under '<queue>:<type>'. Parked jobs
-- are out of the ready counts, so a worker that cannot run them does not keep meeting them;
-- claims by workers that can run them take them first (they have waited longest).
--
-- A job submitted with an expiry ('ex' in its hash, ms: submit.lua) that a claim meets past
-- it is not claimed: it is cancelled, its error an Expired one, whichever attempt was next
-- (a retry's too), and the claim takes another in its place: an expired job counts neither
-- in the bound on what a call pops nor against a limited queue's permits, and a job its
-- concurrency key admits in its place may be claimed by the same call. A call cancels
-- EXPIRED_MOST at most, and then answers `now` as when to look again: a caller that claimed
-- nothing asks again at once, not after its idle wait. A job expires so when a claim reaches
-- it; until then it waits as it was (docs/expiry.md).
--
-- A claim may run twice: the client library sends a call again when the connection dies
-- before its reply, and the first call may have run. So a claim that leased jobs keeps what
-- it answered under its token, jt:{s}:ct:<token> (msgpack: now, ready left, wake_at, then
-- per job its id, lease_version and queued-at ms), for a lease. The same token sent again
-- answers those jobs again, rendered as the first answer (its `now`: the lease started
-- then), without claiming others: only the jobs still running under that lease for this
-- worker (a lease that expired, a cancel, made them another's). Nothing is handed back or
-- written by such a replay. A claim that leased nothing keeps nothing (an idle worker's
-- empty claims write nothing), and a replay of it claims as a new one would.
--!include lib.lua

local ROTATION = {1, 2, 1, 3, 1, 2, 1, 4, 1, 2, 1, 3, 1, 2, 1}
local worker, wanted, lease = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local nq = tonumber(ARGV[5])
local names, caps, fields = {}, {}, {}
local queue_at = {}  -- each served queue's place in names
for i = 1, nq do
  local q = ARGV[4 + 2 * i]
  names[i], caps[i] = q, tonumber(ARGV[5 + 2 * i])
  queue_at[q] = i
  for _, p in ipairs(PRIORITIES) do
    fields[#fields + 1] = q .. ':' .. p
  end
  fields[#fields + 1] = q .. ':paused'
  fields[#fields + 1] = q .. ':wrr'
  fields[#fields + 1] = q .. ':limited'
  fields[#fields + 1] = q .. ':blocked'
end
local runnable = nil
local token_key = nil  -- where this claim's answer is kept (nil: no token)
local retention  -- s, of an expired job's hash
do
  local a = 6 + 2 * nq
  local t = tonumber(ARGV[a])
  if t > 0 then
    runnable = {}
    for i = 1, t do
      runnable[ARGV[a + i]] = true
    end
  end
  local token = ARGV[a + t + 1]
  if token and token ~= '' then
    token_key = BASE .. 'ct:' .. token
  end
  retention = ARGV[a + t + 2] or '86400'
end

-- a claimed job's reply fields, from `k + 1` of `out`; `j` loaded with its payload, trace
-- context, expiry and timeout (load(id, 'payload', 'tp', 'ex', 'to')); returns the index of
-- its last field
local function render_claimed(out, k, j, queued_at)
  out[k + 1], out[k + 2], out[k + 3], out[k + 4] = j.id, j.type, j.more, j.attempt
  out[k + 5], out[k + 6], out[k + 7] = j.max_attempts, j.lease_version, queued_at
  out[k + 8], out[k + 9], out[k + 10] = j.queue, flow_inputs(j), j.more2 or ''
  -- the failed job a compensation compensates (lib.lua compensate), read only for a
  -- payload of a compensation's shape: one HGET for those, none for the others
  local cof = ''
  if string.sub(j.more or '', 1, 10) == '{"job_id":' then
    cof = redis.call('HGET', j._key, 'cof') or ''
  end
  out[k + 11] = cof
  -- the last checkpoint a previous attempt saved (heartbeat.lua), '' for none
  out[k + 12] = has_flag(j, 'K') and (redis.call('HGET', j._key, 'cp') or '') or ''
  out[k + 13] = j.more4 or ''
  return k + 13
end

-- The answer of a claim already run under this token, its jobs rendered again (those still
-- leased to this worker under the lease it gave), or nil: not run, or its answer expired.
local function replay()
  local kept = token_key and redis.call('GET', token_key)
  if not kept then
    return nil
  end
  local first = cmsgpack.unpack(kept)
  local out = {first[1], first[2], 0, 0, 0, first[3]}
  local nout, claimed = #out, 0
  for i = 4, #first, 3 do
    local j = load(first[i], 'payload', 'tp', 'ex', 'to')
    if j and j.state == 'running' and j.worker == worker and j.lease_version == first[i + 1] then
      nout = render_claimed(out, nout, j, first[i + 2])
      claimed = claimed + 1
    end
  end
  out[3] = claimed
  return out
end

do
  local again = replay()
  if again then
    return again
  end
end

-- per queue: ready jobs by priority, what it may still give, its rotation cursor
local lens, room, cursor, start = {}, {}, {}, {}
local open = {}  -- served now: not paused, blocked, nor without a permit
local values = nq > 0 and redis.call('HMGET', QUEUES, unpack(fields)) or {}
local left = 0
local unaware = {}  -- limited queues the worker asked without a cap
local WIDTH = 8
local wake_at = -1  -- when the first block ends (a task raised RateLimited: store/context.py block_queue)
for i = 1, nq do
  local base = (i - 1) * WIDTH
  local l, total = {}, 0
  for k = 1, 4 do
    l[k] = math.max(tonumber(values[base + k] or '0') or 0, 0)
    total = total + l[k]
  end
  if values[base + 7] == '1' and caps[i] < 0 then
    caps[i] = 0
    unaware[#unaware + 1] = names[i]
  end
  local blocked = tonumber(values[base + 8] or '0') or 0
  if blocked > NOW then
    caps[i] = 0
    if wake_at < 0 or blocked < wake_at then
      wake_at = blocked
    end
  end
  if values[base + 5] == '1' or caps[i] == 0 then  -- paused, blocked, or no permit for it
    total = 0
    l = {0, 0, 0, 0}
  else
    open[i] = true
  end
  lens[i] = l
  left = left + total
  room[i] = caps[i] >= 0 and math.min(total, caps[i]) or total
  cursor[i] = tonumber(values[base + 6] or '0') or 0
  start[i] = cursor[i]
end

-- share `n` jobs out between the queues: equal shares, a short queue's rest to the others
local function share(n)
  local want, open = {}, 0
  for i = 1, nq do
    want[i] = 0
    if room[i] > 0 then
      open = open + 1
    end
  end
  while n > 0 and open > 0 do
    local each = math.max(1, math.floor(n / open))
    open = 0
    for i = 1, nq do
      if n > 0 and room[i] > 0 then
        local t = math.min(each, room[i], n)
        want[i], room[i], n = want[i] + t, room[i] - t, n - t
        if room[i] > 0 then
          open = open + 1
        end
      end
    end
  end
  return want
end

-- parked jobs this worker can run: served queue, not paused, runnable type
local parked = {}  -- {field, queue index, count}
do
  local flat = redis.call('HGETALL', BASE .. 'parked')
  if #flat > 0 then
    for k = 1, #flat, 2 do
      local field, n = flat[k], tonumber(flat[k + 1])
      local q, t = string.match(field, '^([^:]+):(.+)$')
      local i = q and queue_at[q]
      if i and n > 0 and values[(i - 1) * WIDTH + 5] ~= '1' and caps[i] ~= 0
          and (not runnable or runnable[t]) then
        parked[#parked + 1] = {field, i, n}
      end
    end
  end
end

-- the claimed jobs' reply fields go straight after the counts (filled in at the end): one
-- table grown once, not a list of jobs copied into the reply after
local out = {NOW, 0, 0, 0, 0, wake_at}
local nout = #out
local handed = {}  -- ids handed back, pushed back once every pop is done
local claimed = 0
local deadline = NOW + lease
local active = {}  -- (deadline, id) of each lease, for the active set: ZADDs of CHUNK values

-- expired jobs this call cancelled, and the most it cancels (each is a transition: a bound
-- on the script's time)
local expired, EXPIRED_MOST = 0, 500

-- A job of queue i popped and not claimed (expired): a limited queue's permit it took goes
-- to another job of the queue. (An unlimited queue's room is its ready jobs left: as it was.)
local function give_back(i)
  if i and caps[i] >= 0 then
    local l = lens[i]
    caps[i] = caps[i] + 1
    room[i] = math.min(room[i] + 1, caps[i], l[1] + l[2] + l[3] + l[4])
  end
end

-- A job made ready during the call (its concurrency key admitted it: an expired job left),
-- counted among the ready jobs the call may claim when its queue is served and open.
local function admitted(n)
  local i = queue_at[n.queue]
  if i and open[i] then
    local l = lens[i]
    local k = PRIORITY_AT[n.prio]
    l[k] = l[k] + 1
    left = left + 1
    if caps[i] < 0 then
      room[i] = room[i] + 1
    end
  end
end

local function claim_ids(ids)
  for _, id in ipairs(ids) do
    -- the payload, the trace context, the expiry and the timeout come in load()'s HMGET:
    -- one call per job rather than HMGET + HGETs
    local j = load(id, 'payload', 'tp', 'ex', 'to')
    -- a ready list holds only queued jobs (cancel and expiry remove them); the check guards
    -- the invariant rather than trusting it
    if j and j.state == 'queued' then
      if j.more3 and tonumber(j.more3) <= NOW then
        -- out of its list already (popped): it leaves its concurrency key's place too
        ck_release(j, admitted)
        cancel_job(j, 'queued', 'expiry', retention,
                   error_json('Expired', 'not started by its expiry, ' .. iso(j.more3)))
        expired = expired + 1
        give_back(queue_at[j.queue])
      elseif runnable and not runnable[j.type] then
        handed[#handed + 1] = j
      else
        local queued_at = j.updated
        j.state = 'running'
        j.attempt = int(tonumber(j.attempt) + 1)
        j.worker = worker
        j.lease_version = int(tonumber(j.version) + 1)
        commit(j, 'queued', worker)
        active[#active + 1], active[#active + 2] = deadline, id
        nout = render_claimed(out, nout, j, queued_at)
        claimed = claimed + 1
      end
    end
  end
end

-- Parked jobs first: they were handed back by a worker that could not run them, and waited.
for _, p in ipairs(parked) do
  local field, i = p[1], p[2]
  local n = math.min(p[3], wanted - claimed, caps[i] >= 0 and caps[i] or wanted)
  if n > 0 then
    local ids = redis.call('RPOP', BASE .. 'park:' .. field, n) or {}
    count(BASE .. 'parked', field, -#ids)
    p[3] = p[3] - #ids
    if caps[i] >= 0 then
      caps[i] = caps[i] - #ids
      room[i] = math.min(room[i], caps[i])
    end
    claim_ids(ids)
  end
end

-- Each pass plans its turns first (which queue and priority serve each), then pops every
-- priority's share at once. Another pass runs only if popped jobs could not be claimed
-- (handed back), and never pops more than twice `count` in all: a queue full of jobs this
-- worker cannot run must not turn one call into a scan of it.
local popped_total = 0
while claimed < wanted and left > 0 and popped_total - expired < 2 * wanted
    and expired < EXPIRED_MOST do
  local want = share(math.min(wanted - claimed, left))
  local ids = {}
  for i = 1, nq do
    if want[i] > 0 then
      local take = {0, 0, 0, 0}
      local l = lens[i]
      for _ = 1, want[i] do
        local pick = ROTATION[cursor[i] % 15 + 1]
        cursor[i] = cursor[i] + 1
        if l[pick] == 0 then
          for k = 1, 4 do
            if l[k] > 0 then
              pick = k
              break
            end
          end
        end
        take[pick] = take[pick] + 1
        l[pick] = l[pick] - 1
        left = left - 1
      end
      for k = 1, 4 do
        if take[k] > 0 then
          popped_total = popped_total + pop_ready(names[i], PRIORITIES[k], take[k], ids)
        end
      end
    end
  end
  if #ids == 0 then
    break  -- the counts promised jobs the lists do not hold: nothing more to find
  end
  claim_ids(ids)
end
chunked('ZADD', BASE .. 'active', active)
for _, j in ipairs(handed) do
  local field = j.queue .. ':' .. j.type
  redis.call('LPUSH', BASE .. 'park:' .. field, j.id)
  count(BASE .. 'parked', field, 1)
end
-- a cursor moves only when its queue was served: an idle worker's empty claims then write
-- nothing (no AOF entry, no replication)
for i = 1, nq do
  if cursor[i] ~= start[i] then
    redis.call('HSET', QUEUES, names[i] .. ':wrr', cursor[i] % 15015)
  end
end
flush()
for _, p in ipairs(parked) do
  left = left + p[3]
end
out[2] = math.max(left, 0)
if expired >= EXPIRED_MOST and out[2] > 0 then
  out[6] = NOW  -- more ready jobs behind those it cancelled: look again now
end
out[3], out[4], out[5] = claimed, #handed, #unaware
if token_key and claimed > 0 then
  -- what a resent call answers (replay): the jobs' places in `out` are fixed, 13 fields each
  local kept = {NOW, out[2], wake_at}
  for k = 7, 6 + 13 * claimed, 13 do
    kept[#kept + 1], kept[#kept + 2], kept[#kept + 3] = out[k], out[k + 5], out[k + 6]
  end
  redis.call('SET', token_key, cmsgpack.pack(kept), 'PX', lease)
end
for _, j in ipairs(handed) do
  out[#out + 1] = j.id
end
for _, q in ipairs(unaware) do
  out[#out + 1] = q
end
return out

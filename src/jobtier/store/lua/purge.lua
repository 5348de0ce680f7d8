-- purge.lua: an operator empties a queue's backlog in one shard: its ready jobs (and those
-- parked for a worker that has their task) are cancelled, oldest first (queued -> cancelled).
--
-- Each job is cancelled as cancel.lua cancels a waiting one: out of its list, the queue's
-- ready (or parked) count and its tenant's waiting count down, its concurrency key's place
-- freed, the transition logged (Postgres sees it cancelled) and published. Scheduled and
-- running jobs are left alone. A call cancels at most a batch (Redis serves nobody else while
-- it runs); the caller calls again while the shard's budget lasts. The budget (the queue's
-- ready and parked jobs when the purge began) keeps a purge from chasing jobs submitted
-- while it runs.
--
-- KEYS[1]  shard log stream (routing)
-- ARGV[1]  shard key base, jt:{s}:
-- ARGV[2]  queue name
-- ARGV[3]  most jobs to take out in this call
-- ARGV[4]  budget: most jobs still to take out of this shard for this purge; -1 on the first
--          call (then: the queue's ready and parked jobs in this shard now)
-- ARGV[5]  retention of finished jobs, s
-- Returns  {jobs cancelled by this call, ids taken out of the lists by it (a list holding a job
--           that is not queued loses it uncancelled), budget left, the queue's ready and
--           parked jobs left in this shard}
--!include lib.lua

local queue, batch, budget, ttl = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5]
local prefix = queue .. ':'  -- a queue name has no ':', so this prefix is the queue's alone

-- the queue's fields of the parked hash ('<queue>:<type>') that hold jobs
local function parked_fields()
  local out = {}
  local flat = redis.call('HGETALL', PARKED)
  for k = 1, #flat, 2 do
    local n = tonumber(flat[k + 1]) or 0
    if n > 0 and string.sub(flat[k], 1, #prefix) == prefix then
      out[#out + 1] = {flat[k], n}
    end
  end
  return out
end

local function waiting_now()
  local fields = {}
  for i, p in ipairs(PRIORITIES) do
    fields[i] = prefix .. p
  end
  local n = 0
  for _, v in ipairs(redis.call('HMGET', QUEUES, unpack(fields))) do
    n = n + math.max(tonumber(v or '0') or 0, 0)
  end
  for _, p in ipairs(parked_fields()) do
    n = n + p[2]
  end
  return n
end

if budget < 0 then
  budget = waiting_now()
end
local room = math.min(batch, budget)
local taken, cancelled = 0, 0

local function cancel_ids(ids)
  taken = taken + #ids
  for _, id in ipairs(ids) do
    local j = load(id)
    -- a list holds only queued jobs (cancel and expiry take them out): the check guards the
    -- invariant, as claim.lua's does; anything else is dropped from the list, not changed
    if j and j.state == 'queued' then
      ck_release(j)  -- may admit a job held behind the same key: it becomes ready (it stays)
      cancel_job(j, 'queued', 'admin', ttl)
      cancelled = cancelled + 1
    end
  end
end

-- parked jobs first: they waited longest
for _, p in ipairs(parked_fields()) do
  if taken >= room then
    break
  end
  local ids = redis.call('RPOP', BASE .. 'park:' .. p[1], math.min(p[2], room - taken)) or {}
  count(PARKED, p[1], -#ids)
  cancel_ids(ids)
end

-- then each priority's ready lists, tenant by tenant, oldest first
for _, prio in ipairs(PRIORITIES) do
  if taken >= room then
    break
  end
  local ring = ring_key(queue, prio)
  for _, tenant in ipairs(redis.call('LRANGE', ring, 0, -1)) do
    if taken >= room then
      break
    end
    local list = ready_list(queue, prio, tenant)
    local ids = redis.call('RPOP', list, room - taken) or {}
    count(QUEUES, prefix .. prio, -#ids)
    if redis.call('LLEN', list) == 0 then
      redis.call('LREM', ring, 0, tenant)  -- a tenant is in the ring while its list has jobs
    end
    cancel_ids(ids)
  end
end

flush()
return {cancelled, taken, budget - taken, waiting_now()}

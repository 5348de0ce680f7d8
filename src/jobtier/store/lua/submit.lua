-- submit.lua: create jobs in one shard (new -> queued, or -> scheduled with a future run-at, or
-- -> waiting with dependencies).
--
-- KEYS[1]  shard log stream (routing)
-- ARGV[1]  shard key base, jt:{s}:
-- ARGV[2]  idempotency record lifetime, ms
-- ARGV[3]  the submit's W3C traceparent, kept by each job it creates as 'tp' ('' none: the
--          submit was not traced; one per call, since one call is one submit's)
-- ARGV[4]  number of jobs n, then 17 fields per job:
--            id, tenant, type, queue, priority, payload (JSON), max_attempts,
--            run_at ms (0: none), delay ms (0: none),
--            idempotency key ('' none), request hash (identifies "the same request"),
--            concurrency key ('' none) and its limit (jobs of the key ready or running at once),
--            flow (JSON: dependencies, dependents, compensation; '' none: lib.lua flow_create),
--            expires at ms (0: none), expires in ms from now (0: none): when a job not
--            started yet is no longer to start ('ex' in its hash: claim.lua cancels it then),
--            the job's own bound on an attempt, ms (0: its task's; 'to': claim.lua answers it)
-- Returns  per job: code, job id, status document
--            OK                    created (the id asked for)
--            DUPLICATE             the key was used by the same request: that job, its document
--            IDEMPOTENCY_CONFLICT  the key was used by a different request: that job's id, ''
--            EXISTS                a job with this id exists (cron firings use fixed ids): id, doc
-- An idempotency record names its job as "<id> <request hash>" and lives in the job's shard.
--!include lib.lua

local idem_ttl = ARGV[2]
local trace = ARGV[3]
local n = tonumber(ARGV[4])
local out = {}
-- Whether any of the ids is taken, asked once for the call (EXISTS of every job key, in
-- chunks: lib.lua chunked): a fresh id (the common case) then costs no EXISTS of its own.
-- Only when one is taken does each job ask for its own key. `made` holds the ids created by
-- this call, so an id given twice in one call is still found taken the second time.
local taken = false
do
  local keys = {}
  for i = 0, n - 1 do
    keys[#keys + 1] = job_key(ARGV[5 + i * 17])
  end
  for i = 1, #keys, CHUNK do
    if redis.call('EXISTS', unpack(keys, i, math.min(i + CHUNK - 1, #keys))) > 0 then
      taken = true
      break
    end
  end
end
local made = {}
for i = 0, n - 1 do
  local a = 5 + i * 17
  local id, tenant, idem, hash = ARGV[a], ARGV[a + 1], ARGV[a + 9], ARGV[a + 10]
  local code = OK
  local idem_key
  if idem ~= '' then
    idem_key = BASE .. 'idem:' .. tenant .. ':' .. idem
    local rec = redis.call('GET', idem_key)
    if rec then
      local sp = string.find(rec, ' ', 1, true)
      local old_id, old_hash = string.sub(rec, 1, sp - 1), string.sub(rec, sp + 1)
      if old_hash == hash then
        code = DUPLICATE
        local _, doc = status_of(job_key(old_id))
        out[#out + 1], out[#out + 2], out[#out + 3] = code, old_id, doc or ''
      else
        code = IDEMPOTENCY_CONFLICT
        out[#out + 1], out[#out + 2], out[#out + 3] = code, old_id, ''
      end
    end
  end
  if code == OK and (made[id] or (taken and redis.call('EXISTS', job_key(id)) == 1)) then
    code = EXISTS
    local _, doc = status_of(job_key(id))
    out[#out + 1], out[#out + 2], out[#out + 3] = code, id, doc or ''
  end
  if code == OK then
    local due = due_of(tonumber(ARGV[a + 7]), tonumber(ARGV[a + 8]))
    if idem ~= '' then
      redis.call('SET', idem_key, id .. ' ' .. hash, 'PX', idem_ttl)
    end
    local expires = due_of(tonumber(ARGV[a + 14]), tonumber(ARGV[a + 15]))
    local timeout = ARGV[a + 16]
    if expires ~= '' or timeout ~= '0' then
      NEW_FIELDS = {}
      if expires ~= '' then
        NEW_FIELDS[1], NEW_FIELDS[2] = 'ex', int(expires)
      end
      if timeout ~= '0' then
        NEW_FIELDS[#NEW_FIELDS + 1], NEW_FIELDS[#NEW_FIELDS + 2] = 'to', timeout
      end
    end
    local doc = create_job(id, tenant, ARGV[a + 2], ARGV[a + 3], ARGV[a + 4], ARGV[a + 5],
                           ARGV[a + 6], due, idem, 'api', ARGV[a + 11], ARGV[a + 12],
                           ARGV[a + 13], trace)
    NEW_FIELDS = nil
    out[#out + 1], out[#out + 2], out[#out + 3] = OK, id, doc
    made[id] = true
  end
end
flush()
return out

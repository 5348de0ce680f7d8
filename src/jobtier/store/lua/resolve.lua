-- resolve.lua: apply flow hand-offs to the jobs of one shard (the resolver sends them, read
-- from the flow streams: flows/resolver.py).
--   waiting -> queued       its last dependency succeeded (or, on_dependency_failure "run",
--                           finished whatever the outcome)
--   waiting -> scheduled    the same, with its run-at still ahead
--   waiting -> cancelled    a dependency failed, was cancelled or does not exist (the error
--                           names it)
--   waiting -> waiting      a dependency finished, others remain: the document's
--                           dependencies count moves (published, not logged: like progress)
--   queued / scheduled / waiting -> cancelled   its flow parent was cancelled before it started
--
-- KEYS[1]  shard log stream (routing)
-- ARGV[1]  shard key base, jt:{s}:
-- ARGV[2]  retention of finished jobs, s
-- ARGV[3]  number of hand-offs n, then 5 fields per hand-off:
--            kind ('r': a dependency finished; 'x': the parent was cancelled), target (a job
--            of this shard), source (the dependency or the parent), the source's state
--            (succeeded, failed, cancelled, missing), data (its result or error JSON; '')
-- Returns  per hand-off: OK (applied), DUPLICATE (applied before), NOT_FOUND (no such
--          target), WRONG_STATE (the target no longer waits for it, or has started; a
--          dependency's outcome is still recorded among a cancelled target's dependencies)
-- Idempotent: each dependency of a job resolves once (its entry in jt:{s}:deps:<id> is no
-- longer pending after), so a hand-off delivered twice (its resolver died before it
-- acknowledged) finds it resolved and changes nothing; a parent's cancel finds its child
-- cancelled.
--!include lib.lua

local ttl, n = ARGV[2], tonumber(ARGV[3])
local out = {}
local targets = {}  -- id -> job (false: not found), loaded once per call
local dirty = {}  -- targets whose dependencies moved, in order
local function target(id)
  local j = targets[id]
  if j == nil then
    j = load(id) or false
    targets[id] = j
  end
  return j
end

-- The dependency `source`'s outcome into job `id`'s dependencies (jt:{s}:deps:<id>), if its
-- entry there is pending; false when it is not (resolved before, not one of its
-- dependencies, or the hash gone with the job: nothing is written, nothing made anew).
local function recorded(id, source, state, data)
  local deps = BASE .. 'deps:' .. id
  local current = redis.call('HGET', deps, source)
  if current ~= '0' and current ~= '1' then
    return false
  end
  local mark = STATE_MARK[state] or 'm'
  if current == '1' then
    mark = string.upper(mark)  -- a child: the flag outlives its resolution
  end
  redis.call('HSET', deps, source, mark .. data)
  return true
end

local function failure_error(source, state, data)
  local dependency = 'dependency ' .. source
  if state == 'missing' then
    return error_json('DependencyMissing', dependency .. ' does not exist (or is no longer kept)')
  elseif state == 'cancelled' then
    return error_json('DependencyCancelled', dependency .. ' was cancelled')
  end
  local why = ''
  local ok, e = pcall(cjson.decode, data)
  if ok and type(e) == 'table' then
    why = ': ' .. tostring(e.type or 'Error') .. ': ' .. tostring(e.message or '')
  end
  return error_json('DependencyFailed', dependency .. ' failed' .. why)
end

for i = 0, n - 1 do
  local a = 4 + i * 5
  local kind, id, source, state, data = ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3],
    ARGV[a + 4]
  local j = target(id)
  local code = OK
  if not j then
    code = NOT_FOUND
  elseif kind == 'x' then
    if j.state == 'queued' or j.state == 'scheduled' or j.state == 'waiting' then
      local why = 'its parent ' .. source .. ' was cancelled'
      cancel_unstarted(j, 'resolver', ttl, error_json('ParentCancelled', why))
    else
      code = WRONG_STATE
    end
  elseif j.state ~= 'waiting' then
    -- no longer waiting (cancelled): how the dependency ended is still recorded for its
    -- readers (GET /v1/jobs/{id}/dependencies); the job, its counts and its document stay
    -- as they were
    code = WRONG_STATE
    recorded(id, source, state, data)
  elseif not recorded(id, source, state, data) then
    code = DUPLICATE  -- resolved before (or not one of its dependencies)
  else
    if not j.flow then
      local v = redis.call('HMGET', job_key(id), 'dn', 'dpend', 'dfail', 'odf')
      j.flow = {n = tonumber(v[1]), pending = tonumber(v[2]), failed = tonumber(v[3]),
                run = v[4] == 'run'}
      dirty[#dirty + 1] = j
    end
    local f = j.flow
    f.pending = f.pending - 1
    if state ~= 'succeeded' then
      f.failed = f.failed + 1
      if not f.error then
        f.error = failure_error(source, state, data)
      end
    end
  end
  out[#out + 1] = code
end

for _, j in ipairs(dirty) do
  local f = j.flow
  redis.call('HSET', job_key(j.id), 'dpend', f.pending, 'dfail', f.failed)
  if j.state == 'waiting' then  -- not cancelled by a later hand-off of this call
    j.dd = deps_doc(f.n, f.pending, f.failed)
    redis.call('HSET', job_key(j.id), 'dd', j.dd)
    if f.error and not f.run then
      cancel_unstarted(j, 'resolver', ttl, f.error)
    elseif f.pending <= 0 then
      unwait(j)
      local due = tonumber(j.run_at ~= '' and j.run_at or '0')
      if due > NOW then
        j.state = 'scheduled'
        commit(j, 'waiting', 'resolver')
        add_timed('sched', j, due)
      else
        j.state = 'queued'
        commit(j, 'waiting', 'resolver')
        make_ready(j, false)
      end
    else
      commit(j, 'waiting', 'resolver', nil, true)
    end
  end
end
flush()
return out

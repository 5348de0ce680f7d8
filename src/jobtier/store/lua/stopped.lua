-- stopped.lua: a worker gives up jobs it holds without a result.
--   running -> cancelled   a cancel was requested and the task stopped for it
--   running -> queued      the worker is shutting down (released; the attempt is not counted)
--
-- KEYS[1]  shard log stream (routing)
-- ARGV[1]  shard key base, jt:{s}:
-- ARGV[2]  worker id
-- ARGV[3]  retention of finished jobs, s
-- ARGV[4]  number of jobs n, then 2 fields per job: id, lease_version
-- Returns  per job: code, new state ('' when refused)
-- A job with a pending cancel request is cancelled whichever way the worker lets it go.
-- A released job goes to the front of its queue: it already waited its turn.
--!include lib.lua

local worker, ttl = ARGV[2], ARGV[3]
local RELEASED = {'rl', '1'}
local out = let_go(ARGV, 2, function(j)
  if j.cancel == '1' then
    local why = 'cancelled on request while running (attempt ' .. j.attempt .. ')'
    cancel_job(j, 'running', worker, ttl, error_json('Cancelled', why))
  else
    j.state = 'queued'
    j.attempt = int(tonumber(j.attempt) - 1)
    j.worker = ''
    -- 'rl': nothing failed, so the error the document still shows is an earlier attempt's,
    -- not this transition's (the only running -> queued that reclaim.lua's is not)
    commit(j, 'running', worker, RELEASED)
    make_ready(j, true)
  end
  return j.state
end, true)
flush()
return out

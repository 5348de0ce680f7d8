-- fail.lua: record failed attempts of a worker's jobs.
--   running -> scheduled   retryable, attempts remain: run again at now + delay
--   running -> failed      non-retryable, or attempts exhausted: into the dead-letter set
--   running -> cancelled   a cancel was requested: the request wins over a retry or a dead
--                          letter (the job is kept as long as a failed one, ARGV[3]); the
--                          error says it was cancelled, and what the attempt raised
--   running -> cancelled   a retry would be due at or after the job's expiry ('ex', ms:
--                          submit.lua), when no claim would start it (claim.lua): it is
--                          cancelled now, by 'expiry', its error an Expired one
--
-- KEYS[1]  shard log stream (routing)
-- ARGV[1]  shard key base, jt:{s}:
-- ARGV[2]  worker id
-- ARGV[3]  retention of failed jobs, s
-- ARGV[4]  number of jobs n, then 5 fields per job:
--            id, lease_version, error JSON {"type","message"}, retry delay ms (-1: don't retry),
--            refund ('1': the attempt does not count, e.g. a RateLimited task: it is retried
--            whatever attempts remain)
-- Returns  per job: code, new state ('' when refused)
--!include lib.lua

local worker, ttl = ARGV[2], ARGV[3]
-- 'rf': the attempt was given back, not failed (the task raised jobtier's RateLimited, or an
-- open breaker held the job): what the persister's counts tell held attempts apart by
local REFUNDED = {'rf', '1'}
-- What attempt `attempt` raised (its error JSON), in words for the error that replaces it,
-- and its traceback (nil: none).
local function raised(attempt, refunded, error)
  local ok, failed = pcall(cjson.decode, error)
  if not ok or type(failed) ~= 'table' then
    failed = {}
  end
  local what = tostring(failed.type or 'an error')
  return '(attempt ' .. attempt
    .. (refunded and (', which was then given back: ' .. what) or (', which then failed with ' .. what))
    .. ')', failed.traceback
end

local out = let_go(ARGV, 5, function(j, a)
  local delay = tonumber(ARGV[a + 3])
  local refunded = ARGV[a + 4] == '1' and REFUNDED or nil
  j.error = ARGV[a + 2]
  local attempt = j.attempt
  if refunded then
    j.attempt = int(tonumber(j.attempt) - 1)
  end
  local retry = delay >= 0 and tonumber(j.attempt) < tonumber(j.max_attempts)
  local ex = retry and redis.call('HGET', j._key, 'ex')
  if j.cancel == '1' then
    -- asked to stop: no retry, no dead letter (the failure may well be the stop itself)
    local what, traceback = raised(attempt, refunded, ARGV[a + 2])
    local why = 'cancelled on request while running ' .. what
    cancel_job(j, 'running', worker, ttl, error_json('Cancelled', why, traceback))
  elseif ex and NOW + delay >= tonumber(ex) then
    -- no claim would start its retry (claim.lua): cancelled now, as one would then, with the
    -- attempt's 'rf' logged as for a retry (the metrics count the attempt failed, or given
    -- back). Kept as long as a failed job, as a cancel above.
    local what, traceback = raised(attempt, refunded, ARGV[a + 2])
    local why = 'not started again by its expiry, ' .. iso(ex) .. ': its retry would be due at '
      .. iso(NOW + delay) .. ' ' .. what
    cancel_job(j, 'running', 'expiry', ttl, error_json('Expired', why, traceback), refunded)
  elseif retry then
    j.state = 'scheduled'
    j.run_at = int(NOW + delay)
    commit(j, 'running', worker, refunded)
    add_timed('sched', j, NOW + delay)
  else
    j.state = 'failed'
    commit(j, 'running', worker, refunded)
    redis.call('ZADD', BASE .. 'dead', NOW, j.id)
    finish(j, ttl)
  end
  return j.state
end, true)
flush()
return out

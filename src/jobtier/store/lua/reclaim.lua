-- reclaim.lua: take back jobs whose lease expired without a heartbeat (the worker died).
--   running -> queued      attempts remain: to the front of its queue
--   running -> failed      attempts exhausted: into the dead-letter set
--   running -> cancelled   a cancel was requested: nobody is running it any more
--
-- KEYS[1]  shard log stream (routing)
-- ARGV[1]  shard key base, jt:{s}:
-- ARGV[2]  most jobs to reclaim in this call
-- ARGV[3]  retention of finished jobs, s
-- ARGV[4]  retention of failed jobs, s
-- Returns  {requeued, dead-lettered, next lease deadline ms (-1: none), now ms, the first
--          EXPIRED_NAMED expired jobs as '<id> <its worker>' (for the scheduler's log)}
-- The dead worker's lease_version no longer matches once the job is claimed again, and its
-- state is no longer `running` before that: its late writes are refused either way.
--!include lib.lua

local ids = redis.call('ZRANGEBYSCORE', BASE .. 'active', '-inf', NOW, 'LIMIT', 0, tonumber(ARGV[2]))
local requeued, dead = 0, 0
local EXPIRED_NAMED, named = 5, {}
for _, id in ipairs(ids) do
  redis.call('ZREM', BASE .. 'active', id)
  local j = load(id)
  if j and j.state == 'running' then
    local lost = j.worker
    if #named < EXPIRED_NAMED then
      named[#named + 1] = id .. ' ' .. lost
    end
    j.worker = ''
    ck_release(j)
    if j.cancel == '1' then
      local why = 'cancelled on request; its worker ' .. lost .. ' stopped heartbeating'
      cancel_job(j, 'running', lost, ARGV[3], error_json('Cancelled', why))
    else
      j.error = error_json('LeaseExpired', 'lease expired on worker ' .. lost)
      if tonumber(j.attempt) < tonumber(j.max_attempts) then
        j.state = 'queued'
        commit(j, 'running', lost)
        make_ready(j, true)
        requeued = requeued + 1
      else
        j.state = 'failed'
        commit(j, 'running', lost)
        redis.call('ZADD', BASE .. 'dead', NOW, id)
        finish(j, ARGV[4])
        dead = dead + 1
      end
    end
  end
end
flush()
return {requeued, dead, next_score('active'), NOW, named}

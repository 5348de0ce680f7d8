-- batch_cancel.lua: cancel children of a batch in one shard (the caller derives their ids
-- from the batch's: flows/batches.py child_ids, and passes each shard's in the order the
-- submit makes them).
--   queued / scheduled / waiting -> cancelled
--   running -> running with cancel requested (the worker is told, as cancel.lua does)
--   finished children are left as they are
--   not made yet (a submit broke off, or is still running) -> counted cancelled, and never
--     made: the shard is marked cancelled ('x'), which batch_submit.lua honours; with the
--     shard's last ids the submit's hold is released (if batch_seal.lua has not), so the
--     shard's share can finish without the submit
--
-- KEYS[1]  shard log stream (routing)
-- ARGV[1]  shard key base, jt:{s}:
-- ARGV[2]  batch id
-- ARGV[3]  tenant ('' = any: admin); another tenant's child is left alone
-- ARGV[4]  retention of finished jobs, s
-- ARGV[5]  the position in this shard's children of the first id given
-- ARGV[6]  '1' if the ids given end with the shard's last child
-- ARGV[7]  number of children n, then their ids
-- Returns  {cancelled, cancel requested (running)}
--!include lib.lua

local bid, tenant, ttl = ARGV[2], ARGV[3], ARGV[4]
local first, last, n = tonumber(ARGV[5]), ARGV[6] == '1', tonumber(ARGV[7])
local key = batch_key(bid)
-- counts no longer kept: the batch finished long ago, and nothing here may be made now
local live = redis.call('HEXISTS', key, 'bid') == 1
local made = 0
if live then
  redis.call('HSET', key, 'x', '1')
  made = tonumber(redis.call('HGET', key, 'mk') or '0')
end
local cancelled, requested, unmade = 0, 0, 0
local why = error_json('Cancelled', 'cancelled with its batch ' .. bid)
for i = 0, n - 1 do
  local id = ARGV[8 + i]
  local j = load(id)
  if j and has_flag(j, 'b') and (tenant == '' or j.tenant == tenant) then
    if WAITING[j.state] then
      cancel_unstarted(j, 'api', ttl, why)
      cancelled = cancelled + 1
    elseif j.state == 'running' and j.cancel ~= '1' then
      j.cancel = '1'
      commit(j, 'running', 'api')
      redis.call('SPUBLISH', BASE .. 'wake', 'x ' .. id .. ' ' .. j.worker)
      requested = requested + 1
    end
  elseif not j and live and first + i >= made then
    unmade = unmade + 1
  end
end
if unmade > 0 then
  redis.call('HINCRBY', key, 'n', unmade)
  redis.call('HINCRBY', key, 'c', unmade)
  cancelled = cancelled + unmade
end
-- the children cancelled above leave 'left' in flush(), which hands the share off if they
-- were its last; here: the hold, or counts that moved with no child to finish
if live and last and redis.call('HDEL', key, 'hold') == 1 then
  if redis.call('HINCRBY', key, 'left', -1) == 0 then
    batch_handoff(key, 'done')
  end
elseif unmade > 0 and redis.call('HGET', key, 'left') == '0' then
  batch_handoff(key, 'done')
end
flush()
return {cancelled, requested}

-- batch_submit.lua: create children of one batch in one shard (new -> queued), all of one
-- type, queue, priority and attempts, each marked as a batch's ('b' in wf; its id names its
-- batch: lib.lua batch_key).
--
-- KEYS[1]  shard log stream (routing)
-- ARGV[1]  shard key base, jt:{s}:
-- ARGV[2]  batch id
-- ARGV[3]  tenant
-- ARGV[4]  type
-- ARGV[5]  queue
-- ARGV[6]  priority
-- ARGV[7]  max attempts
-- ARGV[8]  the submit's W3C traceparent ('' none)
-- ARGV[9]  number of children n, then 2 fields per child: id (its batch's first 18
--          characters first), payload (JSON)
-- Returns  n (0: the batch was cancelled in this shard, and nothing was made)
-- The ids are fresh (flows/batches.py draws them), so unlike submit.lua no id is looked up
-- first; the shared values come once per call rather than once per job.
-- Once a cancel has reached this shard ('x': batch_cancel.lua) it has counted every child
-- not made yet as cancelled, so a submit still running makes none of them.
--!include lib.lua

local bid, tenant, typ, queue, prio, attempts, trace = ARGV[2], ARGV[3], ARGV[4], ARGV[5],
  ARGV[6], ARGV[7], ARGV[8]
local n = tonumber(ARGV[9])
local key = batch_key(bid)
if redis.call('HGET', key, 'x') == '1' then
  return 0
end
NEW_FIELDS = {'wf', 'b'}  -- in each child's creating HSET
for i = 0, n - 1 do
  create_job(ARGV[10 + i * 2], tenant, typ, queue, prio, ARGV[11 + i * 2], attempts, '', '',
             'api', '', 1, nil, trace)
end
NEW_FIELDS = nil
redis.call('HSET', key, 'bid', bid)
redis.call('HINCRBY', key, 'n', n)
redis.call('HINCRBY', key, 'mk', n)
redis.call('HINCRBY', key, 'left', n)
flush()
return n

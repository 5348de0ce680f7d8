-- complete.lua: record the success of a batch of a worker's jobs (running -> succeeded).
--
-- KEYS[1]  shard log stream (routing)
-- ARGV[1]  shard key base, jt:{s}:
-- ARGV[2]  worker id
-- ARGV[3]  retention of finished jobs, s (the hash then expires; Postgres keeps the record)
-- ARGV[4]  number of jobs n, then 3 fields per job: id, lease_version, result JSON ('' = null,
--          '@<ref>' = kept in the result store)
-- Returns  per job: code (OK, NOT_FOUND, WRONG_STATE, VERSION_CONFLICT, NOT_OWNER)
-- A refusal means a stale writer: its lease expired and the job moved on; the result is
-- dropped, never applied. A success wins over a pending cancel request (documented).
--!include lib.lua

local worker, ttl = ARGV[2], ARGV[3]
local out = let_go(ARGV, 3, function(j, a)
  local result = ARGV[a + 2]
  j.state = 'succeeded'
  -- a null result (the task returned None) is the field's absence, which readers take as
  -- null too: no write, and nothing for the append-only file; a result is written by
  -- commit()'s HSET with the job's fields (one call, one AOF entry)
  if result ~= '' then
    j._set = {'result', result}
    -- a result kept outside Redis (persist/results.py) comes as '@' .. its reference (JSON
    -- never starts with '@'): flagged 'R' in wf, so that its document (lib.lua render) says
    -- where to read it, whenever it is rendered
    if string.byte(result, 1) == 64 then
      j.wf = j.wf .. 'R'
      j._set[3], j._set[4] = 'wf', j.wf
    end
  end
  commit(j, 'running', worker, {'r', result})
  finish(j, ttl)
end)
flush()
return out

-- reformat.lua: rewrite a shard's job hashes from before format 3 into it, and move its ready
-- lists from before named queues into today's (`jobtier job-format --upgrade`:
-- store/format.py upgrade).
--   Format 2 kept the changing fields in 's' (as 't' is now) and the rendered status document
--   in 'doc'; format 1 kept each small field apart (OLD below) and 'doc'. A hash is rewritten
--   whole in one call: 'c' and 't' as lib.lua's packed_c/packed_t write them, the old fields
--   dropped. Not a transition: no version moves, nothing is logged or published, and the
--   document rendered from the new fields is the one 'doc' held (counted when it is not).
--   Before named queues, ready jobs waited in jt:{s}:q:<priority> (LPUSH new, RPOP oldest)
--   with the priority rotation in jt:{s}:wrr: they move, oldest first, to their queue's ready
--   lists (push_ready: the `default` queue, their tenant's list).
--   A hash in format 3 whose 'lv' an earlier jobtier left empty (a job last changed before
--   lv existed) gets it, as that jobtier read it. Idempotent: a hash in format 3, a key
--   gone, empty old lists are left as they are.
--
-- KEYS[1]  shard log stream (routing)
-- ARGV[1]  shard key base, jt:{s}:
-- ARGV[2]  most jobs to take from the old ready lists in this call (0: none)
-- ARGV[3]  number of job hashes n, then n keys of this shard's job hashes (jt:{s}:job:<id>)
-- Returns  {hashes rewritten, of them whose rendered document differs from their 'doc',
--           jobs moved to today's ready lists, ids taken from the old lists (a job no longer
--           queued is dropped from them), ids still in the old lists}
--!include lib.lua

-- what a hash from before format 3 holds that format 3 does not, in the order read below:
-- format 1's small fields ('created': the creation ms of a job from before created_iso),
-- format 2's 's', and the document of both
local OLD = {'type', 'prio', 'max_attempts', 'created_iso', 'queue', 'ckey', 'state', 'version',
             'attempt', 'updated', 'run_at', 'run_at_iso', 'cancel', 'lease_version', 'lv',
             'lt', 'worker', 'created', 's', 'doc'}
local READ = 7  -- the fields read before OLD's
local RESULT_URL = ',"result_url":"'

local differ = 0

-- Rewrite the hash at `key` into format 3; false when there is nothing to rewrite.
local function reformat(key)
  local v = redis.call('HMGET', key, 'id', 't', 'c', 'wf', 'error', 'progress', 'dd',
                       unpack(OLD))
  if not v[1] then
    return false
  end
  if v[2] then  -- format 3 already: only a job last changed before lv existed is rewritten
    local j = {}
    j.state, j.version, j.attempt, j.updated, j.run_at, j.run_at_iso, j.cancel,
      j.lease_version, j.lv, j.lt, j.worker = string.match(v[2], T_PATTERN)
    if j.lv ~= '' then
      return false
    end
    j.lv, j.lt = j.version, j.updated
    redis.call('HSET', key, 't', packed_t(j))
    return true
  end
  local f = {}
  for i = 1, #OLD do
    f[OLD[i]] = v[READ + i] or ''
  end
  local j = {id = v[1], wf = v[4] or '', error = v[5] or '', progress = v[6] or ''}
  if string.find(j.wf, 'w', 1, true) then  -- as load() reads it
    j.dd = v[7] or ''
  end
  if f.s ~= '' then  -- format 2: the packed values as they are
    j.type, j.prio, j.max_attempts, j.created_iso, j.queue, j.ckey =
      string.match(v[3], C_PATTERN)
    j.state, j.version, j.attempt, j.updated, j.run_at, j.run_at_iso, j.cancel,
      j.lease_version, j.lv, j.lt, j.worker = string.match(f.s, T_PATTERN)
  else
    for i = 1, 17 do  -- OLD's first 17: format 1's fields of 'c' and 't'
      j[OLD[i]] = f[OLD[i]]
    end
  end
  -- what older jobtiers read in place of a field that did not exist yet, written down
  if j.queue == '' then  -- a job created before queues
    j.queue = 'default'
  end
  if j.created_iso == '' then  -- a job created before created_iso
    j.created_iso = iso(f.created ~= '' and f.created or j.updated)
  end
  if j.lv == '' then  -- a job last changed before lv, when every version was logged
    j.lv, j.lt = j.version, j.updated
  end
  -- a success kept in the result store by a jobtier from before the 'R' flag (complete.lua)
  local wf = j.wf
  if j.state == 'succeeded' and not string.find(wf, 'R', 1, true)
      and string.find(f.doc, RESULT_URL, 1, true) then
    j.wf = wf .. 'R'
  end
  if f.doc ~= '' and render(j) ~= f.doc then
    differ = differ + 1
  end
  if j.wf ~= wf then
    redis.call('HSET', key, 'c', packed_c(j), 't', packed_t(j), 'wf', j.wf)
  else
    redis.call('HSET', key, 'c', packed_c(j), 't', packed_t(j))
  end
  redis.call('HDEL', key, unpack(OLD))
  return true
end

local budget, n = tonumber(ARGV[2]), tonumber(ARGV[3])
local rewritten = 0
for i = 4, 3 + n do
  if reformat(ARGV[i]) then
    rewritten = rewritten + 1
  end
end

local moved, taken, left = 0, 0, 0
for _, p in ipairs(PRIORITIES) do
  local old = BASE .. 'q:' .. p
  if budget > taken then
    local ids = redis.call('RPOP', old, budget - taken) or {}
    for _, id in ipairs(ids) do
      taken = taken + 1
      if reformat(job_key(id)) then
        rewritten = rewritten + 1
      end
      local j = load(id)
      if j and j.state == 'queued' then
        push_ready(j, false)
        moved = moved + 1
      end
    end
  end
  left = left + redis.call('LLEN', old)
end
if left == 0 then
  redis.call('DEL', BASE .. 'wrr')
end
flush()
return {rewritten, differ, moved, taken, left}

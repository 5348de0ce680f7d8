-- heartbeat.lua: extend the leases of a worker's running jobs; record progress; report cancels.
--
-- KEYS[1]  shard log stream (routing)
-- ARGV[1]  shard key base, jt:{s}:
-- ARGV[2]  worker id
-- ARGV[3]  lease, ms (new deadline = now + lease)
-- ARGV[4]  progress history interval, ms (0 = log every progress change)
-- ARGV[5]  number of jobs n, then 3 fields per job:
--            id, lease_version (the fencing token from claim), progress JSON ('' = unchanged)
-- then     (optional) number of checkpoints c, then 2 fields per checkpoint: the job's place
--            in the list above (1-based), its state (JSON)
-- Returns  per job: code, cancel requested (1/0)
--            OK, NOT_FOUND, WRONG_STATE (no longer running), VERSION_CONFLICT (the job was
--            reclaimed and claimed again), NOT_OWNER
-- A refused heartbeat tells the worker it lost the job: it must stop and drop the result.
-- A new progress value is a change of the status document: version + 1, stored and
-- published (ETags and event streams see every report). It is appended to the log (the
-- history Postgres keeps) only when the job's last logged entry is at least the interval
-- old: a chatty task costs one history row per interval, not one per report; the next
-- logged entry carries the latest progress.
-- A checkpoint is saved only under the job's lease (the same fence as the beat): 'cp' holds
-- the state, handed to the next attempt by claim.lua, 'cpm' what the document shows of it.
-- It is always logged (never quiet): Postgres keeps every checkpoint with its transition.
--!include lib.lua

local worker, deadline = ARGV[2], NOW + tonumber(ARGV[3])
local every, n = tonumber(ARGV[4]), tonumber(ARGV[5])
local cps = {}
do
  local c = 6 + n * 3
  for k = 1, tonumber(ARGV[c] or '0') do
    cps[tonumber(ARGV[c + 2 * k - 1])] = ARGV[c + 2 * k]
  end
end
local out = {}
for i = 0, n - 1 do
  local a = 6 + i * 3
  local id, progress = ARGV[a], ARGV[a + 2]
  local j = load(id)
  local code = check_lease(j, ARGV[a + 1], worker)
  local cancel = 0
  if code == OK then
    redis.call('ZADD', BASE .. 'active', deadline, id)
    local cp = cps[i + 1]
    if cp then
      j.cpm = '{"at":"' .. iso_str(NOW_STR) .. '","attempt":' .. j.attempt .. ',"bytes":'
        .. #cp .. '}'
      if not has_flag(j, 'K') then
        j.wf = j.wf .. 'K'
        redis.call('HSET', j._key, 'cp', cp, 'cpm', j.cpm, 'wf', j.wf)
      else
        redis.call('HSET', j._key, 'cp', cp, 'cpm', j.cpm)
      end
      if progress ~= '' then
        j.progress = progress
      end
      commit(j, 'running', worker, {'cp', cp})
    elseif progress ~= '' and progress ~= j.progress then
      j.progress = progress
      local quiet = every > 0 and NOW - tonumber(j.lt) < every
      commit(j, 'running', worker, nil, quiet)
    end
    if j.cancel == '1' then
      cancel = 1
    end
  end
  out[#out + 1], out[#out + 2] = code, cancel
end
flush()
return out

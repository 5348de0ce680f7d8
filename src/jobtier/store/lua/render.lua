-- render.lua: a job's status document from its hash's fields, and the read of it.
-- Included by lib.lua (every transition renders the document it logs and publishes) and by
-- read_status.lua (a read renders the document again: a job hash stores none; core/keys.py,
-- "Job hashes"). It reads nothing at its top level, so a read that includes it pays for no
-- more than the functions it defines.

-- places in job_fields' reply (below) of the fields lib.lua's load() and status_of() read
local C_AT, T_AT, ERROR_AT, PROGRESS_AT = 3, 4, 6, 7

-- the packed values:
-- 'c': type priority max_attempts created_iso queue ckey
local C_PATTERN = '^(%S*) (%a*) (%d*) (%S*) (%S*) (.*)$'
-- 't': state version attempt updated run_at run_at_iso cancel lease_version lv lt worker
local T_PATTERN = '^(%a*) (%d*) (%d*) (%d*) (%d*) (%S*) (%d*) (%d*) (%d*) (%d*) (.*)$'

-- ISO-8601 UTC from epoch milliseconds (civil-from-days, proleptic Gregorian)
local function iso(ms)
  ms = tonumber(ms)
  local s = math.floor(ms / 1000)
  local frac = ms - s * 1000
  local days = math.floor(s / 86400)
  local sod = s - days * 86400
  local z = days + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524)
                          - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local d = doy - math.floor((153 * mp + 2) / 5) + 1
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400
  if m <= 2 then
    y = y + 1
  end
  return string.format('%04d-%02d-%02dT%02d:%02d:%02d.%03dZ', y, m, d,
                       math.floor(sod / 3600), math.floor(sod % 3600 / 60), sod % 60, frac)
end

-- Times rendered, once each per script: every job a batched script moves (a claim or
-- completion of 50, a promotion of 200) is updated at the same millisecond, and so are the
-- jobs a status read meets that were finished by one batch.
local ISO_OF = {}
local function iso_str(ms)
  local s = ISO_OF[ms]
  if not s then
    s = iso(ms)
    ISO_OF[ms] = s
  end
  return s
end

local function str_or_null(s)
  if s == '' then
    return 'null'
  end
  return cjson.encode(s)
end

local function raw_or_null(s)
  if s == '' then
    return 'null'
  end
  return s
end

-- The status document (core/model.py JobStatus). Built by concatenation so that progress and
-- error, already JSON, are embedded as they are.
local function render(j)
  local run_at = 'null'
  if j.run_at ~= '' then
    -- run_at_iso holds '<run_at ms>|<ISO date>': a cache that checks itself, so a script
    -- that moves run_at without knowing of it (an older jobtier in a rolling deploy) cannot
    -- leave a stale date behind
    local ms = tostring(j.run_at)
    local cached = j.run_at_iso
    if string.sub(cached, 1, #ms + 1) ~= ms .. '|' then
      cached = ms .. '|' .. iso(j.run_at)
      j.run_at_iso = cached
    end
    run_at = '"' .. string.sub(cached, #ms + 2) .. '"'
  end
  return '{"id":' .. cjson.encode(j.id)
    .. ',"type":' .. cjson.encode(j.type)
    .. ',"queue":' .. cjson.encode(j.queue)
    .. ',"state":"' .. j.state
    .. '","version":' .. j.version
    .. ',"priority":"' .. j.prio
    .. '","attempt":' .. j.attempt
    .. ',"max_attempts":' .. j.max_attempts
    .. ',"created_at":"' .. j.created_iso
    .. '","updated_at":"' .. iso_str(j.updated)
    .. '","run_at":' .. run_at
    .. ',"progress":' .. raw_or_null(j.progress)
    .. ',"error":' .. raw_or_null(j.error)
    .. ',"cancel_requested":' .. (j.cancel == '1' and 'true' or 'false')
    .. ',"worker":' .. str_or_null(j.worker)
    .. (j.dd and j.dd ~= '' and (',"dependencies":' .. j.dd) or '')
    .. (j.cpm and j.cpm ~= '' and (',"checkpoint":' .. j.cpm) or '')
    -- a success whose result is kept outside Redis (persist/results.py; complete.lua flags
    -- it 'R' in wf) shows where to read it: a path of the job's (validated) id, JSON-safe as
    -- it is (cjson would write \/)
    .. ((j.state == 'succeeded' and j.wf ~= '' and string.find(j.wf, 'R', 1, true))
        and (',"result_url":"/v1/jobs/' .. j.id .. '/result/content"') or '')
    .. '}'
end

-- The fields of the job hash at `key` a transition reads (lib.lua FIELDS), and its fields
-- `more` to `more4` after them when given: one HMGET naming them as literals (one
-- call less per job than unpack(FIELDS); a unit test keeps them in step).
local function job_fields(key, more, more2, more3, more4)
  if more4 then
    return redis.call('HMGET', key, 'id', 'tenant', 'c', 't', 'wf', 'error', 'progress', more,
                      more2, more3, more4)
  end
  if more3 then
    return redis.call('HMGET', key, 'id', 'tenant', 'c', 't', 'wf', 'error', 'progress', more,
                      more2, more3)
  end
  if more2 then
    return redis.call('HMGET', key, 'id', 'tenant', 'c', 't', 'wf', 'error', 'progress', more,
                      more2)
  end
  if more then
    return redis.call('HMGET', key, 'id', 'tenant', 'c', 't', 'wf', 'error', 'progress', more)
  end
  return redis.call('HMGET', key, 'id', 'tenant', 'c', 't', 'wf', 'error', 'progress')
end

-- j waits (or waited) for dependencies: its document shows their count (render, from 'dd')
local function read_deps(j, key)
  if j.wf ~= '' and string.find(j.wf, 'w', 1, true) then
    j.dd = redis.call('HGET', key, 'dd') or ''
  end
end

-- j saved a checkpoint (heartbeat.lua; flagged 'K' in wf): its document shows when, from
-- which attempt and how large ('cpm'); the state itself ('cp') is read on request only
local function read_checkpoint(j, key)
  if j.wf ~= '' and string.find(j.wf, 'K', 1, true) then
    j.cpm = redis.call('HGET', key, 'cpm') or ''
  end
end

-- The tenant and status document of the job hash at `key`, and the value of its field `more`
-- (nil for none); nil when Redis holds no such job. One HMGET of the fields render() needs:
-- what it gives is byte for byte what commit() logged and published for the same version.
local function status_of(key, more)
  local v = job_fields(key, more)
  -- every job holds 't' from its creation (lib.lua create_job): without it there is no job
  -- (a hash from before format 3 is not read as one: store/format.py adopt)
  if not v[T_AT] then
    return nil
  end
  local typ, prio, max_attempts, created_iso, queue = string.match(v[C_AT], C_PATTERN)
  local state, version, attempt, updated, run_at, run_at_iso, cancel, _, _, _, worker =
    string.match(v[T_AT], T_PATTERN)
  local j = {id = v[1], type = typ, queue = queue, prio = prio, max_attempts = max_attempts,
             created_iso = created_iso, state = state, version = version, attempt = attempt,
             updated = updated, run_at = run_at, run_at_iso = run_at_iso, cancel = cancel,
             worker = worker, wf = v[5] or '', error = v[ERROR_AT] or '',
             progress = v[PROGRESS_AT] or ''}
  read_deps(j, key)
  read_checkpoint(j, key)
  return v[2], render(j), v[8]
end

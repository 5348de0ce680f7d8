#!lua flags=no-writes
-- log_lag.lua: how many transitions of one shard's transition log wait for a consumer group
--   (the persisters', or the webhook dispatchers').
--   Not a transition: it neither includes lib.lua nor follows its KEYS[1]/ARGV[1] convention.
--   Counted from what the stream holds, not from XINFO GROUPS' `lag` alone: Redis 7.0 keeps
--   that from a per-group read counter which a restart from the AOF can leave stale (the
--   AOF records XREADGROUP as XCLAIM, without the counter; after a rewrite the counter is
--   reloaded as it was then), so `lag` can report thousands of entries in an empty stream.
--   Entries after the group's last-delivered id are counted one by one up to ARGV[2]; past
--   that Redis's `lag` is used, bounded by the entries that exist and are not pending.
--   An entry holds the transitions of one script call (lib.lua, write_log: its first field
--   'n' their number when more than one), up to 100 of them, and is read whole: the
--   undelivered ones read are counted exactly, the others at the mean of those read; the
--   pending ones at the mean of the oldest and the newest of them (an estimate: a count kept
--   beside the stream would make it exact). Atomic, so the group's cursor, its pending
--   entries and the count agree with each other.
--
-- KEYS[1]  a shard's log stream (jt:{s}:log)
-- ARGV[1]  the consumer group
-- ARGV[2]  undelivered entries counted exactly at most (each is read whole: its Redis CPU)
-- Returns  {transitions waiting (in pending and undelivered entries), id of the oldest
--           waiting entry or nil, 1 if the group exists on this log else 0}

local stream, group, exact = KEYS[1], ARGV[1], tonumber(ARGV[2])
local length = redis.call('XLEN', stream)
if length == 0 and redis.call('EXISTS', stream) == 0 then
  return {0, false, 0}
end

local function fields(flat)
  local f = {}
  for i = 1, #flat, 2 do f[flat[i]] = flat[i + 1] end
  return f
end

-- the transitions of an entry as XRANGE gives it ({id, {field, value, ...}})
local function transitions(entry)
  local f = entry[2]
  if f[1] == 'n' then
    return tonumber(f[2])
  end
  return 1
end

local info = nil
for _, g in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
  local f = fields(g)
  if f['name'] == group then info = f end
end
if info == nil then -- the group is not on this log (none of its members read it yet): all waits
  if length == 0 then return {0, false, 0} end
  local first = redis.call('XRANGE', stream, '-', '+', 'COUNT', exact)
  local counted = 0
  for _, e in ipairs(first) do counted = counted + transitions(e) end
  if length > #first then
    counted = counted + math.floor((length - #first) * counted / #first + 0.5)
  end
  return {counted, first[1][1], 0}
end
if length == 0 then
  return {0, false, 1}
end

local pending = redis.call('XPENDING', stream, group) -- {count, min id, max id, consumers}
local after = redis.call('XRANGE', stream, '(' .. info['last-delivered-id'], '+', 'COUNT', exact)
local undelivered = #after
if undelivered == exact then
  undelivered = length - pending[1] -- at most every entry that is not pending
  if info['lag'] and info['lag'] < undelivered then undelivered = info['lag'] end
  if undelivered < exact then undelivered = exact end
end
local oldest = pending[2]
if not oldest and after[1] then oldest = after[1][1] end
if not oldest then
  return {0, false, 1}
end
-- pending entries: at the mean of the oldest and the newest (a persister reads a batch
-- ahead at most); one trimmed meanwhile is left out of the mean
local counted = 0
if pending[1] > 0 then
  local n, found = 0, 0
  for _, id in ipairs(pending[2] == pending[3] and {pending[2]} or {pending[2], pending[3]}) do
    local e = redis.call('XRANGE', stream, id, id)[1]
    if e then
      n, found = n + transitions(e), found + 1
    end
  end
  counted = math.floor(pending[1] * (found > 0 and n / found or 1) + 0.5)
end
-- undelivered entries: those read one by one, the rest at their mean
local read = 0
for _, e in ipairs(after) do read = read + transitions(e) end
counted = counted + read
if undelivered > #after then
  counted = counted + math.floor((undelivered - #after) * read / #after + 0.5)
end
return {counted, oldest, 1}

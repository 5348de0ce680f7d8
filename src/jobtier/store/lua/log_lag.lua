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
--   undelivered ones read are counted exactly, the others at the mean of those read. Pending
--   entries: up to PENDING_READ of them counted exactly; of more, the oldest and the newest
--   exactly (held rows' claims, a batch in flight: often the odd ones out) and the ones
--   between at the mean of PENDING_READ - 2 read at even steps of their ids between those
--   two (an estimate: a count kept beside the stream would make it exact). Atomic, so the
--   group's cursor, its pending entries and the count agree with each other.
--
-- KEYS[1]  a shard's log stream (jt:{s}:log)
-- ARGV[1]  the consumer group
-- ARGV[2]  undelivered entries counted exactly at most (each is read whole: its Redis CPU)
-- ARGV[3]  pending entries read at most (4 if absent; 2: the oldest and the newest only,
--          the ones between at their mean); 0: the age only (below)
-- Returns  {transitions waiting (in pending and undelivered entries), id of the oldest
--           waiting entry or nil, 1 if the group exists on this log else 0}
--          With ARGV[3] 0, no count of transitions: the first value is the number of pending
--          entries, or 1 when only undelivered ones wait (the stream's length where the group
--          is not on it), 0 when none does (an entry trimmed while pending counts, where a
--          count holds it at 0); and no entry is read where one is pending (the oldest
--          pending entry, from XPENDING's summary, is older than any undelivered one: it was
--          delivered), else only the first undelivered one. Reading entries whole is what a
--          call costs: entries of 50 transitions, 20 pending and 20 undelivered on each of 16
--          shards, cost Redis about 5 ms a call for the age with two pending entries read,
--          13 ms for the count (a throwaway script, 2026-12-06).

local stream, group, exact = KEYS[1], ARGV[1], tonumber(ARGV[2])
local PENDING_READ = tonumber(ARGV[3]) or 4
local AGE_ONLY = PENDING_READ == 0
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

-- the transitions in the entry of this id (0: trimmed while pending: nothing to write)
local function held(id)
  local e = redis.call('XRANGE', stream, id, id)[1]
  return e and transitions(e) or 0
end

-- the id at fraction f of the way from id a to id b (their milliseconds, or their
-- sequence numbers within one millisecond)
local function between(a, b, f)
  local am, as = string.match(a, '^(%d+)-(%d+)$')
  local bm, bs = string.match(b, '^(%d+)-(%d+)$')
  if am == bm then
    return am .. '-' .. string.format('%.0f', as + math.floor((bs - as) * f))
  end
  return string.format('%.0f', am + math.floor((bm - am) * f)) .. '-0'
end

-- the transitions in the group's pending entries (XPENDING's summary)
local function pending_transitions(summary)
  local count, oldest, newest = summary[1], summary[2], summary[3]
  if count <= PENDING_READ then
    local n = 0
    for _, p in ipairs(redis.call('XPENDING', stream, group, '-', '+', count)) do
      n = n + held(p[1])
    end
    return n
  end
  local middle, read, seen = 0, 0, {[oldest] = true, [newest] = true}
  -- the first pending entry from `from` on not read yet, if any
  local function unread(from)
    for _, p in ipairs(redis.call('XPENDING', stream, group, from, '+', PENDING_READ)) do
      if not seen[p[1]] then
        return p[1]
      end
    end
  end
  for i = 1, PENDING_READ - 2 do
    -- from that step on; or, when every entry after it is read already (the ones between
    -- lie close after the oldest, as a burst's), from just after the oldest
    local id = unread(between(oldest, newest, i / (PENDING_READ - 1))) or unread('(' .. oldest)
    if id then
      seen[id] = true
      middle, read = middle + held(id), read + 1
    end
  end
  local ends = held(oldest) + held(newest)
  local mean = read > 0 and middle / read or ends / 2
  return ends + math.floor((count - 2) * mean + 0.5)
end

local info = nil
for _, g in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
  local f = fields(g)
  if f['name'] == group then info = f end
end
if info == nil then -- the group is not on this log (none of its members read it yet): all waits
  if length == 0 then return {0, false, 0} end
  local first = redis.call('XRANGE', stream, '-', '+', 'COUNT', AGE_ONLY and 1 or exact)
  if AGE_ONLY then return {length, first[1][1], 0} end
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
if AGE_ONLY then
  if pending[1] > 0 then
    return {pending[1], pending[2], 1}
  end
  local first = redis.call('XRANGE', stream, '(' .. info['last-delivered-id'], '+', 'COUNT', 1)
  return first[1] and {1, first[1][1], 1} or {0, false, 1}
end
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
local counted = 0
if pending[1] > 0 then
  counted = pending_transitions(pending)
end
-- undelivered entries: those read one by one, the rest at their mean
local read = 0
for _, e in ipairs(after) do read = read + transitions(e) end
counted = counted + read
if undelivered > #after then
  counted = counted + math.floor((undelivered - #after) * read / #after + 0.5)
end
return {counted, oldest, 1}

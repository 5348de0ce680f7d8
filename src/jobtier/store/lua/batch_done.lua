-- batch_done.lua: apply the shards' batch hand-offs (lib.lua batch_handoff) to the batch
-- records of this shard (the resolver sends them: flows/resolver.py).
--   running -> finished    every shard's share has finished: the callback job (if any) is
--                          created, once per batch, in this script, and a hand-off ('E')
--                          sent to expire the shards' counts
--   finished -> running    a retry brought a child back in a shard
--
-- KEYS[1]  shard log stream (routing)
-- ARGV[1]  shard key base, jt:{s}:
-- ARGV[2]  retention of finished jobs, s (a finished batch's record then expires)
-- ARGV[3]  number of hand-offs n, then 4 fields per hand-off: batch id, the source shard,
--          its state ('done' or 'open'), "<epoch> <succeeded> <failed> <cancelled>"
-- Returns  per hand-off: OK, DUPLICATE (an epoch applied before), NOT_FOUND (no such batch)
-- A shard's state is kept with the epoch of the hand-off that set it ('e:<shard>'), and
-- only a later epoch changes it: a hand-off delivered twice, or taken over from a resolver
-- that died after a later one of the same shard was applied, changes nothing.
--!include lib.lua

local ttl, n = ARGV[2], tonumber(ARGV[3])
local out = {}

local function complete(bid, rec)
  local v = redis.call('HMGET', rec, 'tenant', 'shards', 'cb', 'cbid', 'cbp', 'cbdone', 'tp',
                       'total', 'prio')
  local s, f, c = 0, 0, 0
  local fields = {}
  for shard in string.gmatch(v[2] or '', '%d+') do
    fields[#fields + 1] = 'c:' .. shard
  end
  if #fields > 0 then
    for _, counts in ipairs(redis.call('HMGET', rec, unpack(fields))) do
      local a, b, d = string.match(counts or '', '^(%-?%d+) (%-?%d+) (%-?%d+)$')
      s, f, c = s + (tonumber(a) or 0), f + (tonumber(b) or 0), c + (tonumber(d) or 0)
    end
  end
  redis.call('HSET', rec, 'state', 'finished', 'fin', NOW_STR)
  local ctype, cqueue, attempts = string.match(v[3] or '', '^(%S+) (%S+) (%d+)$')
  if ctype and v[6] ~= '1' then
    local payload = '{"batch_id":' .. cjson.encode(bid) .. ',"total":' .. (v[8] or 0)
      .. ',"succeeded":' .. s .. ',"failed":' .. f .. ',"cancelled":' .. c
      .. ',"payload":' .. raw_or_null(v[5] or '') .. '}'
    create_job(v[4], v[1], ctype, cqueue, v[9] or 'normal', payload, attempts, '', '',
               'batch', '', 1, nil, v[7])
    redis.call('HSET', rec, 'cbdone', '1')
  end
  redis.call('EXPIRE', rec, ttl)
  -- the shards' counts were kept while any shard could still reopen: now they may expire
  -- (batch_expire.lua in each, by the resolver; a retry before then keeps them)
  handoff('E', bid, 'done', v[2] or '', bid)
end

for i = 0, n - 1 do
  local a = 4 + i * 4
  local bid, shard, state, data = ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3]
  local rec = BASE .. 'batch:' .. bid
  local v = redis.call('HMGET', rec, 'tenant', 'e:' .. shard, 'st:' .. shard)
  local code = OK
  local e, counts = string.match(data, '^(%d+) (.*)$')
  if not v[1] then
    code = NOT_FOUND
  elseif not e or tonumber(e) <= tonumber(v[2] or '0') then
    code = DUPLICATE
  else
    redis.call('HSET', rec, 'e:' .. shard, e, 'c:' .. shard, counts, 'st:' .. shard, state)
    local was = v[3] or 'open'
    if was ~= state then
      local open = redis.call('HINCRBY', rec, 'open', state == 'done' and -1 or 1)
      if open == 0 then
        complete(bid, rec)
      elseif state == 'open' and open == 1 then
        redis.call('HSET', rec, 'state', 'running')
        redis.call('PERSIST', rec)
      end
    end
  end
  out[#out + 1] = code
end
flush()
return out

-- claim.lua: lease up to `count` ready jobs of one shard to a worker (queued -> running).
--
-- KEYS[1]  shard log stream (routing)
-- ARGV[1]  shard key base, jt:{s}:
-- ARGV[2]  worker id
-- ARGV[3]  count: most jobs to claim
-- ARGV[4]  lease, ms
-- Returns  {now ms, ready jobs left in the shard,
--           then per job: id, type, payload, attempt, max_attempts, lease_version, queued at ms}
--
-- Priorities are served by a smooth weighted rotation, critical:high:normal:low = 8:4:2:1, kept
-- in jt:{s}:wrr across calls. A turn whose queue is empty goes to the highest non-empty one,
-- so low gets at least one claim in 15 however many higher jobs wait, and nothing idles while
-- work is ready. Within a priority the oldest job goes first (LPUSH at submit, RPOP here).
--!include lib.lua

local ROTATION = {1, 2, 1, 3, 1, 2, 1, 4, 1, 2, 1, 3, 1, 2, 1}
local worker, count, lease = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local queues, lens, left = {}, {}, 0
for i, p in ipairs(PRIORITIES) do
  queues[i] = BASE .. 'q:' .. p
  lens[i] = redis.call('LLEN', queues[i])
  left = left + lens[i]
end
local start = tonumber(redis.call('GET', BASE .. 'wrr') or '0')
local cursor = start
local out = {NOW, 0}
local claimed = 0
local deadline = NOW + lease
-- leases go into the active set in one ZADD per 1,000 jobs rather than one per job (each
-- redis.call has a fixed cost; unpack() stays far below Lua's C-stack limit)
local active = {}
local function add_active()
  if #active > 0 then
    redis.call('ZADD', BASE .. 'active', unpack(active))
    active = {}
  end
end
-- Each pass plans its turns first (which priority serves each), then pops every priority's
-- share with one RPOP <count>: the same jobs as popping turn by turn, in a quarter of the
-- calls. A second pass runs only if a popped id was not a claimable job.
while claimed < count and left > 0 do
  local take = {0, 0, 0, 0}
  for _ = 1, math.min(count - claimed, left) do
    local pick = ROTATION[cursor % 15 + 1]
    cursor = cursor + 1
    if lens[pick] == 0 then
      for i = 1, 4 do
        if lens[i] > 0 then
          pick = i
          break
        end
      end
    end
    take[pick] = take[pick] + 1
    lens[pick] = lens[pick] - 1
    left = left - 1
  end
  for i = 1, 4 do
    local ids = take[i] > 0 and redis.call('RPOP', queues[i], take[i]) or {}
    for _, id in ipairs(ids) do
      local j = load(id)
      -- a queue holds only queued jobs (cancel and expiry remove them); the check guards
      -- the invariant rather than trusting it
      if j and j.state == 'queued' then
        local queued_at = j.updated
        j.state = 'running'
        j.attempt = int(tonumber(j.attempt) + 1)
        j.worker = worker
        j.lease_version = int(tonumber(j.version) + 1)
        commit(j, 'queued', worker)
        active[#active + 1], active[#active + 2] = deadline, id
        if #active >= 2000 then
          add_active()
        end
        local payload = redis.call('HGET', job_key(id), 'payload')
        local k = #out
        out[k + 1], out[k + 2], out[k + 3], out[k + 4] = id, j.type, payload, j.attempt
        out[k + 5], out[k + 6], out[k + 7] = j.max_attempts, j.lease_version, queued_at
        claimed = claimed + 1
      end
    end
  end
end
add_active()
-- unchanged when nothing was claimed: an idle worker's empty claims then write nothing
-- (no AOF entry, no replication)
if cursor ~= start then
  redis.call('SET', BASE .. 'wrr', cursor % 15015)
end
out[2] = left
return out

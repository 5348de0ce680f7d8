-- unmark.lua: remove tenants' webhook marks (webhooks/marks.py), each only if it still holds
--   the value the caller read before it asked Postgres whether the tenant has targets.
--   Not a transition: it neither includes lib.lua nor follows its KEYS[1]/ARGV[1] convention.
--   Why a script: a mark written again after that read (a target being created) holds a
--   new value and must stay; compared and deleted in one atomic step, no HSET can fall
--   between the check and the HDEL.
--
-- KEYS[1]  the marks hash (jt:webhook-tenants)
-- ARGV     tenant, value read, tenant, value read, ...
-- Returns  how many marks were removed

local removed = 0
for i = 1, #ARGV, 2 do
  if redis.call('HGET', KEYS[1], ARGV[i]) == ARGV[i + 1] then
    removed = removed + redis.call('HDEL', KEYS[1], ARGV[i])
  end
end
return removed

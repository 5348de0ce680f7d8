#!lua flags=no-writes
-- lag_shared.lua: the persisters' lag as one process counted it, and how long it stays
--   current (streams/group.py, shared_lag). One read-only call, as log_lag.lua's are, so a
--   Redis Cluster node that is away fails it at once (a client pipeline's GET and PTTL were
--   sent again for a second and a half first).
--   Not a transition: it neither includes lib.lua nor follows its KEYS[1]/ARGV[1] convention.
--
-- KEYS[1]  the count's key (streams/group.py, lag_key)
-- Returns  {its value, or false when it holds none or not a string; the milliseconds it
--           stays current (PTTL: -2 when there is none, -1 when it never expires)}

if redis.call('TYPE', KEYS[1])['ok'] ~= 'string' then
  return {false, -2}
end
return {redis.call('GET', KEYS[1]), redis.call('PTTL', KEYS[1])}

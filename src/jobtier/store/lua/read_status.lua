#!lua flags=no-writes
-- read_status.lua: the tenant and status document of many jobs in one call (read-only).
--   The status reader's batched load: one script call reads every job hash of a batch, where
--   a pipeline of HMGETs would cost the client a parsed reply object per command. A job hash
--   stores no document: render.lua's status_of renders it from the job's fields ('t' and
--   'c'). Not a transition: its KEYS are job hashes, not a log stream, and it writes nothing.
--   It includes render.lua only, not lib.lua, whose top level (the shard's clock, its tables
--   and functions) every call would pay for.
--   `no-writes` (the shebang line above): it declares that it only reads, so Redis refuses
--   any write in it and runs it wherever plain reads may run (a replica, a server that
--   refuses writes for lack of memory under noeviction).
--
-- KEYS[1..n]  job hashes (jt:{s}:job:<id>). On a Redis Cluster they must share one hash tag
--             (one call per shard); on a single server one call may span every shard.
-- ARGV[1]     one more field to read of each job ('' for none: 'payload', 'result')
-- Returns     a flat array: tenant, status document (then the field, when ARGV[1] names one)
--             of each key in order; nils for a job Redis does not hold (or no longer holds).
--!include render.lua

local more = ARGV[1] ~= '' and ARGV[1] or nil
local stride = more and 3 or 2
local out = {}
for i = 1, #KEYS do
  local tenant, doc, value = status_of(KEYS[i], more)
  -- false goes back to the client as nil
  local at = (i - 1) * stride
  out[at + 1], out[at + 2] = tenant or false, doc or false
  if more then
    out[at + 3] = value or false
  end
end
return out

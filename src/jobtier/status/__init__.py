"""The status tier: the near cache, per-tick coalescing (the singleflight of the read path)
and the Postgres fallback composed by the StatusReader (reader.py); the one answer to a
status read (answer.py), which the route and the raw-ASGI fast path (fastpath.py) send."""

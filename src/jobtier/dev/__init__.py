"""Development servers: a local Redis (or Redis Cluster), a local Postgres, and `jobtier run`.

Nothing here is on the production path: `jobtier run` and the tests use it; deployments run
each part as its own process against servers they manage themselves.
"""

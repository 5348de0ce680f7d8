"""What names may be: task types, queues, tenants, keys, schedules, flow refs and ids.

Names go into Redis keys (``jt:{s}:q:<queue>:<priority>:<tenant>``) and log lines, so each is
a bounded run of safe characters; every check of a caller's name uses one of these.
"""

from __future__ import annotations

import re

TASK_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:-]{0,127}$")
# no ':' in a queue or tenant: both are parts of keys
QUEUE_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
TENANT_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
# idempotency and concurrency keys: printable ASCII, no spaces
IDEMPOTENCY_KEY_RE = re.compile(r"^[\x21-\x7e]{1,200}$")
SCHEDULE_NAME_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,100}$")
REF_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")  # a job's name within its flow
ULID_RE = re.compile(r"^[0-9A-HJKMNP-TV-Z]{26}$")  # schedule and audit ids
JOB_ID_RE = re.compile(r"^[0-9A-HJKMNP-TV-Z]{26}-(0|[1-9][0-9]{0,3})$")  # <ULID>-<shard>
WEBHOOK_ID_RE = re.compile(r"^wh_[0-9A-HJKMNP-TV-Z]{26}$")
# an HTTP worker's id in Redis is its name after this (api/worker_routes.py)
HTTP_WORKER_PREFIX = "http:"

# what the audit records an admin action as (api/audit.py: audited), each once: the API's
# audit listing refuses another name, the CLI offers these (a unit test holds them to the code)
AUDIT_ACTIONS = (
    "job.cancel", "job.promote", "job.replay", "dead_letters.replay", "queue.pause",
    "queue.resume", "queue.unblock", "queue.limits", "queue.purge", "breaker.open",
    "breaker.close",
    # a tenant's changes to its schedules (api/schedules.py)
    "schedule.create", "schedule.change", "schedule.pause", "schedule.resume",
    "schedule.delete", "schedule.run",
)  # fmt: skip

"""One frozen Settings object, built from the environment.

Nothing else in jobtier reads ``os.environ``: processes build ``Settings.from_env()`` once and
pass it (or the parts they need) down through constructors. Every field is declared with its
environment variable and a one-line meaning; ``settings_table()`` renders them for the README
and ``jobtier config`` prints the values in effect.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from jobtier.config_bounds import bound_problems
from jobtier.core.errors import ConfigError
from jobtier.core.sealing import Keyring, settings_problems

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "WARN", "ERROR", "CRITICAL", "FATAL", "NOTSET")

ENV_PREFIX = "JOBTIER_"
WAIT_MARGIN = 1.0  # seconds a socket timeout must leave past the longest WAIT it carries


def _setting(default: Any, help: str, *, env: str | None = None, secret: bool = False) -> Any:
    return field(default=default, metadata={"help": help, "env": env, "secret": secret})


@dataclass(frozen=True, slots=True)
class Settings:
    # --- Redis -----------------------------------------------------------------------------
    redis_url: str = _setting(
        "redis://127.0.0.1:6379/0",
        "Redis URL (one node of the cluster when JOBTIER_REDIS_CLUSTER=1).",
    )
    redis_cluster: bool = _setting(False, "Talk to a Redis Cluster instead of a single server.")
    redis_sentinels: str = _setting(
        "",
        "Sentinels that name the master (host:port,…): a single master with replicas that "
        "fails over. JOBTIER_REDIS_URL then gives only the database, user and password, "
        "and with rediss:// TLS (to the master and the sentinels).",
    )
    redis_sentinel_master: str = _setting(
        "mymaster", "The master's name in the sentinels' configuration (`sentinel monitor`)."
    )
    redis_require_aof: bool = _setting(
        True, "Refuse to start unless Redis has AOF on (acknowledged jobs must survive a restart)."
    )
    redis_max_connections: int = _setting(
        64, "Connections per process (per node of a cluster); callers past it wait their turn."
    )
    redis_socket_timeout: float = _setting(
        5.0,
        "Seconds a Redis command waits for its reply before it fails (and is retried): a master "
        "gone silent (host down, network cut) fails calls instead of hanging them. At least "
        "JOBTIER_SUBMIT_REPLICAS_TIMEOUT_MS plus 1 s (a durable submit's WAIT blocks that long).",
    )
    prefix: str = _setting("jt", "Prefix of every Redis key and channel.")
    shards: int = _setting(
        16, "Logical shards. Fixed for the life of a deployment: job ids carry their shard."
    )

    # --- Jobs ------------------------------------------------------------------------------
    default_max_attempts: int = _setting(3, "Attempts for a job whose submit and task name none.")
    require_known_types: bool = _setting(
        True,
        "Refuse (422) a submit whose type no live or recently seen worker runs; 0 accepts jobs "
        "before their workers start.",
    )
    task_catalog_ttl: int = _setting(
        86400,
        "Seconds a worker's advertised task counts as known after it was last advertised (a "
        "Python worker's at each full heartbeat; an HTTP worker's at each PUT /v1/worker/tasks).",
    )
    lease_seconds: float = _setting(
        30.0,
        "A claimed job's lease; a worker heartbeats every third of it. Give every part the "
        "same: a scheduler looks at leases as if all were its own (one shorter is reclaimed "
        "up to 5 s late).",
    )
    retention_seconds: int = _setting(
        86400, "How long finished (succeeded/cancelled) jobs stay in Redis; Postgres keeps them."
    )
    dead_retention_seconds: int = _setting(
        7 * 86400,
        "How long failed jobs stay in Redis's dead-letter set before only Postgres has them.",
    )
    idempotency_ttl_seconds: int = _setting(86400, "How long an idempotency key is remembered.")
    max_payload_bytes: int = _setting(256 * 1024, "Largest accepted job payload (encoded JSON).")
    max_result_bytes: int = _setting(1024 * 1024, "Largest result a task may return.")
    checkpoint_max_bytes: int = _setting(
        64 * 1024, "Largest state a task may save with ctx.checkpoint, as JSON bytes."
    )
    max_batch: int = _setting(1000, "Most jobs in one batch submit.")
    max_future_seconds: int = _setting(
        366 * 86400, "Furthest run-at (or delay) accepted at submit."
    )
    past_tolerance_seconds: float = _setting(
        300.0, "A run-at this far in the past is accepted as 'now'; older is refused."
    )

    max_flow_jobs: int = _setting(
        10_001,
        "Most jobs in one flow (POST /v1/flows), and most dependencies of one job.",
    )
    flow_link_timeout_seconds: float = _setting(
        60.0,
        "A dependent whose submit was cut short before it linked its dependencies is linked by "
        "the resolver this long after its creation (a missing dependency then cancels it).",
    )
    resolver_claim_idle_seconds: float = _setting(
        10.0,
        "Flow hand-offs a resolver took and has not acknowledged for this long are taken over "
        "by another (it died mid-resolution); also how often a resolver looks for them.",
    )

    cron_misfire_grace_seconds: float = _setting(
        60.0, "A schedule's slot later than this counts as missed (its misfire policy applies)."
    )
    min_schedule_interval: int = _setting(1, "Shortest interval (seconds) a schedule may have.")

    # --- HTTP API --------------------------------------------------------------------------
    api_host: str = _setting(
        "127.0.0.1",
        "Address the API listens on (an IP address under granian; a name too under uvicorn).",
    )
    api_port: int = _setting(8000, "Port the API listens on.")
    api_workers: int = _setting(1, "API server processes.")
    api_server: str = _setting("granian", "ASGI server: granian or uvicorn.")
    api_keys: str = _setting("", "Tenant keys: 'key1:tenant1,key2:tenant2'.", secret=True)
    admin_key: str = _setting("", "Key for the admin routes.", secret=True)
    worker_keys: str = _setting(
        "",
        "HTTP workers' keys, for the /v1/worker routes: 'key1,key2' (none: no HTTP worker is "
        "let in, those routes answer every request with a 401 or 403). A tenant's or the admin "
        "key is a 403 there, any other key a 401.",
        secret=True,
    )
    rate_limit_per_second: float = _setting(
        0.0, "Per-tenant submit rate limit in jobs/s per API process (0: unlimited)."
    )
    max_waiting_per_tenant: int = _setting(
        0, "Per-tenant cap on jobs not started yet: waiting, scheduled, queued (0: unlimited)."
    )
    max_waiting_total: int = _setting(
        5_000_000, "Global back-pressure: submit answers 503 past this many waiting jobs."
    )
    shed_waiting_total: int = _setting(
        0,
        "Load shedding: past this many waiting jobs, submits of JOBTIER_SHED_PRIORITIES answer "
        "503; the others go on up to JOBTIER_MAX_WAITING_TOTAL (0: off).",
    )
    shed_priorities: str = _setting(
        "normal,low", "The priorities shed past JOBTIER_SHED_WAITING_TOTAL, comma-separated."
    )
    submit_replicas: int = _setting(
        0,
        "Durable submit: a submit is acknowledged only once its writes reached this many Redis "
        "replicas (WAIT), else 503; a request's Jobtier-Replicas header overrides it (0: off).",
    )
    submit_replicas_timeout_ms: int = _setting(
        500, "How long a durable submit waits for its replicas before answering 503 (ms)."
    )
    redis_memory_warn_ratio: float = _setting(
        0.8, "Log a warning while Redis's used_memory / maxmemory is past this (0 < r <= 1)."
    )
    redis_memory_refuse_ratio: float = _setting(
        0.9,
        "Submit answers 503 while Redis's used_memory / maxmemory is past this (0 < r <= 1): "
        "before Redis itself refuses every write (noeviction), jobs already accepted included.",
    )
    near_cache: bool = _setting(True, "Serve status from the per-process near cache.")
    near_cache_size: int = _setting(100_000, "Most status documents in the near cache.")
    near_cache_ttl: float = _setting(
        2.0, "Safety-net lifetime of a near-cache entry whose freshness events could be missed."
    )
    near_cache_final_ttl: float = _setting(
        3600.0,
        "Lifetime of a near-cache entry in a terminal state, stored while the status events' "
        "subscriptions were live (a terminal job changes only by a replay, which publishes); "
        "the cache's size bounds it too.",
    )
    coalesce: bool = _setting(True, "Merge the status loads of one event-loop tick into one batch.")
    max_request_bytes: int = _setting(
        8 * 1024 * 1024, "Largest request body, on any route (a batch submit is the largest)."
    )
    gc_freeze: bool = _setting(
        True, "Freeze start-up objects out of the garbage collector (shorter GC pauses)."
    )
    long_poll_max_seconds: float = _setting(
        60.0, "Longest ?wait= accepted on status reads, and longest wait of an HTTP worker's claim."
    )
    sse_heartbeat_seconds: float = _setting(15.0, "Interval of SSE heartbeat comments.")

    # --- Postgres and write-behind ----------------------------------------------------------
    database_url: str = _setting(
        "postgresql://jobtier@127.0.0.1:5432/jobtier", "Postgres DSN.", secret=True
    )
    persist_batch_size: int = _setting(
        8000,
        "Most transitions written per Postgres transaction. A batch is written once it is full "
        "or has waited JOBTIER_PERSIST_INTERVAL; while every connection is busy it gathers on, "
        "up to this many, and the larger it grows, the more of its jobs' claims are written "
        "with their end, in one row.",
    )
    persist_interval: float = _setting(0.05, "Longest wait before a partial batch is written.")
    persist_concurrency: int = _setting(2, "Batches a persister writes to Postgres at once.")
    persist_hold_seconds: float = _setting(
        0.0,
        "A live job's row (a claim, a retry) waits this long for a newer version to take its "
        "place before it is written to Postgres (0: at once; at most half of "
        "JOBTIER_PERSIST_CLAIM_IDLE_SECONDS); its history never waits. Its entries count in "
        "the lag meanwhile.",
    )
    persist_claim_idle_seconds: float = _setting(
        30.0, "Pending log entries idle this long are taken over from a dead persister."
    )
    persist_max_lag: int = _setting(
        1_000_000, "Submit answers 503 once this many transitions wait for Postgres."
    )
    progress_history_seconds: float = _setting(
        10.0,
        "A progress-only change enters a job's history at most this often (0: every one); "
        "state changes and cancel requests always do, and the status document sees each.",
    )
    pg_history_retention_days: int = _setting(
        30, "Days of job history (job_transitions) Postgres keeps, by whole days (0: forever)."
    )
    pg_history_detach: bool = _setting(
        False,
        "Detach expired history partitions instead of dropping them (you archive and drop them).",
    )
    pg_job_retention_days: int = _setting(
        30, "Days Postgres keeps a finished job after it finished (0: forever); others stay."
    )
    prune_interval_seconds: float = _setting(
        3600.0, "How often a persister prunes Postgres and creates history partitions ahead."
    )
    reconcile_seconds: float = _setting(
        5.0,
        "How often a persister compares Redis's run ids with the last it saw; on a change (a "
        "failover, a restart without data) it runs `jobtier reconcile` (0: never).",
    )
    reconcile_window_seconds: int = _setting(
        900, "The jobs a persister's reconcile pass compares: those Postgres changed this recently."
    )
    outbox_relay: bool = _setting(
        True,
        "Run the outbox relay (jobs of SELECT jobtier.submit(...) into Redis) in each persister "
        "(docs/outbox.md); 0 turns it off.",
    )
    outbox_batch_size: int = _setting(500, "Most outbox rows the relay submits per transaction.")
    outbox_poll_seconds: float = _setting(
        1.0, "Longest wait of the outbox relay between reads when no notification comes."
    )

    # --- Webhooks (jobtier dispatcher) -------------------------------------------------------
    webhook_allowed_hosts: str = _setting(
        "",
        "Callback hosts exempt from the address check (comma-separated host names, IPs or "
        "CIDR networks), e.g. 127.0.0.1 for a development receiver; others may not resolve to "
        "a loopback, private, link-local, metadata or otherwise non-public address.",
    )
    webhook_timeout_seconds: float = _setting(
        15.0, "A delivery attempt's time limit (connect, send, answer), in seconds."
    )
    webhook_max_response_bytes: int = _setting(
        65536,
        "Most bytes of a receiver's answer read (the rest is dropped, the connection closed).",
    )
    webhook_retry_schedule: str = _setting(
        "5,300,1800,7200,18000,36000,50400,72000,86400",
        "Seconds before each retry of a failed delivery, comma-separated (±10 % jitter; a "
        "Retry-After answer may lengthen one); after the last the delivery has failed.",
    )
    webhook_concurrency: int = _setting(64, "Delivery attempts a dispatcher has in flight at once.")
    webhook_secret_overlap_seconds: int = _setting(
        86400,
        "After a secret rotation, deliveries are signed with the previous secret too this long.",
    )
    webhook_unmark_interval_seconds: float = _setting(
        300.0,
        "How often a dispatcher unmarks the tenants left without a webhook target, whose "
        "transitions then skip the target look-up; a mark younger than this stays. 0: never.",
    )

    # --- Results kept outside Redis ---------------------------------------------------------
    result_store: str = _setting(
        "",
        "Where results over JOBTIER_RESULT_STORE_THRESHOLD_BYTES are kept instead of Redis: '' "
        "(none: every result stays in Redis) or 'postgres' (JOBTIER_DATABASE_URL: workers then "
        "connect to Postgres).",
    )
    result_store_threshold_bytes: int = _setting(
        65536, "Results larger than this go to JOBTIER_RESULT_STORE (when one is set)."
    )

    # --- Encryption at rest (docs/encryption.md) -------------------------------------------
    encryption_keys: str = _setting(
        "",
        "Keys that encrypt payloads and results at rest: 'kid1:base64key,kid2:base64key' "
        "(AES-GCM, 16, 24 or 32 bytes each); the first encrypts, every one decrypts.",
        secret=True,
    )
    decryption_keys: str = _setting(
        "",
        "Keys that only decrypt, as JOBTIER_ENCRYPTION_KEYS: a new key goes here on every "
        "process first, then becomes the first encryption key (docs/encryption.md, rotation).",
        secret=True,
    )
    encrypted_queues: str = _setting(
        "",
        "Queues whose jobs' payloads and results are encrypted (comma-separated); a task "
        "opts in alone with @task(encrypt=True). Needs JOBTIER_ENCRYPTION_KEYS.",
    )

    # --- Operations ------------------------------------------------------------------------
    metrics_public: bool = _setting(
        False, "Serve /metrics without the admin key (for scrapers on a private network)."
    )
    otel: bool = _setting(
        False,
        "Trace with OpenTelemetry: the jobtier roles set up a tracer provider from the OTEL_* "
        "settings (needs jobtier[otel]; see the tracing page).",
    )
    otel_exporter: str = _setting(
        "otlp",
        "Where JOBTIER_OTEL=1 sends spans: otlp (to OTEL_EXPORTER_OTLP_ENDPOINT; needs "
        "jobtier[otlp]), console (stdout), none, or an exporter package's name; comma-separated.",
        env="OTEL_TRACES_EXPORTER",
    )
    otel_service_name: str = _setting(
        "",
        "The service name of the spans under JOBTIER_OTEL=1 ('': jobtier-<role>).",
        env="OTEL_SERVICE_NAME",
    )
    log_level: str = _setting("INFO", "Log level: DEBUG, INFO, WARNING, ERROR or CRITICAL.")
    log_format: str = _setting("text", "Log format: text (key=value) or json.")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Build Settings from ``JOBTIER_*`` variables; ``overrides`` win over the environment."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            name = env_name(f)
            if f.name in overrides:
                values[f.name] = overrides.pop(f.name)
            elif name in env:
                values[f.name] = _parse(f, env[name])
        if overrides:
            raise ConfigError(f"unknown settings: {', '.join(sorted(overrides))}")
        settings = cls(**values)
        settings.validate()
        return settings

    def replace(self, **changes: Any) -> Settings:
        new = dataclasses.replace(self, **changes)
        new.validate()
        return new

    def sentinel_addresses(self) -> list[tuple[str, int]]:
        """JOBTIER_REDIS_SENTINELS as (host, port) pairs; ValueError when malformed."""
        pairs = []
        for item in self.redis_sentinels.split(","):
            host, _, port = item.strip().rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"not host:port: {item!r}")
            pairs.append((host.strip("[]"), int(port)))
        return pairs

    def validate(self) -> None:
        problems = self._server_problems()
        if not 1 <= self.shards <= 4096:
            problems.append("JOBTIER_SHARDS must be between 1 and 4096")
        if self.lease_seconds < 1:
            problems.append("JOBTIER_LEASE_SECONDS must be at least 1")
        if self.redis_sentinels:
            if self.redis_cluster:
                problems.append(
                    "JOBTIER_REDIS_SENTINELS and JOBTIER_REDIS_CLUSTER=1 exclude each other: a "
                    "Redis Cluster fails over by itself"
                )
            try:
                self.sentinel_addresses()
            except ValueError:
                problems.append(
                    "JOBTIER_REDIS_SENTINELS must be comma-separated host:port pairs, "
                    "e.g. 10.0.0.1:26379,10.0.0.2:26379"
                )
            if not self.redis_url.lower().startswith(("redis://", "rediss://")):
                problems.append(
                    "with JOBTIER_REDIS_SENTINELS, JOBTIER_REDIS_URL must be redis:// (or "
                    "rediss:// for TLS): the sentinels name the master's host and port"
                )
        if self.redis_cluster and not self.redis_url.lower().startswith(("redis://", "rediss://")):
            problems.append(
                "with JOBTIER_REDIS_CLUSTER=1, JOBTIER_REDIS_URL must be redis:// (or rediss:// "
                "for TLS): a cluster's nodes are reached by host and port, not a Unix socket"
            )
        if not 0 <= self.submit_replicas <= 999:
            problems.append("JOBTIER_SUBMIT_REPLICAS must be from 0 (off) to 999")
        if not 1 <= self.submit_replicas_timeout_ms <= 60_000:
            problems.append("JOBTIER_SUBMIT_REPLICAS_TIMEOUT_MS must be from 1 to 60000")
        if self.redis_socket_timeout < self.submit_replicas_timeout_ms / 1000 + WAIT_MARGIN:
            problems.append(
                "JOBTIER_REDIS_SOCKET_TIMEOUT must be at least JOBTIER_SUBMIT_REPLICAS_TIMEOUT_MS "
                f"+ {WAIT_MARGIN:g} s (a durable submit's WAIT blocks on its connection that long)"
            )
        if self.default_max_attempts < 1:
            problems.append("JOBTIER_DEFAULT_MAX_ATTEMPTS must be at least 1")
        if self.api_server not in ("granian", "uvicorn"):
            problems.append("JOBTIER_API_SERVER must be granian or uvicorn")
        days = ("pg_history_retention_days", "pg_job_retention_days")
        for name in ("progress_history_seconds", *days):
            if getattr(self, name) < 0:
                problems.append(f"JOBTIER_{name.upper()} must be 0 (see its help) or more")
        keep = self.pg_job_retention_days * 86400
        if 0 < keep < max(self.retention_seconds, self.dead_retention_seconds):
            # Postgres would forget a job Redis still serves (a dead letter can be replayed)
            problems.append(
                "JOBTIER_PG_JOB_RETENTION_DAYS must cover JOBTIER_RETENTION_SECONDS and "
                "JOBTIER_DEAD_RETENTION_SECONDS (or be 0: forever)"
            )
        if self.max_flow_jobs < 1:
            problems.append("JOBTIER_MAX_FLOW_JOBS must be at least 1")
        if self.flow_link_timeout_seconds <= 0:
            problems.append("JOBTIER_FLOW_LINK_TIMEOUT_SECONDS must be more than 0")
        if self.resolver_claim_idle_seconds <= 0:
            problems.append("JOBTIER_RESOLVER_CLAIM_IDLE_SECONDS must be more than 0")
        for name in ("redis_memory_warn_ratio", "redis_memory_refuse_ratio"):
            if not 0 < getattr(self, name) <= 1:
                problems.append(f"JOBTIER_{name.upper()} must be more than 0 and at most 1")
        if self.checkpoint_max_bytes < 2:
            problems.append("JOBTIER_CHECKPOINT_MAX_BYTES must be at least 2")
        if not 0 <= self.shed_waiting_total <= self.max_waiting_total:
            problems.append(
                "JOBTIER_SHED_WAITING_TOTAL must be 0 (off) or at most JOBTIER_MAX_WAITING_TOTAL"
            )
        if not self.shed_priority_set() <= {"critical", "high", "normal", "low"}:
            problems.append(
                "JOBTIER_SHED_PRIORITIES must name priorities among critical, high, normal, low"
            )
        if self.prune_interval_seconds < 1:
            problems.append("JOBTIER_PRUNE_INTERVAL_SECONDS must be at least 1")
        try:
            self.webhook_retry_delays()
        except ValueError:
            problems.append(
                "JOBTIER_WEBHOOK_RETRY_SCHEDULE must be comma-separated non-negative seconds"
            )
        if self.webhook_unmark_interval_seconds < 0:
            problems.append("JOBTIER_WEBHOOK_UNMARK_INTERVAL_SECONDS must be 0 (never) or more")
        if self.webhook_timeout_seconds <= 0 or self.webhook_concurrency < 1:
            problems.append(
                "JOBTIER_WEBHOOK_TIMEOUT_SECONDS must be positive and "
                "JOBTIER_WEBHOOK_CONCURRENCY at least 1"
            )
        if self.result_store not in ("", "postgres"):
            problems.append("JOBTIER_RESULT_STORE must be '' (none) or 'postgres'")
        if self.log_format not in ("text", "json"):
            problems.append("JOBTIER_LOG_FORMAT must be text or json")
        if not self.prefix or any(c in self.prefix for c in "{} "):
            problems.append("JOBTIER_PREFIX must be non-empty, without braces or spaces")
        try:
            tenants = self.tenant_keys()
        except ConfigError as exc:
            problems.append(str(exc))
            tenants = {}
        problems.extend(self._worker_key_problems(tenants))
        problems.extend(bound_problems(self))
        problems.extend(
            settings_problems(
                self.encryption_keys, self.decryption_keys, self.encrypted_queue_names()
            )
        )
        if problems:
            raise ConfigError("; ".join(problems))

    def _server_problems(self) -> list[str]:
        """What no process could start with: where it listens, connects and logs."""
        problems = []
        if not self.redis_url.lower().startswith(("redis://", "rediss://", "unix://")):
            problems.append(
                "JOBTIER_REDIS_URL must start with redis://, rediss:// (TLS) or unix://"
            )
        if self.redis_max_connections < 1:
            problems.append("JOBTIER_REDIS_MAX_CONNECTIONS must be at least 1")
        if not 0 <= self.api_port <= 65535:  # (0: any free one, as tests let the OS pick)
            problems.append("JOBTIER_API_PORT must be a port, 1 to 65535")
        if self.api_workers < 1:
            problems.append("JOBTIER_API_WORKERS must be at least 1")
        if self.log_level.upper() not in LOG_LEVELS:
            problems.append(f"JOBTIER_LOG_LEVEL must be one of {', '.join(LOG_LEVELS)}")
        return problems

    def shed_priority_set(self) -> frozenset[str]:
        """The priorities load shedding refuses first (JOBTIER_SHED_PRIORITIES)."""
        return frozenset(p.strip() for p in self.shed_priorities.split(",") if p.strip())

    def tenant_keys(self) -> dict[str, str]:
        """API key -> tenant, parsed from ``api_keys``."""
        keys: dict[str, str] = {}
        for item in filter(None, (p.strip() for p in self.api_keys.split(","))):
            key, sep, tenant = item.partition(":")
            if not sep or not key or not tenant:
                raise ConfigError(f"JOBTIER_API_KEYS entry {item[:4]}… is not 'key:tenant'")
            if keys.setdefault(key, tenant) != tenant:  # the last would win: one for another
                raise ConfigError(f"JOBTIER_API_KEYS gives key {key[:4]}… to two tenants")
        if self.admin_key and self.admin_key in keys:
            raise ConfigError("JOBTIER_ADMIN_KEY is also a tenant's key in JOBTIER_API_KEYS")
        return keys

    def worker_key_list(self) -> list[str]:
        """The HTTP workers' keys, parsed from ``worker_keys``."""
        return [k for k in (p.strip() for p in self.worker_keys.split(",")) if k]

    def _worker_key_problems(self, tenants: dict[str, str]) -> list[str]:
        # a key that is both would let a tenant's key run (and answer for) any job
        workers = set(self.worker_key_list())
        problems = []
        if workers & tenants.keys():
            problems.append("JOBTIER_WORKER_KEYS and JOBTIER_API_KEYS share a key")
        if self.admin_key and self.admin_key in workers:
            problems.append("JOBTIER_WORKER_KEYS and JOBTIER_ADMIN_KEY share a key")
        return problems

    def encrypted_queue_names(self) -> frozenset[str]:
        """``encrypted_queues`` parsed."""
        return frozenset(filter(None, (q.strip() for q in self.encrypted_queues.split(","))))

    def keyring(self) -> Keyring | None:
        """The keys of ``encryption_keys`` (None: none); built once per process, by its
        ``Store``."""
        return Keyring.from_text(self.encryption_keys, self.decryption_keys)

    def webhook_retry_delays(self) -> list[float]:
        """``webhook_retry_schedule`` parsed: seconds before each retry."""
        delays = [float(p) for p in self.webhook_retry_schedule.split(",") if p.strip()]
        if any(not 0 <= d < 1e9 for d in delays):
            raise ValueError(self.webhook_retry_schedule)
        return delays

    def public(self) -> dict[str, Any]:
        """The values in effect, secrets masked (for logs and `jobtier config`): of the URLs,
        the passwords only (the rest says where jobtier connects)."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = "***" if f.metadata.get("secret") and value else value
        out["redis_url"], out["database_url"] = map(masked_url, (self.redis_url, self.database_url))
        return out


def masked_url(url: str) -> str:
    """``url`` with its password as ``***``: all between the user's ``:`` and the last ``@``
    (a password's ``/``, ``?`` or ``#`` left unencoded included: more masked, never less),
    and a DSN's ``password=``. Text only: the rest reads as given (``unix:///…`` too)."""
    scheme, sep, rest = url.partition("://")
    at = rest.rfind("@")
    if sep and at >= 0 and ":" in rest[:at]:
        url = f"{scheme}{sep}{rest[: rest.index(':')]}:***{rest[at:]}"
    return re.sub(r"(?i)([?&](ssl)?password=)[^&#]*", r"\1***", url)


def env_name(f: dataclasses.Field[Any]) -> str:
    return str(f.metadata.get("env") or ENV_PREFIX + f.name.upper())


def _parse(f: dataclasses.Field[Any], raw: str) -> Any:
    kind: Any = type(f.default)
    name = env_name(f)
    try:
        if kind is bool:
            lowered = raw.strip().lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(raw)
        if kind is int:
            return int(raw.replace("_", ""))
        if kind is float:
            return float(raw)
        return raw
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a valid {kind.__name__}") from None


def settings_table() -> list[tuple[str, str, str]]:
    """(environment variable, default, meaning) for every setting, in declaration order."""
    rows = []
    for f in dataclasses.fields(Settings):
        default = "" if f.metadata.get("secret") and f.name != "database_url" else repr(f.default)
        rows.append((env_name(f), default, str(f.metadata["help"])))
    return rows

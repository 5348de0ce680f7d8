"""``create_app(settings)``: the Starlette application, its routes the operations the
OpenAPI document describes (``openapi.operations`` and an extension's: each route declared
once, with its description).

The lifespan opens what every request shares — the engine's Redis client, the status reader
(near cache, singleflight, coalescer), the process's one shard subscription feeding it, the
admission control — and hands them to handlers as ``request.state``; nothing lives in
module globals.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.types import Receive, Scope, Send

from jobtier.api import jobs, openapi, ops
from jobtier.api.admission import Admission
from jobtier.api.bounds import RequestLimits
from jobtier.api.durable_submit import ReplicaCount
from jobtier.api.problems import HANDLERS
from jobtier.api.routing import resources
from jobtier.api.server_spans import ServerSpans
from jobtier.api.spec import Paths
from jobtier.api.sse import STOPPING, on_stop_signals
from jobtier.api.task_schemas import TaskDocument
from jobtier.api.worker_claims import WorkerClaims
from jobtier.config import Settings
from jobtier.core.errors import ConfigError
from jobtier.core.model import Dependency
from jobtier.engine.catalog import TaskCatalog
from jobtier.engine.queue import Queue
from jobtier.metrics.snapshot import MetricsPublisher
from jobtier.runtime import tracing
from jobtier.runtime.stopping import bounded
from jobtier.status.fastpath import StatusFastPath
from jobtier.status.reader import Fallback, StatusReader
from jobtier.store.context import Store

log = logging.getLogger("jobtier.api")


class Extension:
    """What later parts plug into the API: the Postgres fallback for status reads and
    results, readiness checks, the write-behind lag, extra routes, and resources to open and
    close with the app."""

    def __init__(self) -> None:
        self.operations: list[Paths] = []  # the extra routes, each with its description
        self.status_fallback: Fallback | None = None
        self.result_fallback: Callable[[str, str], Awaitable[dict[str, Any] | None]] | None = None
        # the status document of a job only the outbox holds (job id, tenant; None: any
        # tenant's), else None
        self.outbox_doc: Callable[[str, str | None], Awaitable[bytes | None]] | None = None
        # cancel a job only the outbox holds, not relayed yet (job id, tenant; None: any
        # tenant's): its status document, cancelled, else None
        self.outbox_cancel: Callable[[str, str | None], Awaitable[bytes | None]] | None = None
        # a job's dependencies once Redis no longer keeps it (job id, tenant)
        self.dependencies_fallback: (
            Callable[[str, str], Awaitable[list[Dependency] | None]] | None
        ) = None
        self.postgres_ready: Callable[[], Awaitable[str | None]] | None = None
        self.lag: Callable[[], Awaitable[int]] | None = None
        self.state: dict[str, Any] = {}
        self.openapi_types: list[type] = []
        # add rules JSON Schema can state to the generated schemas of openapi_types
        self.openapi_constraints: list[Callable[[dict[str, Any]], None]] = []

    async def open(self, settings: Settings, queue: Queue) -> None:
        """Override to connect resources (e.g. a Postgres pool)."""

    async def close(self) -> None:
        """Override to release them."""


def create_app(
    settings: Settings,
    extension: Extension | None = None,
    *,
    status_fast_path: bool = True,
    own_process: bool = False,
) -> JobtierApp:
    """The API application for ``settings``.

    ``extension`` plugs in the parts that need Postgres (fallback reads, listing, history,
    schedules); without it the API serves what Redis holds. ``status_fast_path=False``
    serves status reads through the router too (to compare the two: tests, benchmarks).
    ``own_process``: the app is its server process's only part (`jobtier api`): told to stop
    before it is ready (waiting for Redis or Postgres), the process ends within a second
    (sse.py ``on_stop_signals``).
    """
    tenants = settings.tenant_keys()
    if not tenants and not settings.admin_key:
        raise ConfigError(
            "no API keys: set JOBTIER_API_KEYS='key:tenant,…' (and JOBTIER_ADMIN_KEY); "
            "`jobtier run` makes development keys for you"
        )
    ext = extension or Extension()
    api = _operations(settings, ext)
    served_document = TaskDocument(openapi_document(settings, ext), settings.require_known_types)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        stopping = asyncio.Event()  # set by SIGTERM/SIGINT: the streams end (api/sse.py)
        starting = True
        # its own process: a stop while it waits for Redis or Postgres ends the process (sse.py)
        still_starting = (lambda: starting) if own_process else None
        undo_signals = on_stop_signals(stopping, end_process=still_starting)
        try:
            store = await Store.connect(settings)
            # a submit takes a task's queue, attempts and payload check from workers' adverts
            catalog = TaskCatalog(store.redis, store.keys, ttl=settings.task_catalog_ttl)
            queue = Queue(store, catalog, require_known=settings.require_known_types)
            await ext.open(settings, queue)
        except BaseException:
            undo_signals()
            raise
        reader = StatusReader(
            queue.redis,
            queue.keys,
            near_cache=settings.near_cache,
            coalesce=settings.coalesce,
            cache_size=settings.near_cache_size,
            ttl=settings.near_cache_ttl,
            final_ttl=settings.near_cache_final_ttl,
            fallback=ext.status_fallback,
        )
        subscriber = reader.subscription("api-status")
        admission = Admission(settings, queue, ext.lag)
        publisher = MetricsPublisher(queue.redis, queue.keys, "api", [reader, admission])
        # HTTP workers' claims (worker_routes.py): their wake subscription only where they may
        worker_keys = settings.worker_key_list()
        worker_claims = WorkerClaims(
            store.redis, store.keys, store.scripts, settings.retention_seconds
        )
        replicas = ReplicaCount(store.redis)  # the bound of a durable submit's Jobtier-Replicas
        # long polls end at a stop, as the streams do: their clients poll another API
        polls_end = asyncio.create_task(_end_long_polls(stopping, reader, worker_claims))
        try:
            if worker_keys:
                await worker_claims.start()
            await catalog.load()
            catalog.start()
            await subscriber.start()
            await admission.start()
            publisher.start()
            if await replicas.count() < settings.submit_replicas:
                log.warning(
                    "event=submit_replicas_unmet wanted=%d replicas=%d: durable submits answer "
                    "503 until JOBTIER_SUBMIT_REPLICAS replicas confirm them",
                    settings.submit_replicas, replicas.known,
                )  # fmt: skip
            if settings.gc_freeze:
                # Start-up objects (modules, routes, compiled schemas) never die: moving them
                # out of the collector's generations shortens every later collection, the
                # main source of tail latency on the status path.
                gc.collect()
                gc.freeze()
            log.info(
                "event=api_ready shards=%d near_cache=%s coalesce=%s tenants=%d",
                queue.keys.shards, settings.near_cache, settings.coalesce, len(set(tenants.values())),
            )  # fmt: skip
            starting = False
            yield {
                "settings": settings,
                "queue": queue,
                "reader": reader,
                "admission": admission,
                "tenants": tenants,
                "admin_key": settings.admin_key,
                "result_fallback": ext.result_fallback,
                "outbox_doc": ext.outbox_doc,
                "outbox_cancel": ext.outbox_cancel,
                "dependencies_fallback": ext.dependencies_fallback,
                "postgres_ready": ext.postgres_ready,
                "openapi": served_document,
                "metrics_publisher": publisher,
                "catalog": catalog,
                "dashboard_frames": ops.FrameCache(),
                "worker_keys": worker_keys,
                "worker_claims": worker_claims,
                "replicas": replicas,
                STOPPING: stopping,
                **ext.state,
            }
        finally:
            undo_signals()
            polls_end.cancel()
            # Every step is bounded (runtime/stopping.py): an API stopped while Redis restarts, loads
            # or is frozen still exits, and its log names what it left behind. The loops end
            # side by side; their connections close after them.
            await asyncio.gather(
                publisher.stop(),
                catalog.stop(),
                admission.stop(),
                subscriber.stop(),
                worker_claims.stop(),
            )
            await bounded("extension close", ext.close())
            await bounded("redis connections", queue.close())

    app = JobtierApp(
        routes=resources(api.endpoints),
        exception_handlers=HANDLERS,
        lifespan=lifespan,
        # over-long URLs and headers refused before routing (the status fast path checks
        # the same limits itself, and leaves a request over them to this)
        middleware=[Middleware(RequestLimits)],
    )
    # a path with a trailing slash a route answers without: redirected for a read, a 404
    # saying so for a write (problems.py on_http_exception), not a bare 307 for every method
    app.router.redirect_slashes = False
    if status_fast_path:
        app.status_fast_path = jobs.status_fast_path(tenants)
    tracer = tracing.tracer()
    if tracer is not None:  # decided once: an untraced API pays nothing per request
        app.server_spans = ServerSpans(app.serve, tracer)
    return app


async def _end_long_polls(
    stopping: asyncio.Event, reader: StatusReader, claims: WorkerClaims
) -> None:
    """Once the API is told to stop, status reads' ``wait`` and HTTP workers' claims answer
    at once, as at their timeout: else each would hold the stopping server up to its wait
    (JOBTIER_LONG_POLL_MAX_SECONDS)."""
    await stopping.wait()
    reader.end_polls()
    claims.end_waits()


def _operations(settings: Settings, ext: Extension) -> Paths:
    return openapi.operations(settings).include(*ext.operations)


def openapi_document(settings: Settings, extension: Extension | None = None) -> dict[str, Any]:
    """The OpenAPI document ``create_app(settings, extension)`` serves at ``/v1/openapi.json``,
    before the payload schemas of the tasks the workers advertise are added to it (the
    documentation site renders it at build time)."""
    ext = extension or Extension()
    api = _operations(settings, ext)
    return openapi.document(settings, api.paths, ext.openapi_types, ext.openapi_constraints)


class JobtierApp(Starlette):
    """The Starlette app, with the status read — most of the traffic — answered ahead of
    all of it (``StatusFastPath``: the same answers as the route, for less CPU); every
    other request goes through Starlette as usual."""

    status_fast_path: StatusFastPath | None = None  # None: status reads through the router
    server_spans: ServerSpans | None = None  # tracing on: a span around each request

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.server_spans is not None:
            await self.server_spans(scope, receive, send)
        else:
            await self.serve(scope, receive, send)

    async def serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        fast = self.status_fast_path
        if fast is not None:
            read = fast.match(scope)
            if read is not None:
                if self.server_spans is not None:
                    scope["route"] = STATUS_ROUTE  # the span's name (as routing.py sets it)
                await fast.answer(scope, receive, send, *read)
                return
        await super().__call__(scope, receive, send)


STATUS_ROUTE = "/v1/jobs/{job_id}"

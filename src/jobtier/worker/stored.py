"""An attempt whose large result goes to the result store before its success is reported.

With ``JOBTIER_RESULT_STORE`` set, a result over ``JOBTIER_RESULT_STORE_THRESHOLD_BYTES`` is
written to the store (committed) while the job is still this worker's — in ``_running``,
heartbeating, its lease kept — and only then reported, as a reference
(``persist/results.py``): the bytes never reach Redis, and a job reported succeeded always
has its result. An encrypted job's result is stored sealed (its size counted sealed).
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Executor

from jobtier.core.model import marker
from jobtier.core.sealing import Keyring
from jobtier.persist.db import UNAVAILABLE
from jobtier.persist.results import ResultStore
from jobtier.runtime.backoff import PERSIST_POSTGRES
from jobtier.worker.attempt import INTERRUPTED, AttemptSink, Failure, Stopped, run_attempt
from jobtier.worker.job_context import JobContext
from jobtier.worker.procpool import ProcessPool
from jobtier.worker.registry import Task

log = logging.getLogger("jobtier.worker")
STORE_PATIENCE = 300.0  # s a finished attempt's result waits for its store (Postgres) to be back


class _Ended:
    """Holds how the attempt ended until the result is stored."""

    end: bytes | Failure | Stopped = INTERRUPTED

    def attempt_ended(self, ctx: JobContext, end: bytes | Failure | Stopped) -> None:
        self.end = end


async def run_attempt_storing(
    task: Task | None,
    ctx: JobContext,
    executor: Executor,
    max_result_bytes: int,
    sink: AttemptSink,
    store: ResultStore,
    threshold: int,
    keyring: Keyring | None = None,
    sealed_queue: bool = False,
    processes: ProcessPool | None = None,
) -> None:
    """``run_attempt``, with a result over ``threshold`` bytes stored first. A store that is
    away (Postgres down) is waited for, the job kept (its lease heartbeated), up to
    ``STORE_PATIENCE``: the task's work is not thrown away for an outage. One that refuses
    it, or stays away longer, makes the attempt a retryable failure (the result is lost with
    it, not the job)."""
    ended = _Ended()
    await run_attempt(
        task, ctx, executor, max_result_bytes, ended, keyring, sealed_queue, processes
    )
    end = ended.end
    if isinstance(end, bytes) and len(end) > threshold:
        end = await _stored(store, ctx, end)
    sink.attempt_ended(ctx, end)


async def _stored(store: ResultStore, ctx: JobContext, data: bytes) -> bytes | Failure | Stopped:
    """The reference to ``data`` once stored, or how the attempt ends instead."""
    job = ctx.job
    backoff = PERSIST_POSTGRES.start()
    give_up = time.monotonic() + STORE_PATIENCE
    while True:
        put: asyncio.Future[str] | None = None
        try:
            try:
                # bounded whatever the store does (a server gone silent, a pool held): the
                # put is let go, not awaited, past the patience (its cleanup may wait too)
                put = asyncio.ensure_future(store.put(job.id, job.lease_version, data))
                await asyncio.wait({put}, timeout=max(0.1, give_up - time.monotonic()))
                if not put.done():
                    put.cancel()
                    raise TimeoutError(f"no answer within {STORE_PATIENCE:g} s")
                return marker(put.result())
            except UNAVAILABLE as exc:
                if time.monotonic() >= give_up:
                    raise
                wait = backoff.next()
                log.warning(
                    "event=result_store_waiting job=%s size=%d retry_in=%.1fs error=%r",
                    *(job.id, len(data), wait, exc),
                )
                await asyncio.sleep(wait)
        except asyncio.CancelledError:  # shutdown or a lost lease, as run_attempt treats it
            if put is not None:
                put.cancel()
            return INTERRUPTED
        except Exception as exc:
            log.warning("event=result_store_failed job=%s size=%d error=%r", job.id, len(data), exc)
            message = f"the result store refused the result: {exc!r}"[:500]
            return Failure(exc, "ResultStoreUnavailable", message, retry=True)

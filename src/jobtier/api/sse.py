"""``GET /v1/jobs/{id}/events``: the job's status as Server-Sent Events.

The current status first (unless ``Last-Event-ID`` shows the client has it), then every
change until a terminal state, then the stream ends. Event id = version. Heartbeat comments
keep proxies from closing an idle stream.

All streams of a process share its one shard subscription: the status reader calls each
stream's listener on every event for its job. A stream holds at most ``PENDING`` documents
not yet written; a client too slow to take them skips to the latest status rather than
making the server buffer a backlog. A client that disconnects is noticed at once (the
response listens for ``http.disconnect`` while it waits) and its listener is removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections import deque
from collections.abc import AsyncGenerator, Callable
from functools import partial
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from jobtier.api.auth import raw_header, tenant_of
from jobtier.api.http import job_id_of, job_not_found
from jobtier.status.reader import RESYNC, StatusReader, is_terminal

log = logging.getLogger("jobtier.api")

PENDING = 16


class Mailbox:
    """The documents a stream has yet to write, newest last; bounded."""

    __slots__ = ("_items", "_ready")

    def __init__(self) -> None:
        self._items: deque[tuple[int, bytes]] = deque()
        self._ready = asyncio.Event()

    def offer(self, version: int, tenant: str, doc: bytes) -> None:
        items = self._items
        if version != RESYNC and items and items[-1][0] >= version:
            return  # duplicate or out of date
        if len(items) >= PENDING:
            # a slow client: drop its backlog, keep only the newest
            items.clear()
        items.append((version, doc))
        self._ready.set()

    async def take(self, timeout: float) -> tuple[int, bytes] | None:
        """The oldest pending document, or None after ``timeout`` seconds of nothing."""
        if not self._items and not await woken(self._ready, timeout):
            return None
        return self._items.popleft()


async def woken(ready: asyncio.Event, timeout: float) -> bool:
    """Whether ``ready``, cleared first, is set again within ``timeout`` seconds."""
    ready.clear()
    try:
        async with asyncio.timeout(timeout):
            await ready.wait()
    except TimeoutError:
        return False
    return True


STOPPING = "streams_stopping"
"""The lifespan state's ``asyncio.Event``, set once the process is told to stop
(``on_stop_signals``): every stream then ends."""


END_GRACE = 1.0  # s: an API stopped while it starts ends this long after the signal


def on_stop_signals(
    stopping: asyncio.Event, end_process: Callable[[], bool] | None = None
) -> Callable[[], None]:
    """Set ``stopping`` when this process is told to stop (SIGTERM, SIGINT); returns the undo.

    A stopping ASGI server (uvicorn, granian) waits for the responses in flight to end, and a
    stream never ends by itself: a console open in a tab, or a job's events while it runs,
    would hold a stopped API up until its client left (a rolling deploy, until its kill).
    The handler that was there (the server's own, or its event loop's: granian's and
    ``jobtier run``'s are added to the loop, which still gets the signal) is kept and called
    after. Outside the main thread (no signals there) this does nothing.

    ``end_process``: while it says so (an API in a process of its own, not ready yet), the
    process ends by the signal, as if unhandled, ``END_GRACE`` after it (at once when told
    again). Neither server stops an app's start: uvicorn waits for it (a Redis that does not
    answer: ``STARTUP_PATIENCE``), and a granian worker told twice (a Ctrl-C reaches every
    process of the group, then its main process stops it too) hung for good in its handler,
    which blocks while the server is not serving: this handler runs before it, and ends the
    process first. The grace lets granian's main process, told too, stop its worker itself:
    a worker that ended before was taken for a crash (exit status 1). Nothing is lost: an
    API that is not ready has taken no request."""
    loop = asyncio.get_running_loop()
    installed: list[tuple[signal.Signals, Any, Any]] = []
    told: list[int] = []  # the stop signals received while starting
    said: list[bool] = []  # its log line written (whole)

    def say(signum: int, now: bool) -> None:
        if said:
            return
        name = signal.Signals(told[0]).name
        when = "now, told again" if now else f"in {END_GRACE:g} s, at once if told again"
        message = (
            f"event=api_stopped_while_starting signal={name}: not ready, no request taken; "
            f"the process ends {when}"
        )
        if not now:  # (on the loop)
            log.warning(message)
            said.append(True)  # (a handler cutting the write short writes it again)
            return
        # in a signal handler logging's handlers may be locked by the code interrupted:
        # the line is formatted as they would, and written straight to stderr
        record = log.makeRecord(log.name, logging.WARNING, __file__, 0, message, (), None)
        formatter = next((h.formatter for h in logging.getLogger().handlers if h.formatter), None)
        with contextlib.suppress(OSError):
            os.write(2, ((formatter or logging.Formatter()).format(record) + "\n").encode())

    def end_now(signum: int) -> None:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    def end_soon(signum: int) -> None:  # on the loop
        say(signum, now=False)
        loop.call_later(END_GRACE, end_unless_ready, signum)

    def end_unless_ready(signum: int) -> None:
        # ready meanwhile: its server, told by the same signal, stops it as it stops any
        if end_process is not None and end_process():
            end_now(signum)

    def chained(prev: Any) -> Any:
        def handler(signum: int, frame: Any) -> None:
            if told:  # told again, once told while starting (ready since, or not): at once,
                say(signum, now=True)  # before granian's handler, which would block
                end_now(signum)
                return
            if end_process is not None and end_process():
                told.append(signum)
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(end_soon, signum)
            with contextlib.suppress(RuntimeError):  # its loop closed: nothing left to end
                loop.call_soon_threadsafe(stopping.set)
            if callable(prev):
                prev(signum, frame)
            elif prev == signal.SIG_DFL:  # nobody took it: what it would have done
                end_now(signum)

        return handler

    for sig in (signal.SIGTERM, signal.SIGINT):
        prev = signal.getsignal(sig)
        if prev is None or prev == signal.SIG_IGN:  # not Python's to chain, or ignored
            continue
        handler = chained(prev)
        try:
            signal.signal(sig, handler)
        except ValueError:  # not the main thread
            break
        installed.append((sig, handler, prev))

    def undo() -> None:
        for sig, handler, prev in installed:
            if signal.getsignal(sig) is handler:  # (else another chained on: leave it)
                signal.signal(sig, prev)

    return undo


def end_streams(state: Any) -> None:
    """End the streams of the app whose lifespan state is ``state`` (a server stopping by
    other means than a signal: ``jobtier run`` stopping on SIGHUP, or on a part's failure)."""
    stopping = state.get(STOPPING) if isinstance(state, dict) else None
    if stopping is not None:
        stopping.set()


class StreamResponse(Response):
    """A text/event-stream response writing ``chunks``, while the client's disconnect is
    watched for at the same time (servers speaking ASGI 2.4 tell a streaming response of a
    gone client only when a write fails — an idle stream would linger until its next
    heartbeat); ``cleanup`` runs however the stream ends. It ends, completed, once the
    process is told to stop (``STOPPING``): its client reconnects, to another process."""

    media_type = "text/event-stream"

    def __init__(
        self, chunks: AsyncGenerator[bytes, None], cleanup: Callable[[], None] = lambda: None
    ) -> None:
        # no body attribute: init_headers must not declare a Content-Length for a stream
        self.status_code = 200
        self.background = None
        self.chunks = chunks
        self.cleanup = cleanup
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stopping: asyncio.Event | None = scope.get("state", {}).get(STOPPING)
        self._started = self._ended = False
        pump = asyncio.create_task(self._pump(send))
        watch = asyncio.create_task(_until_disconnect(receive))
        tasks: list[asyncio.Task[Any]] = [pump, watch]
        if stopping is not None:
            tasks.append(asyncio.create_task(stopping.wait()))
        stopped = False
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            # the process stops and the client is still there: the stream ends cleanly
            stopped = stopping is not None and stopping.is_set() and not watch.done()
        finally:
            for task in tasks:
                task.cancel()
            try:
                for task in tasks:
                    with contextlib.suppress(asyncio.CancelledError, OSError):
                        await task
                if stopped:
                    await self._end(send)
            finally:
                await self.chunks.aclose()
                self.cleanup()

    async def _pump(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        self._started = True
        async for chunk in self.chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        self._ended = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _end(self, send: Send) -> None:
        """The stream's end, written as the process stops (its client then reconnects)."""
        if self._ended:
            return
        with contextlib.suppress(OSError):
            if not self._started:
                await send(
                    {"type": "http.response.start", "status": 200, "headers": self.raw_headers}
                )
            await send(
                {"type": "http.response.body", "body": b": the server is stopping\n\n",
                 "more_body": False}
            )  # fmt: skip


async def _job_events(
    reader: StatusReader, job_id: str, tenant: str, mailbox: Mailbox, sent: int, heartbeat: float
) -> AsyncGenerator[bytes, None]:
    """The job's events past version ``sent``, until a terminal state."""
    yield b"retry: 1000\n\n"
    while True:
        item = await mailbox.take(heartbeat)
        if item is None:
            yield b": keep-alive\n\n"
            continue
        version, doc = item
        if version == RESYNC:
            # the subscription was re-established: events may be lost, read the job again
            found = await reader.get_for(job_id, tenant)
            if found is None:
                return
            version, doc = found[2], found[1]
        if version <= sent:
            if is_terminal(doc):
                # the client said it has this version or a later one (a Last-Event-ID past
                # the job's versions): the job has ended all the same, and so does the stream
                return
            continue
        yield b"id: %d\nevent: status\ndata: %s\n\n" % (version, doc)
        sent = version
        if is_terminal(doc):
            return


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _last_event_id(request: Request) -> int:
    """The version the client has, from ``Last-Event-ID``; 0 (send the current status) for
    none or anything but ASCII digits (bytes.isdigit is ASCII-only, unlike str.isdigit)."""
    raw = raw_header(request, b"last-event-id") or b""
    return int(raw) if raw.isdigit() and len(raw) < 19 else 0


async def events(request: Request) -> Response:
    tenant = tenant_of(request)
    job_id = job_id_of(request)
    reader: StatusReader = request.state.reader
    mailbox = Mailbox()
    # listen before reading: a change between the read and the registration is not lost
    reader.add_listener(job_id, mailbox.offer)
    stop = partial(reader.remove_listener, job_id, mailbox.offer)
    try:
        found = await reader.get_for(job_id, tenant)
        if found is None:
            raise job_not_found(job_id)
    except BaseException:
        stop()
        raise
    sent = _last_event_id(request)
    _, doc, version = found
    if version > sent:
        mailbox.offer(version, tenant, doc)
    elif is_terminal(doc):
        # the client already has the final status: 204 tells an EventSource not to reconnect
        stop()
        return Response(status_code=204)
    heartbeat: float = request.state.settings.sse_heartbeat_seconds
    return StreamResponse(_job_events(reader, job_id, tenant, mailbox, sent, heartbeat), stop)

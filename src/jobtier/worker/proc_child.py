"""The child side of the process pool (procpool.py): a loop that runs one task call at a
time in this process's main thread, and the context such a task sees.

Two one-way pipes join a child to its worker. The worker sends ``("run", …)``,
``("cancel", job id)`` and ``("exit",)``; a thread here reads them, so that a cancel request
reaches ``ctx.cancel_requested`` while the task holds the main thread. The child sends
``("progress", …)``, ``("log", …)`` and one ``("done", …)`` or ``("error", …)`` per call,
with its resident memory, which the worker weighs for recycling.

The task is found by name (``module`` and ``qualname`` of its function), never pickled: the
child imports the module as the worker did.
"""

from __future__ import annotations

import importlib
import os
import pickle
import queue
import resource
import signal
import sys
import threading
import traceback
from multiprocessing.connection import Connection
from typing import Any

import msgspec

from jobtier.core.errors import Cancelled
from jobtier.core.model import LOG_LINE_CHARS, ClaimedJob, Dependency, encode_json
from jobtier.worker.registry import Task

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """This process's resident memory now (Linux), else its peak."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # bytes there, KiB here


def exception_parts(exc: BaseException) -> tuple[bytes | None, str, str, str]:
    """What the worker needs to raise ``exc`` again: its class, ``args`` and attributes
    pickled (``__init__`` is not called again: ``RateLimited`` takes a keyword-only
    argument that its ``args`` lack), or None when they do not pickle; its type name,
    message and this process's traceback, for the job's error either way."""
    data: bytes | None = None
    if isinstance(exc, Exception):  # a SystemExit raised again in the worker would stop it
        try:
            data = pickle.dumps((type(exc), exc.args, dict(vars(exc))))
        except Exception:  # a local class, or an attribute that does not pickle
            data = None
    te = traceback.TracebackException.from_exception(exc)
    if te.stack and te.stack[0].filename == __file__:  # this loop's frame: not the task's
        del te.stack[0]
    text = "".join(te.format())
    return data, type(exc).__name__, str(exc), text


class ChildCheckpoint:
    """``ctx.checkpoint`` in a child: the state an earlier attempt saved, read only. Saving
    is refused as in the thread pool (it saves on the worker's event loop)."""

    __slots__ = ("_data",)
    saves = 0  # a child's attempt saves none

    def __init__(self, data: bytes | None) -> None:
        self._data = data  # opened by the worker (procpool.py) for an encrypted job

    @property
    def state(self) -> Any:
        return None if self._data is None else msgspec.json.decode(self._data)

    @property
    def resumed(self) -> bool:
        return self._data is not None

    def __call__(self, state: Any) -> None:
        raise RuntimeError(
            "ctx.checkpoint() saves on the worker's event loop: await it from an async task"
        )


class ChildContext:
    """``ctx`` of a task run in a child process: what a plain ``def`` task may use of
    ``JobContext`` — its ids and attempt, ``progress``, ``log``, ``cancel_requested``,
    ``check_cancelled``, ``dependencies``, ``previous`` and ``checkpoint`` (read only)."""

    __slots__ = ("_cancelled", "_send", "checkpoint", "dependencies", "job", "shard", "worker_id")

    def __init__(
        self,
        job: ClaimedJob,
        shard: int,
        worker_id: str,
        dependencies: dict[str, Dependency],
        send: Any,
    ) -> None:
        self.job = job
        self.shard = shard
        self.worker_id = worker_id
        self.dependencies = dependencies
        self._send = send
        self._cancelled = False  # set by the pipe's reader thread
        self.checkpoint = ChildCheckpoint(job.checkpoint)

    @property
    def job_id(self) -> str:
        return self.job.id

    @property
    def attempt(self) -> int:
        return self.job.attempt

    @property
    def max_attempts(self) -> int:
        return self.job.max_attempts

    @property
    def type(self) -> str:
        return self.job.type

    @property
    def previous(self) -> Any:
        deps = self.dependencies
        return deps[next(reversed(deps))].result if deps else None

    def result(self, dependency: str | None = None) -> Any:
        raise RuntimeError(
            "ctx.result() reads on the worker's event loop: await it from an async task"
        )

    def progress(self, value: Any) -> None:
        self._send(("progress", encode_json(value)))

    def log(self, message: Any) -> None:
        text = message if isinstance(message, str) else str(message)
        self._send(("log", text[: LOG_LINE_CHARS + 1]))  # the worker cuts it as it does its own

    @property
    def cancel_requested(self) -> bool:
        return self._cancelled

    def check_cancelled(self) -> None:
        if self._cancelled:
            raise Cancelled(f"job {self.job.id} was cancelled")


class _Child:
    def __init__(self, inbox: Connection, outbox: Connection) -> None:
        self.inbox = inbox
        self.outbox = outbox
        self.send_lock = threading.Lock()  # a task's own threads may log too
        self.calls: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self.current: ChildContext | None = None
        self.cancelled = ""  # the job id of the last cancel request
        self.functions: dict[tuple[str, str], Any] = {}

    def send(self, message: tuple[Any, ...]) -> None:
        with self.send_lock:
            self.outbox.send(message)

    def read(self) -> None:
        """The pipe's reader thread: calls go to the main thread, cancels to the context."""
        try:
            while True:
                message = self.inbox.recv()
                if message[0] == "run":
                    self.calls.put(message)
                elif message[0] == "cancel":
                    # kept for a call not started yet too: the request may overtake it
                    self.cancelled = message[1]
                    ctx = self.current
                    if ctx is not None and ctx.job.id == message[1]:
                        ctx._cancelled = True
                else:
                    break
        except (EOFError, OSError):  # the worker is gone: nothing to run for
            pass
        self.calls.put(None)

    def function(self, module: str, qualname: str) -> Any:
        fn = self.functions.get((module, qualname))
        if fn is None:
            obj: Any = importlib.import_module(module)
            for part in qualname.split("."):
                obj = getattr(obj, part)
            fn = obj.fn if isinstance(obj, Task) else obj  # @task put a Task in the module
            self.functions[(module, qualname)] = fn
        return fn

    def serve(self) -> None:
        threading.Thread(target=self.read, name="jobtier-child-pipe", daemon=True).start()
        while (call := self.calls.get()) is not None:
            _, module, qualname, job, shard, worker_id, dependencies, payload = call
            ctx = ChildContext(job, shard, worker_id, dependencies, self.send)
            self.current = ctx
            ctx._cancelled = self.cancelled == job.id
            try:
                result = self.function(module, qualname)(ctx, payload)
            except BaseException as exc:  # SystemExit and KeyboardInterrupt too: the job's
                self.current = None
                self.send(("error", *exception_parts(exc), rss_bytes()))
                continue
            self.current = None
            try:
                self.send(("done", result, rss_bytes()))
            except Exception as exc:  # the result does not pickle: nor would it encode
                message = f"result is not JSON-serialisable: {exc}"
                self.send(("error", None, "ResultNotSerialisable", message, "", rss_bytes()))


def main(inbox: Connection, outbox: Connection) -> None:
    """A child's life: serve calls until the worker says exit or goes away."""
    # Ctrl-C in a terminal signals the whole process group: the worker decides what its
    # running jobs do (drain, then release), not each child on its own
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _Child(inbox, outbox).serve()

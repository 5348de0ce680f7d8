"""Plain ``def`` tasks in child processes: ``@task(executor="process")``, or every plain
``def`` task of a worker started with ``--executor process`` (docs/process-pool.md).

A CPU-bound task in the worker's thread pool holds the GIL, and the event loop that
heartbeats, claims and reports waits for it. In a child process it holds only the child's.

Each child runs one call at a time (proc_child.py); the pool keeps at most ``size`` of
them, started with the ``spawn`` method (the worker runs an event loop and threads, which a
plain ``fork`` would copy mid-step), and replaces one that:

- ran ``max_jobs`` calls, or reports more than ``max_rss_bytes`` of resident memory after a
  call (recycling: a leak or a large heap ends with its process);
- is ended for its job: a timeout, a release at shutdown or a lost lease cancels the
  attempt, and a cancel request that the task does not answer within ``cancel_grace``
  seconds (by returning or raising ``Cancelled``) ends it too. Ending is SIGTERM, then
  SIGKILL after ``kill_grace`` seconds;
- died: a segfault, an abort, the OOM killer. The attempt fails with ``ProcessDied``,
  retryable, naming the signal; the worker's other jobs go on.

One reader thread per child turns its pipe's messages into calls on the event loop:
progress and log lines go to the job's ``JobContext`` as a sync task's would.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import pickle
import signal
import threading
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any, Literal

import msgspec

from jobtier.core.errors import Cancelled, ConfigError, Fatal
from jobtier.core.sealing import unseal
from jobtier.worker import proc_child
from jobtier.worker.job_context import JobContext
from jobtier.worker.registry import Task

log = logging.getLogger("jobtier.worker")

# A message this size or smaller fits the pipe's buffer, which holds at most one call's
# message at a time: it is written at once. A larger one goes from a thread (see run).
INLINE_SEND_BYTES = 16 * 1024

Executor = Literal["thread", "process"]
EXECUTORS: tuple[Executor, ...] = ("thread", "process")


class ProcessDied(Exception):
    """The child process running the attempt died before it answered: a crash (segfault,
    abort), the OOM killer, or a task that called ``os._exit``. Retryable."""


class RemoteError(Exception):
    """An exception of a task in a child process that could not be rebuilt in the worker (its
    class or attributes do not pickle); its message names the original type."""


class ResultNotSerialisable(Fatal):
    """A child's result that does not pickle: no more would it encode as JSON."""


class _RemoteTraceback(Exception):
    """The child's traceback, chained as the cause of the exception raised again here."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True, slots=True)
class ProcessOptions:
    """How a worker's process pool is run (``Worker(processes=...)``; the CLI's
    ``--processes``, ``--process-max-jobs``, ``--process-max-rss``)."""

    size: int = os.cpu_count() or 1  # child processes at most (a call each at a time)
    max_jobs: int = 0  # calls a child runs before it is replaced (0: no limit)
    max_rss_bytes: int = 0  # resident memory after a call past which it is replaced (0: none)
    cancel_grace: float = 1.0  # s a child has to answer a cancel request before it is ended
    kill_grace: float = 2.0  # s from SIGTERM to SIGKILL

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ConfigError("process pool size must be at least 1")
        if self.max_jobs < 0 or self.max_rss_bytes < 0:
            raise ConfigError("process max jobs and max RSS must be 0 (no limit) or more")
        if self.cancel_grace < 0 or self.kill_grace < 0:
            raise ConfigError("process cancel and kill graces must be 0 or more")


def runs_in_process(task: Task, default: Executor) -> bool:
    """Whether ``task`` runs in the process pool of a worker whose default is ``default``:
    its own ``executor`` wins; an ``async def`` task always runs on the event loop."""
    if task.is_async:
        return False
    return (task.executor or default) == "process"


def check_importable(task: Task) -> None:
    """A child finds a task's function by module and name: refuse one it could not find."""
    fn = task.fn
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or "<" in qualname:
        raise ConfigError(
            f"task {task.name}: a task run in a process must be a function defined at the top "
            f"level of a module (the child process imports it by name), not {qualname!r}"
        )


def died(pid: int, exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            how = f"killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            how = f"killed by signal {-exitcode}"
        how += " (a crash, or the out-of-memory killer)"
    else:
        how = f"exited with code {exitcode} before it answered"
    return f"the process running the task (pid {pid}) died: {how}"


def _rebuilt(data: bytes | None, name: str, message: str, text: str) -> BaseException:
    exc: BaseException | None = None
    if data is not None:
        try:
            cls, args, attrs = pickle.loads(data)
            exc = cls.__new__(cls, *args)
            exc.args = args
            exc.__dict__.update(attrs)
        except Exception:  # the class moved, or its __new__ wants more than its args
            exc = None
        if not isinstance(exc, Exception):  # never a SystemExit raised in the worker
            exc = None
    if exc is None:
        if name == "ResultNotSerialisable":
            return ResultNotSerialisable(message)
        exc = RemoteError(f"{name}: {message}")
    if text:
        exc.__cause__ = _RemoteTraceback(text)
    return exc


class _Call:
    __slots__ = ("ctx", "future")

    def __init__(self, ctx: JobContext, future: asyncio.Future[Any]) -> None:
        self.ctx = ctx
        self.future = future


class Child:
    """One child process, its two pipe ends and its reader thread."""

    def __init__(self, pool: ProcessPool) -> None:
        self.pool = pool
        mp: Any = multiprocessing.get_context("spawn")
        self.inbox, child_out = mp.Pipe(duplex=False)
        child_in, self.outbox = mp.Pipe(duplex=False)
        # daemon: should the worker exit without closing its pool, multiprocessing's exit
        # handler still ends the children
        self.process = mp.Process(
            target=proc_child.main, args=(child_in, child_out), name="jobtier-task", daemon=True
        )
        self.process.start()
        child_in.close()  # the child's ends: ours closed, its exit is seen as EOF here
        child_out.close()
        self.pid = self.process.pid or 0
        self.jobs = 0
        self.rss = 0
        self.call: _Call | None = None
        self.gone = False  # ended, ending, retired or died: never given another call
        self.ending = False  # its SIGTERM/SIGKILL thread has started
        self.exited = threading.Event()  # set by the reader thread once it has reaped it
        threading.Thread(target=self._read, name=f"jobtier-child-{self.pid}", daemon=True).start()

    def _read(self) -> None:
        """The one thread that waits for this child's process (two waiters of one pid race
        for its exit status): its messages, then its end."""
        loop = self.pool.loop
        told = True
        try:
            while True:
                data = self.inbox.recv_bytes()
                try:
                    message = pickle.loads(data)
                except Exception as exc:  # a result whose class the worker cannot import
                    text = f"the worker could not read the child's answer: {exc!r}"
                    message = ("error", None, "RemoteError", text, "", self.rss)
                loop.call_soon_threadsafe(self._on_message, message)
        except (EOFError, OSError):
            pass
        except RuntimeError:  # the loop is closed: nobody is left to tell
            told = False
        self.inbox.close()
        self.process.join(5)  # its pipe closed: it has exited, or is about to
        if self.process.exitcode is None:  # it closed its end of the pipe and went on
            self.process.kill()
            self.process.join()
        self.exited.set()
        if told:
            try:
                loop.call_soon_threadsafe(self._on_exit, self.process.exitcode)
            except RuntimeError:
                pass

    def _on_message(self, message: tuple[Any, ...]) -> None:
        call = self.call
        if call is None:  # a call given up (cancelled, timed out): what it says is dropped
            return
        kind = message[0]
        if kind == "progress":
            call.ctx._on_progress(message[1])
        elif kind == "log":
            call.ctx.log(message[1])
        else:
            self.call = None
            self.jobs += 1
            self.rss = message[-1]
            if call.future.done():
                return
            if kind == "done":
                call.future.set_result(message[1])
            else:
                call.future.set_exception(_rebuilt(*message[1:5]))

    def _on_exit(self, exitcode: int | None) -> None:
        pool = self.pool
        was_gone, self.gone = self.gone, True
        pool.forget(self)
        self.outbox.close()
        call, self.call = self.call, None
        if call is not None and not call.future.done():
            call.future.set_exception(ProcessDied(died(self.pid, exitcode)))
        if not was_gone:
            pool.stats["died"] += 1
            log.warning(
                "event=process_died pid=%d exitcode=%s job=%s",
                self.pid,
                exitcode,
                call.ctx.job.id if call is not None else "-",
            )

    def send(self, message: tuple[Any, ...]) -> bool:
        return self.send_bytes(bytes(ForkingPickler.dumps(message)))

    def send_bytes(self, data: bytes) -> bool:
        try:
            self.outbox.send_bytes(data)
            return True
        except (OSError, ValueError):  # it died: its reader thread says so
            return False

    def end(self) -> None:
        """SIGTERM, then SIGKILL after the kill grace, in a thread of its own (the signals
        only: the reader thread waits for the exit)."""
        self.gone = True
        self.call = None
        if self.ending:
            return
        self.ending = True
        grace = self.pool.options.kill_grace

        def stop() -> None:
            self.process.terminate()
            if not self.exited.wait(grace):
                self.process.kill()

        threading.Thread(target=stop, name=f"jobtier-end-{self.pid}", daemon=True).start()


class ProcessPool:
    """The worker's child processes for plain ``def`` tasks (see the module's docstring)."""

    loop: asyncio.AbstractEventLoop  # set by start()

    def __init__(self, options: ProcessOptions) -> None:
        self.options = options
        self._slots = asyncio.Semaphore(options.size)
        self._idle: list[Child] = []
        self._children: set[Child] = set()
        self._ending: set[Child] = set()
        self.closing = False
        # children started, recycled (jobs or memory), ended for their job, died
        self.stats = {"started": 0, "recycled": 0, "ended": 0, "died": 0}

    def start(self) -> None:
        """Start the children now, so that the first jobs do not wait for interpreters."""
        self.loop = asyncio.get_running_loop()
        for _ in range(self.options.size):
            self._idle.append(self._spawn())

    def _spawn(self) -> Child:
        child = Child(self)
        self._children.add(child)
        self.stats["started"] += 1
        return child

    def forget(self, child: Child) -> None:
        self._children.discard(child)
        if child.exited.is_set():
            self._ending.discard(child)
        if child in self._idle:
            self._idle.remove(child)

    @property
    def pids(self) -> list[int]:
        """The live children's process ids."""
        return [c.pid for c in self._children if not c.gone]

    @property
    def busy(self) -> dict[str, int]:
        """The process id of each child running a call, by its job's id."""
        return {c.call.ctx.job.id: c.pid for c in self._children if c.call is not None}

    async def run(self, task: Task, ctx: JobContext, payload: Any) -> Any:
        """Call ``task`` with a child's context and ``payload`` in a child; its result, or
        what it raised. Cancelling this ends the child."""
        async with self._slots:
            child = self._take()
            call = child.call = _Call(ctx, self.loop.create_future())
            fn = task.fn
            checkpoint = ctx.job.checkpoint
            if checkpoint is not None:  # the child holds no keys: an encrypted job's, opened
                checkpoint = unseal(ctx._keyring, ctx.job.id, "checkpoint", checkpoint)
            job = msgspec.structs.replace(ctx.job, payload=b"", inputs=None, checkpoint=checkpoint)
            deps = ctx.dependencies if ctx.job.inputs is not None else {}
            message = ("run", fn.__module__, fn.__qualname__, job, ctx.shard, ctx.worker_id)
            data = bytes(ForkingPickler.dumps((*message, deps, payload)))
            try:
                if len(data) <= INLINE_SEND_BYTES:
                    child.send_bytes(data)
                else:
                    # a child just spawned reads nothing until it has imported jobtier: a
                    # write over the pipe's buffer would hold the event loop (and every
                    # running job's heartbeat) until then
                    await self.loop.run_in_executor(None, child.send_bytes, data)
                return await self._answer(child, call, ctx)
            except BaseException:
                if not call.future.done():  # a timeout, a release, a lost lease: end it
                    self._end(child)
                raise
            finally:
                self._put_back(child)

    async def _answer(self, child: Child, call: _Call, ctx: JobContext) -> Any:
        future = call.future
        if not ctx.cancel_requested:
            cancelled = asyncio.ensure_future(ctx.wait_cancelled())
            try:
                await asyncio.wait((future, cancelled), return_when=asyncio.FIRST_COMPLETED)
            finally:
                cancelled.cancel()
        if not future.done():  # a cancel request: the task may see it and stop by itself
            child.send(("cancel", ctx.job.id))
            try:
                async with asyncio.timeout(self.options.cancel_grace):
                    await asyncio.shield(future)
            except TimeoutError:
                self._end(child)
                raise Cancelled(
                    f"job {ctx.job.id} was cancelled: its process was ended after "
                    f"{self.options.cancel_grace:g}s"
                ) from None
        return future.result()

    def _take(self) -> Child:
        while self._idle:
            child = self._idle.pop()
            if not child.gone:
                return child
        return self._spawn()

    def _end(self, child: Child) -> None:
        if not child.gone:
            self.stats["ended"] += 1
            log.info("event=process_ended pid=%d", child.pid)
        self.forget(child)
        child.end()
        self._ending.add(child)  # close() waits for it to be gone

    def _put_back(self, child: Child) -> None:
        options = self.options
        if child.gone:
            pass
        elif (options.max_jobs and child.jobs >= options.max_jobs) or (
            options.max_rss_bytes and child.rss > options.max_rss_bytes
        ):
            self.stats["recycled"] += 1
            log.info(
                "event=process_recycled pid=%d jobs=%d rss=%d", child.pid, child.jobs, child.rss
            )
            child.gone = True
            self.forget(child)
            child.send(("exit",))  # it ends by itself; its reader thread joins it
        else:
            self._idle.append(child)
            return
        if not self.closing:  # its replacement starts now, not when the next job needs it
            self._idle.append(self._spawn())

    async def close(self) -> None:
        """Ask the children to exit; end those that do not within the kill grace."""
        self.closing = True
        children = [*self._children, *self._ending]
        for child in children:
            if child.call is None and not child.ending:
                child.gone = True
                child.send(("exit",))
            else:
                child.end()
        grace = self.options.kill_grace

        def join() -> None:
            for child in children:
                if not child.exited.wait(grace):
                    child.process.kill()
                    child.exited.wait(5)

        await asyncio.to_thread(join)
        self._idle.clear()

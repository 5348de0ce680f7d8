"""The worker's watch over its own event loop: a task that blocks it, named.

Every job of a worker shares one event loop. An ``async def`` task that makes a blocking
call (``time.sleep``, ``requests.get``, a long computation) stops all of them, and the
worker's heartbeats and reports with them: its other jobs stall, its leases may run out and
its jobs run again elsewhere, and nothing says why. A callback on the loop notes the time
every ``seconds / 4``; a thread of the watch's own looks at that note as often, and once the
loop has missed it for ``seconds`` it logs ``event=worker_loop_blocked`` naming the job whose
code runs (the loop's current task) and where (the innermost line of the loop's thread, and
the task's own line when that is deeper in a library), then ``event=worker_loop_unblocked``
with how long it lasted once the loop is back. Each stall counts once in
``jobtier_worker_loop_blocked_total``.

The thread reads what the loop's thread holds (the running jobs, the current task, its
frames) without a lock: it only reads, copies before iterating, and treats anything that
changes under it as unknown.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from types import FrameType

from jobtier.worker.state import Running, WorkerState

log = logging.getLogger("jobtier.worker")


class LoopWatch:
    """Watches ``state``'s worker loop from a thread (``start`` on the loop, ``stop``)."""

    def __init__(self, state: WorkerState, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("the loop watch's seconds must be 0 (off) or more")
        self.state = state
        self.seconds = seconds
        self.every = seconds / 4
        self.noted = time.monotonic()
        self.blocked: float | None = None  # when the loop was last heard of, while reported
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._timer: asyncio.TimerHandle | None = None
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if not self.seconds or self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._note()
        self._thread = threading.Thread(
            target=self._watch, name=f"jobtier-loop-watch {self.state.id}", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._thread is not None:
            self._thread.join(timeout=max(self.every * 2, 1.0))
            self._thread = None

    def _note(self) -> None:
        """On the loop: it answers. Reports the end of a stall the thread reported."""
        now = time.monotonic()
        if self.blocked is not None:
            log.info(
                "event=worker_loop_unblocked worker=%s seconds=%.2f: the event loop runs again",
                self.state.id,
                now - self.blocked,
            )
            self.blocked = None
        self.noted = now
        if not self._stopped.is_set() and self._loop is not None:
            self._timer = self._loop.call_later(self.every, self._note)

    def _watch(self) -> None:
        while not self._stopped.wait(self.every):
            noted = self.noted
            late = time.monotonic() - noted
            if late < self.seconds or self.blocked is not None:
                continue
            self.blocked = noted
            self.state.stats.loop_blocked += 1
            try:
                job, where = self._culprit()
            except Exception as exc:  # what it reads moved under it: the stall still told
                job, where = "unknown", f"unknown ({type(exc).__name__})"
            log.warning(
                "event=worker_loop_blocked worker=%s seconds=%.2f job=%s at=%s: a blocking "
                "call in an async def task stops every job of this worker, its heartbeats "
                "and reports; make it a plain def task (run in a thread) or await an "
                "asyncio equivalent",
                self.state.id,
                late,
                job,
                where,
            )

    def _culprit(self) -> tuple[str, str]:
        """The job whose code holds the loop (``id(type)``, or the task's name if it is no
        job's attempt) and where it is."""
        loop = self._loop
        current = asyncio.current_task(loop) if loop is not None else None
        running: Running | None = None
        for each in list(self.state.running.values()):
            if each.handle is current:
                running = each
                break
        if running is not None:
            job = f"{running.job.id}({running.job.type})"
        else:
            job = current.get_name() if current is not None else "none"
        frame = sys._current_frames().get(self._loop_thread)
        if frame is None:
            return job, "unknown"
        where = _line(frame)
        fn = getattr(running.task, "fn", None) if running is not None else None
        code = getattr(fn, "__code__", None)
        if code is not None:
            own: FrameType | None = frame
            while own is not None and own.f_code.co_filename != code.co_filename:
                own = own.f_back
            if own is not None and own is not frame:
                where = f"{where} (called from {_line(own)})"
        return job, where


def _line(frame: FrameType) -> str:
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"

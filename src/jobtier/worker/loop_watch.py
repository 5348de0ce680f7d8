"""The worker's watch over its own event loop: a task that blocks it, named.

Every job of a worker shares one event loop. An ``async def`` task that makes a blocking
call (``time.sleep``, ``requests.get``, a long computation) stops all of them, and the
worker's heartbeats and reports with them: its other jobs stall, its leases may run out and
its jobs run again elsewhere, and nothing says why. A callback on the loop notes the time
every ``seconds / 10``; a thread of the watch's own looks at that note as often. Once the
loop has missed it for ``seconds``, one asyncio task running at every look for half that
time at least, it logs ``event=worker_loop_blocked`` naming that task's job and where it is (the innermost line
of the loop's thread, and the task's own line when that is deeper, in a library), then
``event=worker_loop_unblocked`` with how long it lasted once the loop is back. Each such
stall counts once in ``jobtier_worker_loop_blocked_total``.

A loop late with a different task at each look is not blocked but busy (many jobs ready at
once, or threads of CPU-bound tasks holding the GIL): past twice ``seconds`` it is logged
once, ``event=worker_loop_busy``, blaming no job.

The thread reads what the loop's thread holds (the running jobs, the current task, its
frames) without taking anything from it: it copies before iterating and treats anything that
changes under it as unknown. What both threads write (the stall being reported) is under a
lock, which the loop takes once a tick.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from types import FrameType

from jobtier.core.model import WORKER_BLOCKED_WARN_LEAST
from jobtier.worker.state import Running, WorkerState

log = logging.getLogger("jobtier.worker")

TICKS = 10  # looks per ``seconds``: a stall is measured to a tenth of it


class LoopWatch:
    """Watches ``state``'s worker loop from a thread (``start`` on the loop, ``stop``)."""

    def __init__(self, state: WorkerState, seconds: float) -> None:
        if seconds and not WORKER_BLOCKED_WARN_LEAST <= seconds < float("inf"):
            raise ValueError(
                f"the loop watch's seconds must be 0 (off) or at least {WORKER_BLOCKED_WARN_LEAST:g}, "
                f"not {seconds!r}"
            )
        self.state = state
        self.seconds = seconds
        self.every = seconds / TICKS
        self._lock = threading.Lock()
        self.noted = time.monotonic()  # the loop's last tick
        self.ticks = 0  # the loop's ticks so far
        self.reported: str | None = None  # the stall being reported: "job=…" or "busy"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._timer: asyncio.TimerHandle | None = None
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if not self.seconds or self._thread is not None:
            return
        self._stopped.clear()
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
            # it wakes at once; a daemon, it would not hold the process if it did not
            self._thread.join(timeout=0.2)
            self._thread = None

    def _note(self) -> None:
        """On the loop: it answers. Reports the end of a stall the thread reported."""
        with self._lock:
            now = time.monotonic()
            if self.reported is not None:
                log.info(
                    "event=worker_loop_unblocked worker=%s seconds=%.2f %s: the event loop "
                    "runs again",
                    self.state.id,
                    now - self.noted,
                    self.reported,
                )
                self.reported = None
            self.noted = now
            self.ticks += 1
        if not self._stopped.is_set() and self._loop is not None:
            self._timer = self._loop.call_later(self.every, self._note)

    def _watch(self) -> None:
        # (tick, task, since): the task the loop has been running at every look since, the
        # loop not having ticked meanwhile
        seen: tuple[int, asyncio.Task[object] | None, float] | None = None
        while not self._stopped.wait(self.every):
            ticks, noted = self.ticks, self.noted
            now = time.monotonic()
            late = now - noted
            if late < 2 * self.every or self.reported is not None:
                seen = None
                continue
            loop = self._loop
            current = asyncio.current_task(loop) if loop is not None else None
            if seen is None or seen[:2] != (ticks, current):
                seen = (ticks, current, now)
            # held: one task all along, for half the watch's time at least (a busy loop's
            # tasks each run a step and give way)
            held = now - seen[2] >= self.seconds / 2
            if late < self.seconds or (not held and late < 2 * self.seconds):
                continue
            try:
                job, where = self._culprit(current) if held else ("", "")
            except Exception as exc:  # what it reads moved under it: the stall still told
                job, where = "unknown", f"unknown ({type(exc).__name__})"
            with self._lock:
                if self.ticks != ticks or self.reported is not None:
                    continue  # the loop came back meanwhile: nothing to tell
                if held:
                    self.reported = f"job={job}"
                    self.state.stats.loop_blocked += 1
                    log.warning(
                        "event=worker_loop_blocked worker=%s seconds=%.2f job=%s at=%s: a "
                        "blocking call in an async def task stops every job of this worker, "
                        "its heartbeats and reports; make it a plain def task (run in a "
                        "thread) or await an asyncio equivalent",
                        self.state.id,
                        late,
                        job,
                        where,
                    )
                else:
                    self.reported = "busy"
                    log.warning(
                        "event=worker_loop_busy worker=%s seconds=%.2f running=%d: the event "
                        "loop answers late, no one job holding it (many jobs ready at once, or "
                        "threads of CPU-bound tasks holding the GIL)",
                        self.state.id,
                        late,
                        len(self.state.running),
                    )

    def _culprit(self, current: asyncio.Task[object] | None) -> tuple[str, str]:
        """The job whose code holds the loop (``id(type)``; the asyncio task's name if it is
        no job's attempt: a task a job started itself) and where it is."""
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

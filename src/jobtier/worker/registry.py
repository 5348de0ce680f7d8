"""Tasks: the ``@task`` decorator, retry policy, and finding the tasks of a module."""

from __future__ import annotations

import importlib
import inspect
import random
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, overload

from jobtier.errors import ConfigError
from jobtier.model import DEFAULT_QUEUE, QUEUE_NAME_RE

TASK_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:-]{0,127}$")


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """``delay = min(base * factor ** (attempt - 1), cap)`` plus up to ``jitter * delay``.

    Jitter spreads the retries of jobs that failed together (a downstream outage) so they do
    not come back as one burst.
    """

    max_attempts: int = 3
    base: float = 1.0
    factor: float = 2.0
    cap: float = 300.0
    jitter: float = 0.1

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before the attempt after ``attempt`` (1-based)."""
        plain = min(self.base * self.factor ** max(attempt - 1, 0), self.cap)
        return plain + (rng or random).uniform(0, plain * self.jitter)


@dataclass(frozen=True, slots=True)
class Task:
    """A registered task. Calling it calls the function, so tasks stay easy to unit-test."""

    name: str
    fn: Callable[..., Any]
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    non_retryable: tuple[type[BaseException], ...] = ()
    timeout: float | None = None
    is_async: bool = True
    queue: str = DEFAULT_QUEUE

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    @property
    def max_attempts(self) -> int:
        return self.retry.max_attempts


@overload
def task(fn: Callable[..., Any]) -> Task: ...


@overload
def task(
    fn: None = None,
    *,
    name: str | None = None,
    retries: int = 2,
    backoff_base: float = 1.0,
    backoff_factor: float = 2.0,
    backoff_cap: float = 300.0,
    jitter: float = 0.1,
    non_retryable: Iterable[type[BaseException]] = (),
    timeout: float | None = None,
    queue: str = DEFAULT_QUEUE,
) -> Callable[[Callable[..., Any]], Task]: ...


def task(
    fn: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    retries: int = 2,
    backoff_base: float = 1.0,
    backoff_factor: float = 2.0,
    backoff_cap: float = 300.0,
    jitter: float = 0.1,
    non_retryable: Iterable[type[BaseException]] = (),
    timeout: float | None = None,
    queue: str = DEFAULT_QUEUE,
) -> Any:
    """Declare a task: ``async def fn(ctx, payload)`` (or a plain ``def``, run in a thread).

    ``retries`` is how many times a failed attempt is retried (attempts = retries + 1); a job
    submitted with its own ``max_attempts`` overrides it. Exceptions in ``non_retryable``
    (and ``jobtier.Fatal``) send the job straight to the dead-letter set. ``timeout`` bounds
    one attempt, in seconds; a timed-out attempt counts as a retryable failure. ``queue``
    names the queue its jobs go to (workers serve queues: ``jobtier worker --queues``).

    Usable bare (``@task``) or with options (``@task(retries=5, timeout=30)``).
    """

    def wrap(f: Callable[..., Any]) -> Task:
        task_name = name or f.__name__
        if not TASK_NAME_RE.fullmatch(task_name):
            raise ConfigError(f"task name {task_name!r} must match {TASK_NAME_RE.pattern}")
        if retries < 0 or backoff_base < 0 or backoff_factor < 1 or jitter < 0:
            raise ConfigError(f"task {task_name}: retries/backoff/jitter out of range")
        if timeout is not None and timeout <= 0:
            raise ConfigError(f"task {task_name}: timeout must be positive")
        if not QUEUE_NAME_RE.fullmatch(queue):
            raise ConfigError(
                f"task {task_name}: queue {queue!r} must match {QUEUE_NAME_RE.pattern}"
            )
        classes = tuple(non_retryable)
        for cls in classes:
            if not (isinstance(cls, type) and issubclass(cls, BaseException)):
                raise ConfigError(f"task {task_name}: non_retryable holds {cls!r}")
        return Task(
            name=task_name,
            fn=f,
            retry=RetryPolicy(retries + 1, backoff_base, backoff_factor, backoff_cap, jitter),
            non_retryable=classes,
            timeout=timeout,
            is_async=inspect.iscoroutinefunction(f),
            queue=queue,
        )

    return wrap(fn) if fn is not None else wrap


class TaskRegistry:
    """Tasks by name."""

    def __init__(self, tasks: Iterable[Task] = ()) -> None:
        self._tasks: dict[str, Task] = {}
        for t in tasks:
            self.add(t)

    def add(self, t: Task) -> Task:
        if t.name in self._tasks and self._tasks[t.name] is not t:
            raise ConfigError(f"two tasks are named {t.name!r}")
        self._tasks[t.name] = t
        return t

    def get(self, name: str) -> Task | None:
        return self._tasks.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._tasks

    def __iter__(self) -> Iterator[Task]:
        return iter(self._tasks.values())

    def __len__(self) -> int:
        return len(self._tasks)

    def names(self) -> list[str]:
        return sorted(self._tasks)

    def queues(self) -> list[str]:
        """The queues of the registered tasks: what a worker serves unless told otherwise."""
        return sorted({t.queue for t in self._tasks.values()})

    @classmethod
    def load(cls, spec: str) -> TaskRegistry:
        """``module`` (every Task defined in it) or ``module:attr`` (a registry, a Task, or a
        list of Tasks)."""
        module_name, _, attr = spec.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ConfigError(f"cannot import task module {module_name!r}: {exc}") from exc
        if attr:
            try:
                obj = getattr(module, attr)
            except AttributeError:
                raise ConfigError(f"module {module_name!r} has no attribute {attr!r}") from None
            if isinstance(obj, TaskRegistry):
                return obj
            if isinstance(obj, Task):
                return cls([obj])
            if isinstance(obj, list | tuple) and all(isinstance(t, Task) for t in obj):
                return cls(obj)
            raise ConfigError(f"{spec} is not a TaskRegistry, a Task, or a list of Tasks")
        registry = cls(v for v in vars(module).values() if isinstance(v, Task))
        if not registry:
            raise ConfigError(f"module {module_name!r} defines no @task functions")
        return registry

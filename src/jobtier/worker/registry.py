"""Tasks: the ``@task`` decorator, retry policy, and finding the tasks of a module."""

from __future__ import annotations

import importlib
import inspect
import numbers
import os
import random
import re
import sys
import time
import typing
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, overload

import msgspec

from jobtier.core.breaker import Breaker
from jobtier.core.errors import ConfigError, InvalidRequest
from jobtier.core.model import DEFAULT_QUEUE, Backoff, TaskAd, TaskInfo
from jobtier.core.names import QUEUE_NAME_RE, TASK_NAME_RE

_MISSING = re.compile(r"Object missing required field `(.+)`")


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
    # the payload's annotated type (a msgspec.Struct, dataclass, TypedDict, ...): the worker
    # decodes into it and the catalogue publishes its JSON Schema; None: any JSON value
    payload_type: Any = None
    decode_payload: Callable[[bytes], Any] = field(
        default=msgspec.json.Decoder().decode, repr=False, compare=False
    )
    # the task whose job is created when a job of this one fails for good (compensation)
    on_failure: str | None = None
    compensation: Task | None = field(default=None, repr=False, compare=False)
    # its payloads and results are encrypted at rest (docs/encryption.md)
    encrypt: bool = False
    # a plain def's: "thread" (the worker's thread pool) or "process" (its process pool,
    # worker/procpool.py); None: the worker's --executor decides
    executor: str | None = None
    # the circuit breaker of the downstream it calls, and the failures that count against it
    # besides DownstreamDown (docs/breakers.md)
    breaker: Breaker | None = None
    breaker_on: tuple[type[BaseException], ...] = ()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    @property
    def max_attempts(self) -> int:
        return self.retry.max_attempts

    def payload_schema(self) -> dict[str, Any] | None:
        return None if self.payload_type is None else msgspec.json.schema(self.payload_type)

    def check_payload(self, payload: Any) -> None:
        """Raise InvalidRequest (naming the field) if ``payload`` does not fit the type."""
        if self.payload_type is None:
            return
        try:
            msgspec.convert(payload, self.payload_type)
        except msgspec.ValidationError as exc:
            message = str(exc)
            text, at, path = message.rpartition(" - at `$")
            where = "payload" + (path.rstrip("`") if at else "")
            missing = _MISSING.fullmatch(text if at else message)
            if missing:  # the field named is the one missing, not the object that lacks it
                where, message = f"{where}.{missing.group(1)}", "required, and missing"
            raise InvalidRequest(f"{where}: {message[:300]}", field=where) from None

    def info(self) -> TaskInfo:
        check = self.check_payload if self.payload_type is not None else None
        return TaskInfo(self.queue, self.max_attempts, check, self.on_failure, self.encrypt)

    def infos(self) -> dict[str, TaskInfo]:
        """What a producer given this task knows: it and its compensation task."""
        out = {self.name: self.info()}
        if self.compensation is not None:
            out[self.compensation.name] = self.compensation.info()
        return out

    def ad(self, worker: str) -> TaskAd:
        """What a worker advertises of this task (engine/catalog.py)."""
        r = self.retry
        return TaskAd(
            type=self.name,
            queue=self.queue,
            max_attempts=r.max_attempts,
            backoff=Backoff(r.base, r.factor, r.cap, r.jitter),
            timeout=self.timeout,
            non_retryable=[f"{c.__module__}.{c.__qualname__}" for c in self.non_retryable],
            payload_schema=self.payload_schema(),
            seen_at=time.time(),
            worker=worker,
            on_failure=self.on_failure,
            encrypt=self.encrypt,
        )


def _payload_type(fn: Callable[..., Any], name: str) -> Any:
    """The annotation of a task's second parameter, if it names a type other than Any."""
    params = list(inspect.signature(fn).parameters.values())
    if len(params) < 2 or params[1].annotation is inspect.Parameter.empty:
        return None
    try:
        hints = typing.get_type_hints(fn)
    except Exception as exc:  # a forward reference that does not resolve
        raise ConfigError(f"task {name}: cannot read its payload annotation: {exc}") from None
    annotation = hints.get(params[1].name)
    if annotation in (None, Any, object):
        return None
    try:
        msgspec.json.schema(annotation)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"task {name}: payload annotation {annotation!r} is not a type jobtier can decode "
            f"JSON into ({exc}); use a msgspec.Struct, a dataclass, a TypedDict or Any"
        ) from None
    return annotation


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
    non_retryable: Iterable[type[BaseException]] | type[BaseException] = (),
    timeout: float | None = None,
    queue: str = DEFAULT_QUEUE,
    on_failure: str | Task | None = None,
    encrypt: bool = False,
    executor: str | None = None,
    breaker: str | Breaker | None = None,
    breaker_on: Iterable[type[BaseException]] | type[BaseException] = (),
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
    non_retryable: Iterable[type[BaseException]] | type[BaseException] = (),
    timeout: float | None = None,
    queue: str = DEFAULT_QUEUE,
    on_failure: str | Task | None = None,
    encrypt: bool = False,
    executor: str | None = None,
    breaker: str | Breaker | None = None,
    breaker_on: Iterable[type[BaseException]] | type[BaseException] = (),
) -> Any:
    """Declare a task: ``async def fn(ctx, payload)`` (or a plain ``def``, run in a thread).

    ``retries`` is how many times a failed attempt is retried (attempts = retries + 1); a job
    submitted with its own ``max_attempts`` overrides it. Exceptions in ``non_retryable``
    (and ``jobtier.Fatal``) send the job straight to the dead-letter set. ``timeout`` bounds
    one attempt, in seconds; a timed-out attempt counts as a retryable failure. ``queue``
    names the queue its jobs go to (workers serve queues: ``jobtier worker --queues``).
    ``on_failure`` names a task (or is one) whose job is created, in the same atomic step,
    when a job of this one fails for good: its payload is ``{"job_id", "type", "payload",
    "error"}`` of the failed job (a compensation: undo what the failed job did).
    ``encrypt=True``: its jobs' payloads and results are encrypted at rest with
    ``JOBTIER_ENCRYPTION_KEYS`` (docs/encryption.md). ``executor="process"``: a plain
    ``def`` runs in the worker's pool of child processes, not its thread pool, for CPU-bound
    work (docs/process-pool.md); ``"thread"`` keeps it in a thread whatever the worker's
    ``--executor``. ``breaker`` names the circuit breaker
    of the downstream it calls (or is a ``Breaker`` with thresholds); ``DownstreamDown`` and
    the classes of ``breaker_on`` count against it (docs/breakers.md).

    Usable bare (``@task``) or with options (``@task(retries=5, timeout=30)``).
    """

    def wrap(f: Callable[..., Any]) -> Task:
        if not callable(f):
            raise ConfigError(f"@task decorates a function (ctx, payload), not {f!r}")
        task_name = name or f.__name__
        if not TASK_NAME_RE.fullmatch(task_name):
            raise ConfigError(f"task name {task_name!r} must match {TASK_NAME_RE.pattern}")
        _check_signature(f, task_name)
        if not isinstance(retries, numbers.Integral) or isinstance(retries, bool):
            raise ConfigError(f"task {task_name}: retries is a whole number, not {retries!r}")
        for what, value in (("backoff_base", backoff_base), ("backoff_factor", backoff_factor),
                            ("backoff_cap", backoff_cap), ("jitter", jitter),
                            ("timeout", 1 if timeout is None else timeout)):  # fmt: skip
            if not isinstance(value, numbers.Real) or isinstance(value, bool):
                raise ConfigError(f"task {task_name}: {what} is a number, not {value!r}")
        # kept as int and float: a Fraction or a numpy number would not encode in its advert
        attempts = int(retries) + 1
        base, factor, cap, jit = map(float, (backoff_base, backoff_factor, backoff_cap, jitter))
        limit = None if timeout is None else float(timeout)
        if attempts < 1 or base < 0 or factor < 1 or jit < 0:
            raise ConfigError(f"task {task_name}: retries/backoff/jitter out of range")
        if limit is not None and limit <= 0:
            raise ConfigError(f"task {task_name}: timeout must be positive")
        if not QUEUE_NAME_RE.fullmatch(queue):
            raise ConfigError(
                f"task {task_name}: queue {queue!r} must match {QUEUE_NAME_RE.pattern}"
            )
        classes = _classes(non_retryable)
        for cls in classes:
            if not (isinstance(cls, type) and issubclass(cls, BaseException)):
                raise ConfigError(f"task {task_name}: non_retryable holds {cls!r}")
        compensation = on_failure if isinstance(on_failure, Task) else None
        comp_name = on_failure.name if isinstance(on_failure, Task) else on_failure
        if comp_name is not None and not TASK_NAME_RE.fullmatch(comp_name):
            raise ConfigError(
                f"task {task_name}: on_failure {comp_name!r} must name a task "
                f"({TASK_NAME_RE.pattern})"
            )
        if executor not in (None, "thread", "process"):
            raise ConfigError(f"task {task_name}: executor must be 'thread' or 'process'")
        if executor == "process" and inspect.iscoroutinefunction(f):
            raise ConfigError(
                f"task {task_name}: executor='process' runs a plain def; an async def task "
                "runs on the worker's event loop"
            )
        guard = Breaker(breaker) if isinstance(breaker, str) else breaker
        downstream = _classes(breaker_on)
        for cls in downstream:
            if not (isinstance(cls, type) and issubclass(cls, BaseException)):
                raise ConfigError(f"task {task_name}: breaker_on holds {cls!r}")
        if downstream and guard is None:
            raise ConfigError(f"task {task_name}: breaker_on without a breaker")
        payload_type = _payload_type(f, task_name)
        decoder = msgspec.json.Decoder(payload_type) if payload_type is not None else None
        return Task(
            name=task_name,
            fn=f,
            retry=RetryPolicy(attempts, base, factor, cap, jit),
            non_retryable=classes,
            timeout=limit,
            is_async=inspect.iscoroutinefunction(f),
            queue=queue,
            payload_type=payload_type,
            on_failure=comp_name,
            compensation=compensation,
            encrypt=encrypt,
            executor=executor,
            breaker=guard,
            breaker_on=downstream,
            **({"decode_payload": decoder.decode} if decoder is not None else {}),
        )

    return wrap(fn) if fn is not None else wrap


def _classes(given: Iterable[type[BaseException]] | type[BaseException]) -> tuple[Any, ...]:
    """``non_retryable=ValueError`` as ``(ValueError,)``: one class, or several."""
    if isinstance(given, type):
        return (given,)
    try:
        return tuple(given)
    except TypeError:
        return (given,)  # not a class either: the caller's check names it


def _check_signature(f: Callable[..., Any], name: str) -> None:
    """A task is called ``f(ctx, payload)``: one that cannot take both would fail every job
    (with a TypeError, retried) instead of being refused here."""
    try:
        # the callable itself: a functools.wraps wrapper that supplies more arguments to what
        # it wraps (``f(ctx, payload, db)`` called as ``wrapper(ctx, payload)``) takes its own;
        # one that passes on whatever it is given (``*args, **kwargs``), what it wraps
        signature = inspect.signature(f, follow_wrapped=False)
        if hasattr(f, "__wrapped__") and all(
            p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in signature.parameters.values()
        ):
            signature = inspect.signature(f)
    except (TypeError, ValueError):  # a builtin or an object it cannot read: let it be
        return
    try:
        signature.bind(None, None)
    except TypeError:
        raise ConfigError(
            f"task {name}: a task is called with (ctx, payload); {name}{signature} cannot take them"
        ) from None


def _import_tasks(name: str) -> Any:
    """``import name``; a module not found is looked for in the folder this process runs
    from too, as ``python -m`` finds it there (the ``jobtier`` script's path holds its own
    folder instead): appended to the path, after the installed packages, and not when
    Python was asked for a safe path (``-P``, PYTHONSAFEPATH)."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        try:
            here = os.getcwd()
        except OSError:  # the folder was deleted under it
            raise exc from None
        top = name.partition(".")[0]
        if exc.name != top or here in sys.path or "" in sys.path or sys.flags.safe_path:
            raise
        sys.path.append(here)
        return importlib.import_module(name)


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

    def info(self, name: str) -> TaskInfo | None:
        t = self._tasks.get(name)
        return None if t is None else t.info()

    def queues(self) -> list[str]:
        """The queues of the registered tasks: what a worker serves unless told otherwise."""
        return sorted({t.queue for t in self._tasks.values()})

    @classmethod
    def load(cls, spec: str) -> TaskRegistry:
        """``module`` (every Task defined in it) or ``module:attr`` (a registry, a Task, or a
        list of Tasks)."""
        module_name, _, attr = spec.partition(":")
        if module_name.endswith(".py") or "/" in module_name or module_name.startswith("."):
            # a file's path (./mytasks.py), not a module's name: relative imports fail with
            # a TypeError, and 'mytasks.py' reads as a package 'mytasks'
            name = module_name.removesuffix(".py").strip("./").replace("/", ".")
            raise ConfigError(
                f"{module_name!r} is a file's path: give the task module's name ({name!r}), "
                "run from the folder that holds it or with that folder on PYTHONPATH"
            )
        try:
            module = _import_tasks(module_name)
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

"""pytest plugin: a throw-away Redis, a connected ``Queue`` and a burst worker for tests of
your own tasks. Installing jobtier registers it (entry point ``pytest11: jobtier``; turn it
off with ``-p no:jobtier``).

Fixtures, all named ``jobtier_*`` so they clash with nobody's ``redis`` or ``queue``:

- ``jobtier_redis`` (session): a ``redis-server`` from ``PATH`` on a free loopback port, AOF
  on, stopped at the end of the session. Without ``redis-server`` the tests that use it are
  skipped, saying how to install it (``jobtier_require_redis = true`` in the pytest
  configuration makes that an error, for CI).
- ``jobtier_settings``: ``Settings`` (defaults) pointed at that server, emptied first.
- ``jobtier_queue`` (async): a connected ``Queue`` on those settings with ``jobtier_tasks``
  as its registry (types are checked, ``max_attempts`` defaults to the task's), closed after.
- ``jobtier_worker``: ``await jobtier_worker()`` runs a burst worker over the tasks until no
  job is ready or running (``jobtier.testing.BurstWorker``).
- ``jobtier_tasks``: override it to name your tasks (a module, ``"module[:attr]"``, a
  ``@task`` or a list of them); ``None`` by default.

Async fixtures need an async test runner: with pytest-asyncio, set ``asyncio_mode = auto``
or mark the tests ``@pytest.mark.asyncio``.

Loading the plugin imports nothing of jobtier's engine and starts nothing until a test asks
for one of these fixtures.
"""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from jobtier.config import Settings
    from jobtier.dev.local_redis import LocalRedis
    from jobtier.engine.queue import Queue
    from jobtier.testing.burst import BurstWorker, Tasks

try:  # already imported by pytest when installed: no cost
    from pytest_asyncio import fixture as async_fixture
except ImportError:  # anyio's plugin, among others, runs plain async fixtures
    async_fixture = pytest.fixture  # type: ignore[assignment]

REQUIRE_OPTION = "jobtier_require_redis"
MISSING = (
    "redis-server is not on PATH, and the jobtier_* fixtures start a throw-away one. "
    "Install it: `apt-get install redis-server` (Debian, Ubuntu), `brew install redis` "
    "(macOS), or see https://redis.io/docs/latest/operate/oss_and_stack/install/"
)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        REQUIRE_OPTION,
        "jobtier fixtures: fail, rather than skip, when redis-server is not installed",
        type="bool",
        default=False,
    )


@pytest.fixture(scope="session")
def jobtier_redis(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalRedis]:
    """A redis-server for the whole session (``.url``, ``.port``), stopped at its end."""
    if shutil.which("redis-server") is None:
        if request.config.getini(REQUIRE_OPTION):
            pytest.fail(MISSING, pytrace=False)
        pytest.skip(MISSING)
    from jobtier.dev.local_redis import LocalRedis

    server = LocalRedis(Path(tmp_path_factory.mktemp("jobtier-redis")), free_ports=True)
    try:
        server.start()  # inside the try: one that started but never listened is stopped too
        yield server
    finally:
        server.stop()


@pytest.fixture
def jobtier_settings(jobtier_redis: LocalRedis) -> Settings:
    """Default ``Settings`` (the environment's ``JOBTIER_*`` ignored) pointed at the session's
    Redis, emptied before the test. Override to change them::

        @pytest.fixture
        def jobtier_settings(jobtier_settings):
            return jobtier_settings.replace(max_result_bytes=1024)
    """
    import redis

    from jobtier.config import Settings

    with redis.Redis.from_url(jobtier_redis.url) as client:
        client.flushall()
    return Settings.from_env({}, redis_url=jobtier_redis.url)


@pytest.fixture
def jobtier_tasks() -> Tasks | None:
    """Your tasks, for ``jobtier_queue``'s registry and ``jobtier_worker``'s default: override
    it (``return "myapp.tasks"``, a module, a ``@task`` or a list of them)."""
    return None


@async_fixture
async def jobtier_queue(
    jobtier_settings: Settings, jobtier_tasks: Tasks | None
) -> AsyncIterator[Queue]:
    """A ``Queue`` connected to the session's Redis (emptied: it holds only the shards' job
    format marks, ``jt:{s}:fmt`` and ``:fmt:done``, which connecting sets), closed after the
    test. It knows ``jobtier_tasks``; without them it looks nothing up (no worker has
    advertised anything in an emptied Redis: a test submits by name, then runs its worker)."""
    from jobtier.engine.queue import Queue
    from jobtier.testing.burst import as_registry

    registry = as_registry(jobtier_tasks) if jobtier_tasks is not None else None
    queue = await Queue.connect(jobtier_settings, registry, catalog=False)
    try:
        yield queue
    finally:
        await queue.close()


@pytest.fixture
def jobtier_worker(jobtier_queue: Queue, jobtier_tasks: Tasks | None) -> BurstWorker:
    """``stats = await jobtier_worker()`` (or ``jobtier_worker(tasks)``): run a burst worker
    on ``jobtier_queue`` until no job is ready or running."""
    from jobtier.testing.burst import BurstWorker

    return BurstWorker(jobtier_queue, jobtier_tasks)

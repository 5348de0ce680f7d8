"""Postgres access: connection pools, the named queries, and migrations.

SQL lives in this package's ``.sql`` files: ``migrations/NNNN_name.sql`` (the schema, applied
in order by ``migrate``) and ``QUERY_FILES`` (named queries, loaded once). Python code refers
to queries by name: ``query("upsert_jobs")``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
from importlib import resources
from typing import Any, TypeAlias

import asyncpg

from jobtier.core.errors import ConfigError
from jobtier.core.model import MIGRATE_LOCK_TIMEOUT, MIGRATE_PATIENCE

# Postgres is away or cannot take work now (the connection or the server, not the data):
# write again after a back-off. InternalClientError too: a connection lost mid-COPY is left
# mid-protocol, and its next statement (ROLLBACK, the pool's reset) fails with it.
UNAVAILABLE: tuple[type[BaseException], ...] = (
    OSError,
    TimeoutError,
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.exceptions.InternalClientError,
    asyncpg.exceptions.OperatorInterventionError,  # admin shutdown, cannot connect now
    asyncpg.exceptions.InsufficientResourcesError,  # too many connections, disk full
    asyncpg.exceptions.DeadlockDetectedError,
    asyncpg.exceptions.SerializationError,
)

log = logging.getLogger("jobtier.persist")

_NAME = re.compile(r"^--\s*name:\s*([a-z_][a-z0-9_]*)\s*$", re.MULTILINE)
_MIGRATION = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")
# migrations squashed into 0001_initial before 0.1.0 (a database that applied them has their
# names in schema_migrations): known, not a sign of a database newer than this code. No 0006
# ever shipped (the old numbering skipped it). The next migration is 0010: no number then
# names two different migrations in a database that applied these.
FOLDED = (
    "0002_partitioned_history",
    "0003_queues",
    "0004_flows",
    "0005_console",
    "0007_webhooks_results",
    "0008_webhook_callbacks_tenant",
    "0009_jobs_by_state",
)

# advisory lock key of `migrate`: "jobtier" in ASCII, clear of the small integers that other
# tools sharing the database might pick
MIGRATION_LOCK = 0x6A6F6274696572
# what connecting to JOBTIER_DATABASE_URL fails with when it points at no usable database: no
# server there, a URL asyncpg cannot read (an InterfaceError), a wrong password or database
CONNECT_FAULTS: tuple[type[BaseException], ...] = (
    TimeoutError,
    OSError,
    asyncpg.InterfaceError,
    asyncpg.InvalidAuthorizationSpecificationError,
    asyncpg.InvalidPasswordError,
    asyncpg.InvalidCatalogNameError,
)

# asyncpg's classes are generic only to the type checker (asyncpg-stubs)
Pool: TypeAlias = "asyncpg.Pool[asyncpg.Record]"
Connection: TypeAlias = "asyncpg.Connection[asyncpg.Record]"
# what queries run on: a connection of our own or one borrowed from a pool
AnyConnection: TypeAlias = (
    "asyncpg.Connection[asyncpg.Record] | asyncpg.pool.PoolConnectionProxy[asyncpg.Record]"
)


def _package_text(*parts: str) -> str:
    return resources.files("jobtier.persist").joinpath(*parts).read_text(encoding="utf-8")


def parse_queries(text: str) -> dict[str, str]:
    """``-- name: x`` blocks of a SQL file, by name. Duplicate names are an error."""
    out: dict[str, str] = {}
    matches = list(_NAME.finditer(text))
    for i, match in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(text)
        name = match.group(1)
        if name in out:
            raise ValueError(f"query {name!r} is defined twice")
        body = text[match.end() : end].strip()
        if not body:
            raise ValueError(f"query {name!r} is empty")
        out[name] = body
    return out


QUERY_FILES = ("queries.sql", "webhooks.sql", "checkpoints.sql", "outbox.sql")


@functools.cache
def queries() -> dict[str, str]:
    """Every named query of ``QUERY_FILES`` (read once); a name is unique across them."""
    out: dict[str, str] = {}
    for name in QUERY_FILES:
        found = parse_queries(_package_text(name))
        if twice := set(found) & set(out):
            raise ValueError(f"queries defined twice: {sorted(twice)}")
        out.update(found)
    return out


def query(name: str) -> str:
    try:
        return queries()[name]
    except KeyError:
        raise KeyError(f"no query named {name!r} in {', '.join(QUERY_FILES)}") from None


def rows_affected(status: str) -> int:
    """The row count of a command's status as asyncpg's ``execute`` returns it
    (``"INSERT 0 12"``, ``"DELETE 3"``)."""
    return int(status.rsplit(" ", 1)[-1])


def migrations() -> list[tuple[str, str]]:
    """(name, SQL) of every migration, in order; name is the file name without ``.sql``."""
    folder = resources.files("jobtier.persist").joinpath("migrations")
    found: list[tuple[int, str, str]] = []
    for entry in folder.iterdir():
        match = _MIGRATION.match(entry.name)
        if match:
            found.append((int(match.group(1)), entry.name[:-4], entry.read_text(encoding="utf-8")))
        elif entry.name.endswith(".sql"):
            raise ValueError(f"migration file {entry.name!r} is not named NNNN_name.sql")
    found.sort()
    numbers = [n for n, _, _ in found]
    # a gap is allowed (work elsewhere reserves numbers); a number twice is not
    if len(set(numbers)) != len(numbers) or (numbers and numbers[0] != 1):
        raise ValueError(f"migrations must be numbered from 0001, each number once: {numbers}")
    return [(name, sql) for _, name, sql in found]


def _encode_json(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


def _decode_json(value: bytes) -> bytes:
    return value


# The schema `jobtier` (0010_outbox: jobtier.submit) is also "$user", the first entry of the
# default search_path, for a role named jobtier: 0010 sets that role's search_path without it,
# and a migrator whose session began before (one waiting on the migration lock) leaves it
# out of its own path here, or it would make schema_migrations anew in that schema.
PIN_SEARCH_PATH = """
SELECT set_config('search_path',
                  coalesce(string_agg(quote_ident(s), ', ' ORDER BY n), 'public'), false)
FROM unnest(current_schemas(false)) WITH ORDINALITY AS t(s, n)
WHERE s <> 'jobtier'
HAVING 'jobtier' = ANY (current_schemas(false)) AND to_regclass('jobtier.jobs') IS NULL
"""


async def init_connection(conn: Connection) -> None:
    """Codecs of every jobtier connection: ``json`` columns travel as raw bytes both ways
    (they come from Redis and go to clients as bytes: decoding them would only cost time)."""
    await conn.set_type_codec(
        "json", schema="pg_catalog", encoder=_encode_json, decoder=_decode_json, format="binary"
    )


async def create_pool(dsn: str, *, min_size: int = 1, max_size: int = 10, **kwargs: Any) -> Pool:
    """An asyncpg pool with jobtier's codecs (see ``init_connection``)."""
    settings = {"application_name": "jobtier"}
    settings.update(kwargs.pop("server_settings", {}))
    return await asyncpg.create_pool(
        dsn,
        min_size=min_size,
        max_size=max_size,
        init=init_connection,
        server_settings=settings,
        **kwargs,
    )


async def connect(dsn: str, **kwargs: Any) -> Connection:
    """One connection with jobtier's codecs (scripts, migrations, benchmarks)."""
    conn: Connection = await asyncpg.connect(dsn, **kwargs)
    await init_connection(conn)
    return conn


FAST_COLLATIONS = ("C", "POSIX")  # byte order: Postgres compares text without the C library


async def close(conn: Connection, timeout: float = 5.0) -> None:
    """Close a connection of its own politely, else drop the socket (Postgres gone, or no
    answer in ``timeout`` seconds): the session and its locks end either way."""
    try:
        async with asyncio.timeout(timeout):
            await conn.close()
    except asyncio.CancelledError:
        conn.terminate()
        raise
    except Exception:
        conn.terminate()


# `migrate`'s waits for the locks its migrations take (an ALTER TABLE's is exclusive): at most
# LOCK_TIMEOUT seconds a try, for while it waits every other statement on that table queues
# behind it; between tries it lets go of everything and sleeps (TRY_AGAIN_AFTER, doubling up
# to TRY_AGAIN_MOST), and it gives up, changing nothing, after LOCK_PATIENCE seconds.
LOCK_TIMEOUT = MIGRATE_LOCK_TIMEOUT
LOCK_PATIENCE = MIGRATE_PATIENCE
TRY_AGAIN_AFTER = 0.5
TRY_AGAIN_MOST = 15.0


class MigrationBlocked(Exception):
    """``migrate`` gave up: a lock one of its migrations needs stayed held by other sessions
    (``blockers``: what ``Blockers`` saw of them) for its whole patience."""

    def __init__(self, waited: float, blockers: list[str]) -> None:
        self.waited, self.blockers = waited, blockers
        held = "; ".join(blockers) or "sessions that could not be seen (ended, or too quick)"
        super().__init__(
            f"a lock the migrations need was held for {waited:.0f} s by {held}; nothing was "
            "changed: end that transaction (or pg_terminate_backend(<pid>)) and migrate again"
        )


async def migrate(
    dsn: str, *, lock_timeout: float = LOCK_TIMEOUT, patience: float = LOCK_PATIENCE
) -> list[str]:
    """Apply the pending migrations; returns their names (empty when the schema is current).

    All run in one transaction under an advisory lock: two processes migrating at once
    serialise (the second finds nothing to do), and a failing migration leaves the database
    as it was. So no migration may use ``CREATE INDEX CONCURRENTLY`` and the like.

    A lock a migration needs is waited for ``lock_timeout`` seconds a try: a transaction left
    open on one of the tables (a caller's, idle after its ``jobtier.submit``) would otherwise
    hold the migration, and behind its lock request every reader and writer of that table,
    for as long as it stays open. Each try that times out is rolled back and logged
    (``event=migration_waiting``, naming the sessions that blocked it: ``Blockers``), and
    tried again after a pause, until ``patience`` seconds have passed: then
    ``MigrationBlocked``.
    """
    loop_time = asyncio.get_running_loop().time
    began = loop_time()
    pause = TRY_AGAIN_AFTER
    blockers = Blockers(dsn, max(0.02, lock_timeout / 4))
    try:
        while True:
            try:
                return await _migrate(dsn, lock_timeout, blockers)
            except asyncpg.exceptions.LockNotAvailableError:
                waited = loop_time() - began
                if waited + pause > patience:
                    raise MigrationBlocked(waited, blockers.named()) from None
                log.warning(
                    "event=migration_waiting lock_timeout=%gs retry_in=%gs waited=%.0fs held_by=%s",
                    lock_timeout,
                    pause,
                    waited,
                    " | ".join(blockers.named()) or "-",
                )
                await asyncio.sleep(pause)
                pause = min(pause * 2, TRY_AGAIN_MOST)
    finally:
        await blockers.close()


async def _migrate(dsn: str, lock_timeout: float, blockers: Blockers) -> list[str]:
    conn = await connect(dsn)
    try:
        async with conn.transaction():
            # a second migrator waits for the first however long, whatever lock_timeout the
            # role or the database sets; then each lock a migration takes, a try's at most
            await conn.execute("SELECT set_config('lock_timeout', '0', true)")
            await conn.execute(query("migration_lock"), MIGRATION_LOCK)
            timeout_ms = f"{max(1, round(lock_timeout * 1000))}ms"
            await conn.execute("SELECT set_config('lock_timeout', $1, true)", timeout_ms)
            blockers.watch(conn.get_server_pid())
            await conn.execute(PIN_SEARCH_PATH)
            await conn.execute(query("create_migrations_table"))
            applied = {r["name"] for r in await conn.fetch(query("applied_migrations"))}
            known = migrations()
            folded = applied & set(FOLDED)
            if folded and folded != set(FOLDED):
                # part of the old migrations: 0001_initial (today's) would not add the rest
                raise ConfigError(
                    "this database applied only part of the migrations that 0001_initial "
                    f"now holds (missing: {', '.join(sorted(set(FOLDED) - folded))}): migrate "
                    "it with the jobtier it was made by (0.1.0 before the squash) first"
                )
            unknown = applied - {name for name, _ in known} - set(FOLDED)
            if unknown:
                log.warning(
                    "event=unknown_migrations names=%s hint=the_database_is_newer_than_this_code",
                    ",".join(sorted(unknown)),
                )
            done = []
            for name, sql in known:
                if name in applied:
                    continue
                await conn.execute(sql)
                await conn.execute(query("record_migration"), name)
                done.append(name)
        collation = await conn.fetchval(query("database_collation"))
    finally:
        blockers.watch(None)
        await conn.close()
    for name in done:
        log.info("event=migration_applied name=%s", name)
    if collation not in FAST_COLLATIONS:
        # under any other collation each text comparison goes through the C library, and the
        # write-behind makes one at every level of every index entry it writes
        log.info(
            "event=database_collation collation=%s hint=a_database_created_with_LC_COLLATE_C"
            "_takes_less_CPU_per_transition_written_(docs/operating.md:_Postgres's_collation)",
            collation,
        )
    return done


class Blockers:
    """Who blocks a migrating session's lock requests: while one is watched (``watch(pid)``),
    a connection of its own asks Postgres every ``every`` seconds (``pg_blocking_pids``) and
    keeps what it learns of each blocker, as ``pid 123 (idle in transaction for 42 s,
    application 'x', user 'y', on outbox; last statement: …)``. Started at the first watch;
    a look that fails (Postgres away) is skipped: the names are a help, not the outcome."""

    def __init__(self, dsn: str, every: float) -> None:
        self.dsn, self.every = dsn, every
        self.pid: int | None = None
        self.seen: dict[int, str] = {}
        self._task: asyncio.Task[None] | None = None

    def watch(self, pid: int | None) -> None:
        self.pid = pid
        if pid is not None and self._task is None:
            self._task = asyncio.create_task(self._looking())

    def named(self) -> list[str]:
        return list(self.seen.values())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _looking(self) -> None:
        conn: Connection | None = None
        try:
            while True:
                await asyncio.sleep(self.every)
                if self.pid is None:
                    continue
                try:
                    if conn is None or conn.is_closed():
                        conn = await connect(self.dsn)
                    rows = await conn.fetch(query("lock_blockers"), self.pid)
                except Exception:  # the names are a help: the next look tries again
                    continue
                for r in rows:
                    self.seen[r["pid"]] = _blocker(r)
        finally:
            if conn is not None:
                await close(conn)


def _blocker(r: asyncpg.Record) -> str:
    if r["pid"] == 0:
        return "a prepared transaction (pg_prepared_xacts: COMMIT PREPARED or ROLLBACK PREPARED)"
    tables = ", ".join(r["tables"]) or "no table"
    return (
        f"pid {r['pid']} ({r['state']} for {r['seconds']:.0f} s, application "
        f"{r['application_name']!r}, user {r['usename']!r}, on {tables}; "
        f"last statement: {' '.join(r['query'].split())[:120]!r})"
    )


async def applied_migrations(conn: AnyConnection) -> list[str]:
    """Names of the migrations applied to this database ([] before the first migrate)."""
    if await conn.fetchval("SELECT to_regclass('schema_migrations')") is None:
        return []
    return [r["name"] for r in await conn.fetch(query("applied_migrations"))]

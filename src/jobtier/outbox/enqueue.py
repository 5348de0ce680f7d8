"""``submit``/``submit_sync``: one call of ``jobtier.submit`` on the caller's connection.

The drivers are told apart by their module, so none is imported unless the caller uses it.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from jobtier.core.model import encode_json, job_ids

# the argument order of jobtier.submit (migrations/0010_outbox.sql)
ARGS = (
    "type",
    "payload",
    "queue",
    "priority",
    "delay",
    "run_at",
    "idempotency_key",
    "max_attempts",
    "depends_on",
    "tenant",
)
# each argument's SQL type: a None must still name its type for the function to be found
_TYPES = ("text", "json", "text", "text", "float8", "timestamptz", "text", "int4", "text[]", "text")
ASYNCPG_SQL = "SELECT jobtier.submit({})".format(
    ", ".join(f"${i}::{t}" for i, t in enumerate(_TYPES, 1))
)
PSYCOPG_SQL = "SELECT jobtier.submit({})".format(", ".join(f"%s::{t}" for t in _TYPES))
SQLALCHEMY_SQL = "SELECT jobtier.submit({})".format(
    ", ".join(f"CAST(:{a} AS {t})" for a, t in zip(ARGS, _TYPES, strict=True))
)


def arguments(
    type: str,
    payload: Any = None,
    *,
    queue: str | None = None,
    priority: str = "normal",
    delay: float | None = None,
    run_at: datetime | None = None,
    idempotency_key: str | None = None,
    max_attempts: int | None = None,
    depends_on: Sequence[str] | None = None,
    tenant: str | None = None,
) -> tuple[Any, ...]:
    """jobtier.submit's arguments, in order; the payload as JSON text. ``ValueError`` for
    what the drivers would pass on silently wrong (the function checks the rest)."""
    if run_at is not None and run_at.tzinfo is None:
        raise ValueError("run_at needs a time zone (a naive datetime names no instant)")
    try:
        body = encode_json(payload).decode()
    except TypeError as exc:
        raise ValueError(f"payload: {exc}") from None
    deps = job_ids(depends_on)  # one id alone is that id, as for a submit
    if delay is not None:
        if isinstance(delay, bool) or not isinstance(delay, int | float):
            raise ValueError("delay is a number of seconds")
        delay = float(delay)  # the drivers encode float8 from a float only
    return (
        type,
        body,
        queue,
        priority,
        delay,
        run_at,
        idempotency_key,
        max_attempts,
        deps,
        tenant,
    )


def _known(options: dict[str, Any], call: str) -> None:
    """A ``TypeError`` naming ``call`` for an option jobtier.submit does not take."""
    unknown = sorted(set(options) - set(ARGS[2:]))
    if unknown:
        raise TypeError(
            f"jobtier.outbox.{call}() got an unexpected keyword argument {unknown[0]!r}; it "
            f"takes {', '.join(ARGS[2:])}"
        )


def _driver(conn: Any) -> str:
    return type(conn).__module__.split(".", 1)[0]


async def submit(conn: Any, type: str, payload: Any = None, **options: Any) -> str:
    """Submit a job in ``conn``'s transaction; its id. The options of ``POST /v1/jobs``:
    ``queue``, ``priority``, ``delay`` (seconds) or ``run_at`` (an aware datetime),
    ``idempotency_key``, ``max_attempts``, ``depends_on`` (job ids), and ``tenant``."""
    _known(options, "submit")
    args = arguments(type, payload, **options)
    driver = _driver(conn)
    if driver == "asyncpg":
        return str(await conn.fetchval(ASYNCPG_SQL, *args))
    if driver == "psycopg":
        cur = await conn.execute(PSYCOPG_SQL, args)
        return str((await cur.fetchone())[0])
    if driver == "sqlalchemy":
        from sqlalchemy import text

        result = await conn.execute(text(SQLALCHEMY_SQL), dict(zip(ARGS, args, strict=True)))
        return str(result.scalar_one())
    raise TypeError(
        f"jobtier.outbox.submit takes an asyncpg connection, a psycopg AsyncConnection or a "
        f"SQLAlchemy AsyncSession/AsyncConnection, not {driver}.{conn.__class__.__name__} "
        "(submit_sync takes the synchronous ones)"
    )


def submit_sync(conn: Any, type: str, payload: Any = None, **options: Any) -> str:
    """``submit`` on a psycopg ``Connection`` or a SQLAlchemy ``Session``/``Connection``."""
    _known(options, "submit_sync")
    args = arguments(type, payload, **options)
    driver = _driver(conn)
    if driver == "psycopg":
        row = conn.execute(PSYCOPG_SQL, args).fetchone()
        return str(row[0])
    if driver == "sqlalchemy":
        from sqlalchemy import text

        return str(
            conn.execute(text(SQLALCHEMY_SQL), dict(zip(ARGS, args, strict=True))).scalar_one()
        )
    raise TypeError(
        "jobtier.outbox.submit_sync takes a psycopg Connection or a SQLAlchemy Session/"
        f"Connection, not {driver}.{conn.__class__.__name__} (submit takes the asynchronous ones)"
    )

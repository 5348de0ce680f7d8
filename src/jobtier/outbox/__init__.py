"""Submit jobs in the application's own Postgres transaction (docs/outbox.md).

>>> async with conn.transaction():
...     await conn.execute("INSERT INTO orders ...")
...     job_id = await jobtier.outbox.submit(conn, "send_receipt", {"order": 42})

The job commits or rolls back with the transaction; the outbox relay (in the persister)
submits it into Redis once committed. ``submit`` takes an asyncpg connection, a psycopg
``AsyncConnection`` or a SQLAlchemy ``AsyncSession``/``AsyncConnection``; ``submit_sync`` a
psycopg ``Connection`` or a SQLAlchemy ``Session``/``Connection``. Each calls the SQL function
``jobtier.submit``, which any other language calls the same way.
"""

from jobtier.outbox.enqueue import submit, submit_sync

__all__ = ["submit", "submit_sync"]

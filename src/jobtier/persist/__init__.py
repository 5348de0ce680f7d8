"""The durable record: Postgres schema, migrations, the write-behind persister and its reads.

``Persister`` moves every transition from the shard log streams into Postgres; ``PgReader``
serves what only Postgres has (expired jobs, listings, history); ``migrate`` brings a
database's schema up to date. How far behind the write-behind is: ``streams.group.lag``.
"""

from jobtier.persist.db import create_pool, migrate
from jobtier.persist.persister import Persister
from jobtier.persist.pg_reader import PgReader, StoredResult, Transition
from jobtier.persist.stats import PersisterStats

__all__ = [
    "Persister",
    "PersisterStats",
    "PgReader",
    "StoredResult",
    "Transition",
    "create_pool",
    "migrate",
]

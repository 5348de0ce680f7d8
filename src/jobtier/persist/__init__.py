"""The durable record in Postgres: schema, migrations, the write-behind persister and the
reads of what only Postgres keeps. Each module is imported by name: a worker that stores a
result loads the result store, not the persister."""

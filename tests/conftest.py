"""Fixtures: real Redis (and Postgres) servers started for the session, cleaned per test."""

pytest_plugins = [
    "tests.fixtures.redis",
    "tests.fixtures.engine",
    "tests.fixtures.api",
    "tests.fixtures.cluster",
    "tests.fixtures.postgres",
    "tests.fixtures.hangs",
    "tests.fixtures.receiver",
    "tests.fixtures.tls",
]

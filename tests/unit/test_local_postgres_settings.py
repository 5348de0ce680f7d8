"""The settings a local Postgres is given on top of its own configuration (bench/compare.py's
``--pg-settings``): written to its jobtier.conf, and nothing unquotable let through."""

from __future__ import annotations

from pathlib import Path

import pytest

from jobtier.dev.local_postgres import LocalPostgres


def test_settings_are_added_to_the_configuration(tmp_path: Path) -> None:
    pg = LocalPostgres(tmp_path, settings={"wal_compression": "lz4", "max_wal_size": "4GB"})
    pg.data.mkdir(parents=True)
    pg._write_conf()
    lines = (pg.data / "jobtier.conf").read_text().splitlines()
    assert "wal_compression = 'lz4'" in lines
    assert "max_wal_size = '4GB'" in lines
    assert "fsync = off" not in lines  # durable unless told otherwise


@pytest.mark.parametrize(
    "settings",
    [
        {"wal_compression": "lz4'\nfsync = off"},
        {"fsync = off\nx": "1"},
        {"Shared_Buffers": "1GB"},
        {"work_mem": ""},
    ],
)
def test_a_setting_that_is_not_plain_is_refused(tmp_path: Path, settings: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="not a plain Postgres setting"):
        LocalPostgres(tmp_path, settings=settings)

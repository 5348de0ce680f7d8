"""The README's promises that code can check: its settings table and its commands."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, cast

from jobtier.cli.main import build_parser
from jobtier.config import settings_table

README = (Path(__file__).parents[2] / "README.md").read_text()


def test_settings_table_matches_the_code() -> None:
    begin = README.index("<!-- settings:begin")
    block = README[README.index("\n", begin) + 1 : README.index("<!-- settings:end -->")]
    rows = [line for line in block.splitlines() if line.startswith("| `")]
    documented = [re.match(r"\| `([A-Z_]+)`", row).group(1) for row in rows]  # type: ignore[union-attr]
    assert documented == [name for name, _, _ in settings_table()]


def test_the_two_commands_and_cli_commands_exist() -> None:
    assert "make run" in README and "make test" in README
    commands = set(cast(dict[str, Any], build_parser()._subparsers._group_actions[0].choices))  # type: ignore[union-attr]
    for used in re.findall(r"`jobtier ([\w-]+)", README):
        assert used in commands, used

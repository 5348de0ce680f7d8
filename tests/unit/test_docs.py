"""The documentation (README.md and the site's pages under docs/) against the code: every code
block a user would run is run or checked (tests/docs_blocks.py says which, by the marker
before it), the site's nav lists every page, the pages the build generates render, and the
promises code can check hold (the settings table, the commands, the two commands, the
README's size and its bench-report markers)."""

from __future__ import annotations

import argparse
import ast
import asyncio
import importlib.util
import inspect
import itertools
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, cast

import pytest
import yaml

from jobtier.cli.main import build_parser
from jobtier.config import settings_table
from tests.docs_blocks import ROOT, Block, all_blocks, blocks, commands, pages
from tests.fixtures.redis import JOBTIER_ACL

DOCS = ROOT / "docs"
README = (ROOT / "README.md").read_text()


def _hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "scripts/docs_hooks.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _page_text(name: str) -> str:
    return (DOCS / name).read_text()


# --- the site --------------------------------------------------------------------------------
def _nav_pages(nav: Any) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [page for item in nav for page in _nav_pages(item)]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in _nav_pages(value)]
    return []


def _mkdocs_config() -> dict[str, Any]:
    # mkdocs.yml has no custom tags; a plain load reads it
    return cast(dict[str, Any], yaml.safe_load((ROOT / "mkdocs.yml").read_text()))


def test_the_nav_lists_every_page_and_only_pages_that_exist() -> None:
    listed = _nav_pages(_mkdocs_config()["nav"])
    assert len(listed) == len(set(listed)), "a page listed twice"
    assert sorted(listed) == sorted(p.name for p in DOCS.glob("*.md"))


def test_the_screenshots_are_used() -> None:
    text = "".join(p.read_text() for p in DOCS.glob("*.md"))
    for png in DOCS.glob("*.png"):
        assert f"]({png.name})" in text, png.name


def test_the_site_links_each_figure_to_a_result_file_that_exists() -> None:
    for page in DOCS.glob("*.md"):
        for target in re.findall(r"\]\((bench/results/[^)#]+)", page.read_text()):
            assert (ROOT / target).is_file(), f"{page.name}: {target}"


def test_the_generated_cli_page_lists_every_command_and_action() -> None:
    text = _hooks().cli_markdown()
    parser = build_parser()
    commands_ = cast(dict[str, Any], parser._subparsers._group_actions[0].choices)  # type: ignore[union-attr]
    for name, sub in commands_.items():
        assert f"### `jobtier {name}`" in text, name
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            for flag in action.option_strings:
                assert re.search(rf"[`, ]{re.escape(flag)}\b", text), (name, flag)
    assert "#### `jobtier jobs list`" in text and "`--state STATE`" in text


def test_the_generated_api_page_lists_every_operation_the_server_serves() -> None:
    hooks = _hooks()
    document = hooks.openapi_spec()
    text = hooks.render_openapi(document)
    for path, item in document["paths"].items():
        for method in item:
            if method in hooks.METHODS:
                assert f"#### `{method.upper()} {path}`" in text
    for name in document["components"]["schemas"]:
        assert f"#schema-{name.lower()}" in text
    assert "/v1/openapi.json" in _page_text("http-api.md")


@pytest.mark.slow
def test_mkdocs_builds_the_site_strictly(tmp_path: Path) -> None:
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    # a dev dependency: missing, the set-up is broken, and the site would go unchecked
    assert mkdocs is not None, "mkdocs is not installed (pip install -e '.[dev]')"
    done = subprocess.run(
        [mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-5000:]
    assert (tmp_path / "site" / "http-api" / "index.html").is_file()


# --- the code blocks -------------------------------------------------------------------------
BLOCKS = all_blocks()


def test_the_pages_have_runnable_blocks() -> None:
    assert {b.page for b in BLOCKS} >= {"README.md", "docs/tasks.md", "docs/getting-started.md"}


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "python"], ids=lambda b: b.where)
def test_python_blocks_compile(block: Block) -> None:
    compile(block.code, block.where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)


def _run_page(page: Path) -> None:
    """The page's python blocks in order, in one namespace; then each ``test_*`` function a
    block defined without parameters (fixtures' users are pytest's to run)."""
    namespace: dict[str, Any] = {"__name__": f"docs_{page.stem.replace('-', '_')}"}
    ran: set[str] = set()
    for block in blocks(page):
        if block.lang != "python" or block.mode != "run":
            continue
        code = compile(block.code, block.where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        result = eval(code, namespace)
        if inspect.iscoroutine(result):
            asyncio.run(result)
        for name, value in list(namespace.items()):
            if name.startswith("test_") and callable(value) and name not in ran:
                ran.add(name)
                if not inspect.signature(value).parameters:
                    outcome = value()
                    if inspect.iscoroutine(outcome):
                        asyncio.run(outcome)


@pytest.mark.parametrize(
    "page",
    [p for p in pages() if any(b.lang == "python" and b.mode == "run" for b in blocks(p))],
    ids=lambda p: p.name,
)
def test_python_blocks_run(page: Path) -> None:
    _run_page(page)


def _make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([a-z][\w-]*):", text, flags=re.M))


def _operations() -> list[tuple[str, re.Pattern[str]]]:
    """(method, the path template as a pattern) of every operation the server serves."""
    document = _hooks().openapi_spec()
    return [
        (method.upper(), re.compile(re.sub(r"\\\{[^}]+\\\}", "[^/]+", re.escape(path))))
        for path, item in document["paths"].items()
        for method in item
    ]


def _check_command(
    words: list[str], where: str, operations: list[tuple[str, re.Pattern[str]]]
) -> None:
    while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):  # VAR=value before a command
        words = words[1:]
    if not words:
        return
    program = words[0].rsplit("/", 1)[-1]
    if program == "jobtier":
        parser = build_parser()
        args = [w for w in words[1:] if w not in ("-h", "--help")]
        try:
            parser.parse_args(args)
        except SystemExit as exc:
            raise AssertionError(f"{where}: `{' '.join(words)}` does not parse") from exc
    elif program == "make":
        for target in words[1:]:
            if not target.startswith("-") and "=" not in target:
                assert target in _make_targets(), f"{where}: no make target {target!r}"
    elif program == "curl":
        method = "GET"
        for flag, value in itertools.pairwise(words):
            if flag == "-X":
                method = value
        urls = [w for w in words if w.startswith("$JOBTIER_URL")]
        assert len(urls) == 1, f"{where}: `{' '.join(words)}`"
        path = urls[0].removeprefix("$JOBTIER_URL").split("?")[0]
        assert any(m == method and p.fullmatch(path) for m, p in operations), (
            f"{where}: {method} {path} is no operation"
        )


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "sh"], ids=lambda b: b.where)
def test_shell_blocks_name_real_commands(block: Block) -> None:
    operations = _operations()
    for words in commands(block.code):
        _check_command(words, block.where, operations)


# --- what moved out of the README: its promises, now on the pages that hold them -------------
def test_settings_table_matches_the_code() -> None:
    text = _page_text("configuration.md")
    begin = text.index("<!-- settings:begin")
    block = text[text.index("\n", begin) + 1 : text.index("<!-- settings:end -->")]
    rows = [line for line in block.splitlines() if line.startswith("| `")]
    # whole rows, as `jobtier config --table` prints them: a default or a meaning changed in
    # the code is changed here too
    assert rows == [
        f"| `{n}` | `{default}` | {meaning} |" for n, default, meaning in settings_table()
    ]


def test_the_two_commands_and_cli_commands_exist() -> None:
    for text in (README, _page_text("getting-started.md")):
        assert "make run" in text and "make test" in text
    commands_ = set(cast(dict[str, Any], build_parser()._subparsers._group_actions[0].choices))  # type: ignore[union-attr]
    for page in pages():
        for used in re.findall(r"`jobtier ([\w-]+)", page.read_text()):
            assert used in commands_, (page.name, used)


def test_the_pages_name_real_operations_and_settings() -> None:
    """`METHOD /path` in the text is an operation the server serves; every JOBTIER_ name
    is a setting (or one of the client's: the URL and key of the CLI, JOBTIER_MAX_WAITING_*)."""
    operations = _operations()
    settings = {name for name, _, _ in settings_table()}
    client = {"JOBTIER_URL", "JOBTIER_KEY", "JOBTIER_MAX_WAITING_"}
    for page in pages():
        text = page.read_text()
        for method, path in re.findall(r"`(GET|POST|PUT|PATCH|DELETE) (/[^`\s]*)", text):
            path = path.split("?")[0]
            assert any(m == method and p.fullmatch(path) for m, p in operations), (
                f"{page.name}: {method} {path}"
            )
        for name in set(re.findall(r"JOBTIER_[A-Z_]+", text)):
            assert name in settings | client, (page.name, name)


def test_the_readme_is_short_and_keeps_the_bench_report_markers() -> None:
    assert len(README.splitlines()) <= 250
    start = README.index("<!-- bench-report:start -->")
    end = README.index("<!-- bench-report:end -->")
    headline = README[start:end]
    assert "bench/results/" in headline and "python bench/" in headline
    for link, anchor in re.findall(r"\]\(((?:docs|bench/results)/[^)#]+)(?:#([^)]+))?\)", README):
        assert (ROOT / link).is_file(), link
        if anchor:  # as MkDocs's toc makes a heading's id
            headings = re.findall(r"^#+ (.+)$", (ROOT / link).read_text(), flags=re.M)
            ids = {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in headings}
            assert anchor in ids, f"{link}#{anchor}"


def test_the_redis_user_the_docs_give_is_the_one_the_tests_run_as() -> None:
    """operating.md's least-privileged Redis user has the rules jobtier's clients are given
    on the tests' single server and cluster (tests/fixtures/redis.py): every process the
    suite builds from its settings runs under them."""
    found = re.findall(r"^\s*ACL SETUSER jobtier on >\S+ (.+)$", _page_text("operating.md"), re.M)
    assert found, "operating.md gives no ACL SETUSER line"
    assert [line.split() for line in found] == [list(JOBTIER_ACL)]

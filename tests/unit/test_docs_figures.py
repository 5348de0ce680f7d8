"""Every figure the hand-written pages quote beside a results file is a figure of that file.

The rule (``figures`` and ``units`` below):

* **Where**: docs/*.md except the generated docs/benchmarks.md, and README.md outside its
  generated ``bench-report`` block. Fenced code blocks, HTML comments and headings are left
  out. A *unit* is a paragraph, a list item or a table row. A unit that links a results file
  (``](bench/results/<name>.md)``) is checked against the files it links; a list or table
  right after a paragraph that links files answers to those files too (its rows are what the
  paragraph cites); a paragraph ending in ``:`` passes its files on through the paragraphs
  with no link of their own that follow it, and the lists and tables after them.
* **What is a figure**: every number in the unit's prose, except numbers inside code spans
  (commands, settings, commits), inside a link's target, in a date, or glued to letters (a
  commit such as 85fa2cc, p99, open20k), and except an integer 0-9 with no unit after it: such
  a number counts runs, rounds, cores, sets or states (the words around it say which) and is
  not a measurement. So a number with a decimal point, a thousands separator, a unit (``%``,
  ``x`` (or the multiplication sign), ``ms``, ``µs``, ``s``, ``K``, ``MiB``, ``KB``, ``B``), or of two digits or more
  is checked. A unit written once after a list of numbers (``1.15 / 3.71 / 2.28 ms``,
  ``0.4-1.6 ms`` with an en dash) applies to each.
* **How it is matched**: against every number in the file's .md (read by the same rule, so
  ``10K`` is 10,000) and every number in its .json (strings included), except the numbers of
  lists longer than ``SAMPLES`` (raw samples: lag every 50 ms, per-request latencies; with
  thousands of them any figure would match one). A figure matches a number that rounds to it
  at the precision it is written with (``1.36x`` matches 1.3551, ``19.0K`` matches 18,960,
  ``1,234`` matches 1234.4), after one unit conversion the unit allows (a fraction as a
  percentage, seconds as ms or µs, bytes as MiB).
* **Derived figures** (a sum, a product, a conversion the file does not print) are written
  with the figures they come from or not at all; ``ALLOWED`` lists the few kept, each with
  its reason.
"""

from __future__ import annotations

import bisect
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
GENERATED = {"benchmarks.md"}
START, END = "<!-- bench-report:start -->", "<!-- bench-report:end -->"
SAMPLES = 50  # a longer list of numbers in a .json is raw samples, not figures

# (page, figure as written): why it may stand although the file does not hold it
ALLOWED: dict[tuple[str, str], str] = {}

LINK = re.compile(r"\]\((bench/results/[^)#\s]+?)\.md(?:#[^)]*)?\)")
X, DASH = "\N{MULTIPLICATION SIGN}", "\N{EN DASH}"
UNIT = r"(?:\s?(?:ms|µs|us|s|%|MiB|KiB|KB|MB|GB|B)|" + X + r"|x|K)(?![A-Za-z0-9])"
NUMBER = re.compile(
    r"(?<![\w.,/-])(?P<n>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?)"
    r"(?P<unit>" + UNIT + r")?(?![\w])"
)
JOINER = re.compile(
    r"^\s*(?:/|" + DASH + r"|-|to)\s*$"
)  # between numbers that share the unit after
DATE = re.compile(r"\d{4}-\d{2}-\d{2}(?:[T ][\d:.]+Z?)?")
CODE = re.compile(r"`[^`]*`")
TARGET = re.compile(r"\]\([^)]*\)")
COMMENT = re.compile(r"<!--.*?-->", re.S)
ITEM = re.compile(r"^\s*(?:[-*+]|\d+\.)\s")

SCALES: dict[str, tuple[float, ...]] = {
    "": (1.0,),
    "%": (1.0, 100.0),
    X: (1.0,),
    "x": (1.0,),
    "K": (1.0,),
    "ms": (1.0, 1e3, 1e-3),
    "µs": (1.0, 1e6, 1e3, 1e-3),
    "us": (1.0, 1e6, 1e3, 1e-3),
    "s": (1.0, 1e-3, 1e-6),
    "B": (1.0,),
    "KB": (1.0, 1e-3, 1 / 1024),
    "KiB": (1.0, 1 / 1024),
    "MB": (1.0, 1e-6, 1 / 2**20),
    "MiB": (1.0, 1 / 2**20, 1e-6),
    "GB": (1.0, 1e-9, 1 / 2**30),
}


@dataclass(frozen=True)
class Figure:
    text: str  # as written, with its unit
    value: float  # K expanded
    half: float  # half the last written digit: what rounding hides
    unit: str


@dataclass(frozen=True)
class Unit:
    page: str
    line: int
    text: str
    files: tuple[str, ...]  # results stems it answers to


def figures(text: str) -> list[Figure]:
    """The figures of one unit's prose, by the rule above."""
    text = COMMENT.sub(" ", text)
    text = CODE.sub(" ", text)
    text = TARGET.sub("] ", text)
    text = DATE.sub(" ", text)
    found = list(NUMBER.finditer(text))
    units = [(m.group("unit") or "").strip() for m in found]
    # a unit after the last of a list of numbers joined by / or a dash applies to each
    for i in range(len(found) - 2, -1, -1):
        if not units[i] and units[i + 1]:
            between = text[found[i].end() : found[i + 1].start()]
            if JOINER.match(between):
                units[i] = units[i + 1]
    out = []
    for match, unit in zip(found, units, strict=True):
        raw = match.group("n")
        digits = raw.replace(",", "")
        decimals = len(digits.split(".")[1]) if "." in digits else 0
        value, half = float(digits), 0.5 * 10**-decimals
        if unit == "K":
            value, half = value * 1000, half * 1000
        if "." not in raw and "," not in raw and not unit and value < 10:
            continue  # a count: runs, rounds, cores, sets
        out.append(Figure(raw + (match.group("unit") or ""), value, half, unit))
    return out


def _numbers(data: Any) -> Iterator[float]:
    if isinstance(data, bool):
        return
    if isinstance(data, int | float):
        yield float(data)
    elif isinstance(data, str):
        yield from (f.value for f in figures(data))
        yield from (float(m) for m in re.findall(r"-?\d+(?:\.\d+)?(?:e-?\d+)?", data))
    elif isinstance(data, dict):
        for value in data.values():
            yield from _numbers(value)
    elif isinstance(data, list):
        if len(data) > SAMPLES and all(isinstance(v, int | float) for v in data):
            return  # raw samples
        for value in data:
            yield from _numbers(value)


def file_numbers(results: Path, stem: str) -> list[float]:
    """Every number the results file holds, sorted: its .md's figures (by the same rule,
    counts included) and its .json's numbers."""
    values: list[float] = []
    md = results / f"{stem}.md"
    if md.exists():
        text = md.read_text()
        values += [f.value for f in figures(text)]
        values += [float(n.replace(",", "")) for n in NUMBER_ANY.findall(text)]
    js = results / f"{stem}.json"
    if js.exists():
        values += list(_numbers(json.loads(js.read_text())))
    return sorted(values)


NUMBER_ANY = re.compile(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?")


def holds(numbers: list[float], figure: Figure) -> bool:
    """Whether a number of the file rounds to the figure, after a conversion its unit allows."""
    for scale in SCALES.get(figure.unit, (1.0,)):
        low = (figure.value - figure.half) / scale
        high = (figure.value + figure.half) / scale
        low, high = min(low, high), max(low, high)
        slack = 1e-9 * max(abs(low), abs(high), 1.0)
        i = bisect.bisect_left(numbers, low - slack)
        if i < len(numbers) and numbers[i] <= high + slack:
            return True
    return False


def units(page: str, text: str) -> list[Unit]:
    """The page's paragraphs, list items and table rows, each with the results files it (or
    the paragraph ending in ``:`` that introduces it) links."""
    lines = text.split("\n")
    if START in text and END in text:  # README's generated block
        a, b = text.index(START), text.index(END)
        first, last = text[:a].count("\n"), text[:b].count("\n")
        lines = [("" if first <= i <= last else line) for i, line in enumerate(lines)]
    # blocks separated by blank lines; fences and headings left out
    blocks: list[tuple[int, list[str]]] = []
    current: list[str] = []
    start, fenced = 0, False
    for i, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            if current:
                blocks.append((start, current))
            current = []
            continue
        if fenced:
            continue
        if not line.strip() or line.startswith("#"):
            if current:
                blocks.append((start, current))
            current = []
            if line.startswith("#"):
                blocks.append((i, ["#"]))
            continue
        if not current:
            start = i
        current.append(line)
    if current:
        blocks.append((start, current))

    out: list[Unit] = []
    introduced: tuple[str, ...] = ()  # the files of a paragraph ending in ':'
    just_before: tuple[str, ...] = ()  # the files of the paragraph right before
    for start, block in blocks:
        if block == ["#"]:
            introduced = just_before = ()
            continue
        is_list = bool(ITEM.match(block[0]))
        is_table = block[0].lstrip().startswith("|")
        pieces: list[tuple[int, str]] = []
        if is_list:
            for j, line in enumerate(block):
                if ITEM.match(line) and not line.startswith("    "):
                    pieces.append((start + j, line))
                elif pieces:
                    pieces[-1] = (pieces[-1][0], pieces[-1][1] + "\n" + line)
        elif is_table:
            pieces = [(start + j, line) for j, line in enumerate(block)]
        else:
            pieces = [(start, "\n".join(block))]
        files: tuple[str, ...] = ()
        for line_no, piece in pieces:
            own = tuple(dict.fromkeys(Path(m).name for m in LINK.findall(piece)))
            # a list or table, or a paragraph of no link of its own, continues what the
            # paragraph before it introduced
            if is_list or is_table:
                inherited = introduced or just_before
            else:
                inherited = introduced if not own else ()
            files = tuple(dict.fromkeys(own + inherited))
            if files:
                out.append(Unit(page, line_no + 1, piece, files))
        just_before = ()
        if not (is_list or is_table):
            body = COMMENT.sub("", "\n".join(block)).rstrip()
            introduced = files if body.endswith(":") else ()
            just_before = files
    return out


def unbacked(page: str, text: str, results: Path) -> list[str]:
    """Each figure of the page's units that no file it answers to holds, as a message."""
    cache: dict[str, list[float]] = {}
    problems = []
    for unit in units(page, text):
        numbers = sorted(
            v for stem in unit.files for v in cache.setdefault(stem, file_numbers(results, stem))
        )
        for figure in figures(unit.text):
            if (page, figure.text) in ALLOWED:
                continue
            if not holds(numbers, figure):
                problems.append(
                    f"{page}:{unit.line}: {figure.text!r} is in none of {', '.join(unit.files)}"
                )
    return problems


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(p for p in DOCS.glob("*.md") if p.name not in GENERATED)]


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.name)
def test_every_figure_beside_a_results_file_is_in_that_file(page: Path) -> None:
    name = str(page.relative_to(ROOT))
    problems = unbacked(name, page.read_text(), ROOT / "bench" / "results")
    assert not problems, "\n".join(problems)


def test_the_pages_cite_results_files() -> None:
    cited = {u.page for p in _pages() for u in units(str(p.relative_to(ROOT)), p.read_text())}
    assert "docs/comparison.md" in cited and "docs/status-tier.md" in cited


def test_every_allowance_is_still_needed() -> None:
    for page, figure in ALLOWED:
        assert figure in (ROOT / page).read_text(), (page, figure)


# --- the checker on a tiny page and results file --------------------------------------------
FAKE_MD = """# Fake: a bench

| system | jobs/s | p99 ms | vs peer |
|---|---|---|---|
| jobtier | 12,345 | 3.71 | 1.36x |
"""
FAKE_JSON = {
    "command": "python bench/fake.py",
    "lag_samples_ms": [float(i) for i in range(1000)],  # raw samples: never matched
    "summary": {"rate": 12345.4, "p99_s": 0.00371, "ratio": 1.3551, "hot": 0.84, "rss": 61865984},
}


@pytest.fixture
def fake(tmp_path: Path) -> Path:
    results = tmp_path / "results"
    results.mkdir()
    (results / "fake.md").write_text(FAKE_MD)
    (results / "fake.json").write_text(json.dumps(FAKE_JSON))
    return results


PAGE = """# A page

Measured by [fake](bench/results/fake.md) (`python bench/fake.py --runs 5`, at `4f48ea4`,
2026-12-02): 12,345 jobs/s, p99 3.71 ms, 1.36\N{MULTIPLICATION SIGN} the peer over 3 runs; 84 % HOT, ~59 MiB.

Not measured: the default is 30 s.

Measured in [fake](bench/results/fake.md) too:

- **rate:** 12.3K jobs/s
- **p99:** 3.7 / 3.71 ms
"""


def test_the_checker_passes_a_page_that_quotes_its_file(fake: Path) -> None:
    assert unbacked("docs/x.md", PAGE, fake) == []
    found = [f.text for u in units("docs/x.md", PAGE) for f in figures(u.text)]
    # counts (5 runs, 3 runs), commits, dates and commands are not figures
    assert found == ["12,345", "3.71 ms", "1.36" + X, "84 %", "59 MiB", "12.3K", "3.7", "3.71 ms"]


@pytest.mark.parametrize(
    ("written", "edited"),
    [
        ("12,345 jobs/s", "12,354 jobs/s"),
        ("3.71 ms", "3.17 ms"),
        ("1.36" + X, "1.46" + X),
        ("84 %", "48 %"),
        ("12.3K", "13.3K"),
        ("3.7 / 3.71 ms", "3.8 / 3.71 ms"),
    ],
)
def test_the_checker_fails_a_hand_edited_figure(fake: Path, written: str, edited: str) -> None:
    edited_page = PAGE.replace(written, edited, 1)
    assert edited_page != PAGE
    problems = unbacked("docs/x.md", edited_page, fake)
    assert len(problems) == 1 and edited.split()[0].split("/")[0].strip() in problems[0]


def test_a_figure_matching_only_a_raw_sample_fails(fake: Path) -> None:
    page = "Measured by [fake](bench/results/fake.md): 517 ms.\n"
    assert unbacked("docs/x.md", page, fake) == ["docs/x.md:1: '517 ms' is in none of fake"]


def test_the_generated_readme_block_is_not_read(fake: Path) -> None:
    page = (
        f"# r\n\n{START}\n\n[fake](bench/results/fake.md): 9.99\N{MULTIPLICATION SIGN}\n\n{END}\n"
    )
    assert units("README.md", page) == []


def test_a_table_after_an_unlinked_paragraph_still_answers_to_the_introduction(
    fake: Path,
) -> None:
    page = (
        "Measured by [fake](bench/results/fake.md):\n\nOn a loaded machine, medians:\n\n"
        "| what | figure |\n|---|---|\n| p99 ms | 3.71 |\n"
    )
    assert unbacked("docs/x.md", page, fake) == []
    assert unbacked("docs/x.md", page.replace("3.71", "3.72"), fake) == [
        "docs/x.md:7: '3.72' is in none of fake"
    ]


def test_a_table_right_after_a_citing_paragraph_answers_to_its_file(fake: Path) -> None:
    page = "See [the results](bench/results/fake.md).\n\n| p99 ms | 3.71 |\n|---|---|\n"
    assert unbacked("docs/x.md", page, fake) == []
    assert unbacked("docs/x.md", page.replace("3.71", "3.17"), fake) == [
        "docs/x.md:3: '3.17' is in none of fake"
    ]
    apart = "See [the results](bench/results/fake.md).\n\nText.\n\n| p99 ms | 3.17 |\n"
    assert units("docs/x.md", apart)[1:] == []  # a table two paragraphs on is not the file's

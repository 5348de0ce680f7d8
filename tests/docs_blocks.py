"""The code blocks of README.md and docs/*.md, as the docs tests see them.

A fenced block whose language is ``python`` or ``sh`` is one a user would run; any other
(``text``, none) is output or a picture. A marker comment on the line before the fence says
how the tests run a block that cannot run on its own:

- no marker: a ``python`` block is executed by tests/unit/test_docs.py, the blocks of one
  page in order in one namespace (a later block may use what an earlier one defined; top-level
  ``await`` is allowed), and then every ``test_*`` function it defined without parameters is
  called; an ``sh`` block has each command checked: ``jobtier …`` parses with jobtier's own
  parser, ``make X`` names a target of the Makefile, ``curl`` names a method and path of the
  OpenAPI document.
- ``<!-- docs-test: server -->``: the block needs a running jobtier (``make run``):
  tests/e2e/test_docs_blocks.py runs it against ``jobtier run``: a python block with
  ``client`` (a ``jobtier.Client``) and ``api_key`` defined, an ``sh`` block in bash with the
  tour's exports (``JOBTIER_URL``, ``JOBTIER_KEY``, ``JOBTIER_ADMIN_KEY``, ``AUTH``) and
  the placeholder job id ``01M8…-7`` replaced by a real one. Its commands are checked as above
  too.
- ``<!-- docs-test: skip REASON -->``: compiled (python) or checked (sh) only; REASON says
  what runs it instead or why nothing can.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNNABLE = ("python", "sh")
PLACEHOLDER_ID = "01M8…-7"
_FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)[^\n]*$")
_MARKER = re.compile(r"^\s*<!-- docs-test: (?P<mode>server|skip)(?P<why>[^>]*)-->\s*$")


@dataclass(frozen=True)
class Block:
    page: str  # the path from the repository's root
    line: int  # of the opening fence, 1-based
    lang: str
    mode: str  # "run", "server" or "skip"
    code: str

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(path: Path) -> list[Block]:
    """The runnable blocks of ``path``, in order."""
    lines = path.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang, start = len(m.group("indent")), m.group("lang"), i
        i += 1
        body: list[str] = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][indent:])
            i += 1
        i += 1
        if lang not in RUNNABLE:
            continue
        marker = _MARKER.match(lines[start - 1]) if start else None
        mode = marker.group("mode") if marker else "run"
        if marker and mode == "skip":
            assert marker.group("why").strip(), f"{path}:{start + 1}: a skip says why"
        page = str(path.relative_to(ROOT))
        found.append(Block(page, start + 1, lang, mode, "\n".join(body) + "\n"))
    return found


def all_blocks() -> list[Block]:
    return [block for path in pages() for block in blocks(path)]


def commands(code: str) -> list[list[str]]:
    """The commands of an ``sh`` block: continuation lines joined, comments and heredoc
    bodies dropped, each split at ``&&``, ``|``, ``;`` and ``&``; each a list of words."""
    out: list[list[str]] = []
    joined: list[str] = []
    pending = ""
    heredoc: str | None = None
    for line in code.splitlines():
        if heredoc is not None:
            if line.strip() == heredoc:
                heredoc = None
            continue
        m = re.search(r"<<-?'?(\w+)'?", line)
        if m:
            heredoc = m.group(1)
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        try:  # a quoted string may run over lines (curl -d '{ … }')
            shlex.split(pending + line, comments=True)
        except ValueError:
            pending += line + "\n"
            continue
        joined.append(pending + line)
        pending = ""
    for line in joined:
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        words: list[str] = []
        for word in lexer:
            if word and set(word) <= set(";&|"):
                if words:
                    out.append(words)
                words = []
            else:
                words.append(word)
        if words:
            out.append(words)
    return out

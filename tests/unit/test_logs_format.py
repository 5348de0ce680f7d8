"""The log lines: the text format shows a job's controls as escapes; in the JSON format a
pair's number, bool or None is as JSON has it, and granian's own lines go through the same
formatter (both were strings of the text format's words: "workers": "1", granian's lines
plain "[INFO] …" among the JSON ones)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

from jobtier.logs import JsonFormatter, TextFormatter, printable


def _formatted(message: str, *args: object) -> dict[str, object]:
    record = logging.LogRecord("jobtier.t", logging.INFO, __file__, 1, message, args, None)
    out: dict[str, object] = json.loads(JsonFormatter().format(record))
    return out


def test_pairs_keep_their_json_types() -> None:
    line = _formatted(
        "event=%s workers=%d ratio=%.2f near_cache=%s gone=%r id=%s msg=%r shards=%s code=%s "
        "queue=%s detail=%s",
        "api_ready", 1, 0.5, True, None, "01M952RK1FKMEBM4Z7A6EPN1TV-5", "a b=c", "0,1", "007",
        "2024", "'hello",
    )  # fmt: skip
    assert line["event"] == "api_ready" and line["workers"] == 1 and line["ratio"] == 0.5
    assert line["near_cache"] is True and line["gone"] is None
    assert line["id"] == "01M952RK1FKMEBM4Z7A6EPN1TV-5" and line["msg"] == "a b=c"
    # a string is a string, whatever it reads like: the argument's type decides
    assert line["shards"] == "0,1" and line["code"] == "007" and line["queue"] == "2024"
    assert line["detail"] == "'hello"  # one quote, not a pair to strip


def test_granians_own_lines_are_json_too() -> None:
    code = (
        "import logging, logging.config\n"
        "from jobtier.logs import granian_logging\n"
        "logging.config.dictConfig(granian_logging('INFO', 'json'))\n"
        "logging.getLogger('_granian').info('Starting granian (main PID: %d)', 7)\n"
        "logging.getLogger('jobtier.api').info('event=api_ready shards=%d', 16)\n"
        "logging.getLogger('granian.access').info('an access line, below its level')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    lines = [json.loads(x) for x in r.stderr.splitlines()]
    assert [(x["logger"], x.get("message") or x.get("event")) for x in lines] == [
        ("_granian", "Starting granian (main PID: 7)"),
        ("jobtier.api", "api_ready"),
    ], r.stderr
    assert r.stdout == ""  # granian's own handlers wrote to stdout


def test_text_lines_show_controls_as_escapes() -> None:
    """A task's error (anyone's text) reaches an operator's terminal through the process's
    log and its traceback: its escape sequences, carriage returns and NUL are shown, never
    acted on; the traceback's own line breaks stay."""
    hostile = "a\x1b[2J\x1b]0;title\x07b\r\x00\x9b"
    try:
        raise ValueError(hostile)
    except ValueError:
        record = logging.LogRecord(
            "jobtier.worker", logging.ERROR, __file__, 1, "event=job_failed error=%s",
            (hostile,), sys.exc_info(),
        )  # fmt: skip
    line = TextFormatter().format(record)
    assert not any(c in line for c in "\x1b\x07\r\x00\x9b"), repr(line)
    assert "error=a\\x1b[2J\\x1b]0;title\\x07b\\r\\x00\\x9b" in line
    assert "\n  Traceback (most recent call last):\n" in line  # its lines kept, indented
    assert line.endswith("ValueError: a\\x1b[2J\\x1b]0;title\\x07b\\r\\x00\\x9b"), repr(line)


def test_a_tasks_error_cannot_forge_a_record() -> None:
    """An exception's message with line breaks and a record's shape in it: every line after
    a record's first is indented, so that no line but the first starts with a time."""
    forged = "ok\n2026-12-07T10:00:00.000Z level=info logger=jobtier.worker event=job_succeeded"
    try:
        raise ValueError(forged)
    except ValueError:
        record = logging.LogRecord(
            "jobtier.worker", logging.ERROR, __file__, 1, "event=job_failed", (), sys.exc_info()
        )
    first, *rest = TextFormatter().format(record).split("\n")
    assert first[:4].isdigit() and rest, first
    assert all(line.startswith("  ") for line in rest), rest
    assert rest[-1].startswith("  2026-12-07T10:00:00.000Z level=info"), rest


def test_text_that_would_reorder_or_break_a_line_is_escaped() -> None:
    """Bidi overrides and isolates, and Unicode's line and paragraph separators, would
    reorder what a terminal shows or break a line: escaped too; other text is left alone."""
    assert printable("ok \u202egnp.exe\u2066x\u2069\u2028y\u2029\u200f é ✓") == (
        "ok \\u202egnp.exe\\u2066x\\u2069\\u2028y\\u2029\\u200f é ✓"
    )

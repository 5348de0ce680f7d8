"""Structured logs: one line per event, ``key=value`` (text) or one JSON object (json).

Messages are written as ``event=name key=value …``; the JSON formatter turns those pairs
into fields, so the same call sites serve both formats.
"""

from __future__ import annotations

import logging
import re
import sys
import time

import orjson

_PAIR = re.compile(r"(\w+)=('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|\S+)")
# What a job's text may hold that a terminal would act on: C0 controls (escape sequences, a
# carriage return, a bell, NUL), DEL and C1 (a task's error or log line is anyone's text); and
# what would reorder or break the text shown: bidi overrides and isolates, and Unicode's own
# line and paragraph separators
_CONTROLS = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\u2028\u2029]"
)


def _escaped(m: re.Match[str]) -> str:
    c = m[0]
    named = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}.get(c)
    return named or (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")


def printable(text: str) -> str:
    """``text`` shown, never acted on, by a terminal: its controls as escapes (``\\x1b``);
    line breaks and tabs are kept."""
    return _CONTROLS.sub(_escaped, text)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        level, message = record.levelname.lower(), record.getMessage()
        line = f"{ts}.{int(record.msecs):03d}Z level={level} logger={record.name} {message}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        # a traceback quotes a task's exception, anyone's text: its controls escaped, and every
        # line after the first indented, so that none reads as a record of its own (each
        # starts with its time, at the line's start)
        return printable(line).replace("\n", "\n  ")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        out: dict[str, object] = {
            "ts": record.created,
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        pairs = _PAIR.findall(message)
        if pairs and message.startswith(pairs[0][0] + "="):
            typed = _typed(record)
            for key, value in pairs:
                out[key] = typed[key] if key in typed else _unquoted(value)
        else:
            out["message"] = message
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(out).decode()


_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*\d*(?:\.\d+)?([diouxXeEfFgGcrsa%])")


def _typed(record: logging.LogRecord) -> dict[str, object]:
    """The pairs whose value the message wrote from a number, a bool or None (one ``%``
    conversion of such an argument), as JSON has them: the type is the argument's, not a
    guess from the text (a queue named 2024 stays a string)."""
    args = record.args
    if not isinstance(args, tuple) or not args or not isinstance(record.msg, str):
        return {}
    specs = [m for m in _SPEC.finditer(record.msg) if m.group(1) != "%"]
    starts = {m.start(): (i, m) for i, m in enumerate(specs)}
    out: dict[str, object] = {}
    for pair in _PAIR.finditer(record.msg):
        found = starts.get(pair.start(2))
        if found is None or found[1].end() != pair.end(2) or found[0] >= len(args):
            continue
        arg, conversion = args[found[0]], found[1].group(1)
        if isinstance(arg, bool) or arg is None:
            out[pair.group(1)] = arg if conversion in "sr" else int(bool(arg))
        elif isinstance(arg, int | float) and conversion in "diufFeEgG":
            # as written: %.1f of 0.25 reads 0.2 in the text line, and here
            number = found[1].group() % arg
            out[pair.group(1)] = float(number) if conversion in "fFeEgG" else int(arg)
    return out


def _unquoted(text: str) -> str:
    """A pair's value without the quotes ``%r`` put around it (both ends, the same)."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


class Unforeseen:
    """Logs the failures a retry loop did not foresee: with its traceback the first time its
    class is seen by this logger's user, as one line after that (a loop that retries must not
    flood the log)."""

    def __init__(self, log: logging.Logger) -> None:
        self.log = log
        self.seen: set[str] = set()

    def __call__(self, event: str, exc: BaseException, wait: float, **fields: object) -> None:
        extra = "".join(f" {k}={v}" for k, v in fields.items())
        first = type(exc).__name__ not in self.seen
        self.seen.add(type(exc).__name__)
        self.log.error(
            "%s retry_in=%.1fs%s error=%r", event, wait, extra, exc, exc_info=exc if first else None
        )


def granian_logging(level: str = "INFO", fmt: str = "text") -> dict[str, object]:
    """granian's ``log_dictconfig``: its own loggers (its start, its workers, their exits)
    through the root's handler, as ``setup`` makes it, so that they read as ours do (JSON
    with ``fmt`` json). granian applies it with ``dictConfig``, which replaces every handler:
    the root's is made again here."""
    formatter = f"{__name__}.{'JsonFormatter' if fmt == 'json' else 'TextFormatter'}"
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"jobtier": {"()": formatter}},
        "handlers": {
            "stderr": {
                "class": "logging.StreamHandler",
                "formatter": "jobtier",
                "stream": "ext://sys.stderr",
            }
        },
        "root": {"handlers": ["stderr"], "level": level.upper()},
        "loggers": {
            "_granian": {"handlers": [], "propagate": True},
            "granian.access": {"handlers": [], "propagate": True, "level": "WARNING"},
        },
    }


def setup(level: str = "INFO", fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # httpx logs one INFO line per request: the dispatcher's deliveries log their own
    for noisy in ("asyncio", "uvicorn.access", "_granian", "granian.access", "httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

"""How deeply a JSON text nests arrays and objects, told without decoding it.

A decoder recursing through JSON nested a thousand deep raises ``RecursionError``; the API
refuses such a body first (api/bounds.py), and the outbox relay such a payload (persist/
outbox.py), each with the limit in its answer.
"""

from __future__ import annotations

import re

MAX_JSON_DEPTH = 64
"""Arrays and objects inside one another in a request body (the job's payload included)."""

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_LEAF = re.compile(rb"\[\]|\{\}")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def nests_deeper(text: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether ``text`` nests arrays and objects more than ``limit`` deep.

    Cheap for the usual text: with no more brackets than the limit it cannot be too deep.
    Otherwise the strings are dropped, then the brackets alone are peeled one level a pass
    (every innermost ``[]``/``{}`` at once): a text still not empty after ``limit`` passes is
    too deep. Malformed JSON that stops peeling early is left to the decoder (False).
    """
    if text.count(b"[") + text.count(b"{") <= limit:
        return False
    brackets = _STRING.sub(b"", text).translate(None, _NOT_BRACKETS)
    for _ in range(limit):
        peeled = _LEAF.sub(b"", brackets)
        if not peeled or len(peeled) == len(brackets):
            return False  # within the limit, or not JSON (the decoder says so)
        brackets = peeled
    return True

"""A task's payload schema, as the API applies it to every tenant's submits of the task.

Two sources, two levels of trust. A Python worker's schema comes from the task's own type
(msgspec), written by whoever deploys the workers, who reach Redis anyway: it is applied as
jsonschema reads it, with Python's ``re`` for its patterns, as the worker's own check does.
An HTTP worker's (``PUT /v1/worker/tasks``, its ``worker`` named ``http:…``) comes from a
holder of a worker key, and the API's one thread runs it for every tenant: it must not make
the API read a file or a URL, nor take more than linear time in its payload. So it is held
to a subset (``schema_problem(strict=True)``):

- a ``$ref`` names one of its ``$defs`` (``#/$defs/name``), and they do not refer to each
  other in a circle; followed out, the schema stays under ``MAX_EXPANDED`` nodes (a few
  definitions each used twice by the next double at every level);
- no ``$schema`` but at its root (dropped), no ``$id``, ``$anchor`` or dynamic references:
  nothing that makes jsonschema switch to a validator of its own, whose patterns would be
  Python's again;
- its patterns are matched by RE2 (no look-arounds or back-references; ``\\w``, ``\\d``, ``\\b``
  are ASCII there), ``\\uXXXX`` read as the character;
- no ``patternProperties`` (jsonschema matches its keys with Python's ``re`` in several
  keywords), no ``uniqueItems`` (compares every pair of items), no ``unevaluated…`` (finds
  what was evaluated by validating the subschemas again, level by level).

Whatever the source, nothing is ever retrieved (a reference out of the schema fails), and a
payload the check cannot judge (a recursion too deep, a number too large for ``multipleOf``)
is a 422 saying so, never a 500.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import re2
from jsonschema import Draft202012Validator, validators
from jsonschema.exceptions import SchemaError, ValidationError, best_match
from referencing import Registry, Resource
from referencing.exceptions import NoSuchResource, Unresolvable

from jobtier.core.errors import InvalidRequest

log = logging.getLogger("jobtier.engine.catalog")
MAX_EXPANDED = 10_000  # nodes of an HTTP worker's schema with its references followed out
MAX_SCHEMA_BYTES = 256 * 1024
_RE2 = re2.Options()
_RE2.log_errors = False  # a pattern RE2 refuses is our answer, not a line on stderr
_VALUES = frozenset({"const", "enum", "default", "examples"})  # values, not schemas
_NAMED = frozenset({"properties", "$defs", "definitions", "dependentSchemas"})  # name: schema
_REFUSED = {
    "$id": "a $id",
    "$anchor": "a $anchor",
    "$dynamicRef": "a $dynamicRef",
    "$dynamicAnchor": "a $dynamicAnchor",
    "$recursiveRef": "a $recursiveRef",
    "patternProperties": "patternProperties (use propertyNames with a pattern)",
    "uniqueItems": "uniqueItems (it compares every pair of items)",
    # jsonschema finds what was evaluated by validating the subschemas again, at each level
    "unevaluatedProperties": "unevaluatedProperties (use additionalProperties)",
    "unevaluatedItems": "unevaluatedItems (use items)",
}
_DEF_REF = re.compile(r"#/\$defs/([^/~]+)")
_UNICODE_ESCAPE = re.compile(r"(?<!\\)\\u([0-9a-fA-F]{4})")
Check = Callable[[Any], None]


@functools.lru_cache(maxsize=4096)
def _linear(pattern: str) -> Any:
    return re2.compile(_UNICODE_ESCAPE.sub(r"\\x{\1}", pattern), _RE2)


def _pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Iterator[Any]:
    if validator.is_type(instance, "string") and not _linear(pattern).search(instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _refuse(uri: str) -> Resource[Any]:
    raise NoSuchResource(ref=uri)  # type: ignore[call-arg]


_Linear = validators.extend(Draft202012Validator, {"pattern": _pattern})  # type: ignore[no-untyped-call]
_NOTHING_RETRIEVED: Registry[Any] = Registry(retrieve=_refuse)  # type: ignore[call-arg]


def schema_problem(schema: dict[str, Any], strict: bool = True) -> str | None:
    """Why ``schema`` cannot check payloads here (``strict``: an HTTP worker's, held to the
    subset above), in words that say what and where; None if it can."""
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        where = "".join(f"[{p!r}]" for p in exc.absolute_path)
        return f"not a JSON Schema: {exc.message[:300]}{f' (at {where})' if where else ''}"
    if not strict:
        return None
    if len(msgspec.json.encode(schema)) > MAX_SCHEMA_BYTES:
        return f"over {MAX_SCHEMA_BYTES} bytes"
    defs = schema.get("$defs") or {}
    for where, key, value in _keywords(schema, ""):
        at = f" (at {where or '/'})"
        if key in _REFUSED:
            return f"{_REFUSED[key]} is not supported here{at}"
        if key == "$schema" and where:
            return f"a $schema inside the schema is not supported here{at}"
        if key == "$ref":
            m = _DEF_REF.fullmatch(value) if isinstance(value, str) else None
            if m is None:
                return f"$ref {str(value)[:200]!r} is not '#/$defs/<name>': only those are followed{at}"
            if m.group(1) not in defs:
                return f"$ref {value[:200]!r} points at nothing in the schema{at}"
        if key == "pattern" and isinstance(value, str):
            try:
                _linear(value)
            except re2.error as exc:
                why = exc.args[0].decode() if exc.args and isinstance(exc.args[0], bytes) else exc
                return f"pattern {value[:200]!r} is not one RE2 matches (in linear time): {why}{at}"
    return _expansion_problem(schema, defs)


def _keywords(node: Any, where: str) -> Iterator[tuple[str, str, Any]]:
    """(where, keyword, value) of every keyword of a schema and of its subschemas (not of
    the values in ``const``, ``enum``, …; a property's name is not a keyword)."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield where, key, value
            if key in _NAMED and isinstance(value, dict):
                for name, sub in value.items():
                    yield from _keywords(sub, f"{where}/{key}/{name}")
            elif key not in _VALUES:
                yield from _keywords(value, f"{where}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _keywords(value, f"{where}/{i}")


def _expansion_problem(schema: dict[str, Any], defs: dict[str, Any]) -> str | None:
    """A circle of ``$defs``, or the schema over ``MAX_EXPANDED`` nodes once every reference
    is followed out (what a validation may walk), or None."""
    sizes: dict[str, int] = {}
    visiting: list[str] = []

    def size(node: Any) -> int:
        if isinstance(node, dict):
            total = 1
            for key, value in node.items():
                if key == "$ref" and isinstance(value, str):
                    total += of_def(value.rpartition("/")[2])
                elif key in _NAMED and isinstance(value, dict):
                    if key != "$defs":  # the definitions count where they are used
                        total += sum(size(v) for v in value.values())
                elif key not in _VALUES:
                    total += size(value)
                if total > MAX_EXPANDED:
                    raise OverflowError
            return total
        if isinstance(node, list):
            return sum(size(v) for v in node)
        return 0

    def of_def(name: str) -> int:
        if name in visiting:
            raise RecursionError(name)
        if name not in sizes:
            visiting.append(name)
            sizes[name] = size(defs[name])
            visiting.pop()
        return sizes[name]

    try:
        size(schema)
        for name in defs:
            of_def(name)
    except RecursionError as exc:
        return f"$defs/{exc.args[0]} refers to itself (through $ref): not supported here"
    except OverflowError:
        return f"over {MAX_EXPANDED} nodes once its $refs are followed: not supported here"
    return None


def schema_check(schema: dict[str, Any], strict: bool = True) -> Check | None:
    """A payload check from a JSON Schema (None, logged, for one that cannot check payloads
    here): raises InvalidRequest naming the first bad field."""
    if (problem := schema_problem(schema, strict)) is not None:
        log.warning("event=bad_payload_schema error=%s", problem)
        return None
    if strict:
        # its only $schema is at the root (checked): dropped, so that no subschema's
        # validator is other than the one built here
        body = {k: v for k, v in schema.items() if k != "$schema"}
        validator = _Linear(body, registry=_NOTHING_RETRIEVED)
    else:
        validator = Draft202012Validator(schema, registry=_NOTHING_RETRIEVED)

    def check(payload: Any) -> None:
        # best_match descends into anyOf (an optional nested object) to the field at fault
        try:
            error = best_match(validator.iter_errors(payload))
        except (RecursionError, OverflowError, Unresolvable, re2.error) as exc:
            # (a reference it cannot follow is jsonschema's own Unresolvable)
            detail = f"payload: its task's schema cannot judge it ({type(exc).__name__})"
            raise InvalidRequest(detail, field="payload") from None
        if error is not None:
            where = "payload" + "".join(
                f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path
            )
            message = error.message
            if error.validator == "required" and isinstance(error.instance, dict):
                missing = [k for k in error.validator_value if k not in error.instance]
                if missing:
                    where, message = f"{where}.{missing[0]}", "required, and missing"
            else:
                message = json_words(message, error.instance)
            raise InvalidRequest(f"{where}: {message[:300]}", field=where)

    return check


def json_words(message: str, instance: Any) -> str:
    """A jsonschema message that opens with the value's Python repr (``None``, ``True``,
    ``{'a': 1}``) opens with its JSON instead: the client sent JSON."""
    text = repr(instance)
    if not message.startswith(text):
        return message
    try:
        shown = msgspec.json.encode(instance).decode()
    except (TypeError, msgspec.EncodeError):
        return message
    return (shown if len(shown) <= 80 else shown[:79] + "…") + message[len(text) :]

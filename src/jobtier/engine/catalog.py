"""The task catalogue: the tasks every worker says it runs, with their policies and payload
schemas, so that producers that do not import the tasks (the HTTP API) apply them at submit.

Workers write one entry per task to the hash ``jt:tasks`` when they start and at every full
heartbeat (``publish``). The API reads it (``TaskCatalog``, refreshed in the background and
on a miss) to refuse unknown types (unless ``JOBTIER_REQUIRE_KNOWN_TYPES=0``) and payloads
that do not fit the task's schema, and to give jobs their task's queue, attempts and
compensation. During a deploy two versions of a task may advertise different policies: the
latest writer wins, and a worker's own policy still governs the retries it decides.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import re2
from jsonschema import Draft202012Validator, validators
from jsonschema.exceptions import SchemaError, ValidationError, best_match
from referencing import Registry, Resource
from referencing.exceptions import NoSuchResource, Unresolvable
from referencing.jsonschema import DRAFT202012

from jobtier.core.errors import InvalidRequest
from jobtier.core.keys import Keys
from jobtier.core.model import TaskAd, TaskInfo
from jobtier.runtime.loop import every
from jobtier.runtime.stopping import stop_task
from jobtier.store.redis import RedisClient

log = logging.getLogger("jobtier.engine.catalog")
REFRESH_EVERY = 5.0  # seconds between loads of the catalogue
MISS_REFRESH = 1.0  # least seconds between loads for a type it does not know
_ad_decoder = msgspec.json.Decoder(TaskAd)


# A task's schema may come from an HTTP worker (PUT /v1/worker/tasks), and the API applies it
# to every tenant's submits of the task: it must not make the API read a file or a URL, nor
# match a pattern in more than linear time. So a schema's references must point inside it
# (nothing is ever retrieved), its patterns are matched by RE2 (no backtracking), and
# `patternProperties`, whose keys jsonschema matches with Python's own `re` in several
# keywords, is refused (a property name's pattern goes in `propertyNames`).
_RE2 = re2.Options()
_RE2.log_errors = False  # a pattern RE2 refuses is our answer, not a line on stderr
_SKIP = frozenset({"const", "enum", "default", "examples"})  # values, not schemas
_NAMED = frozenset({"properties", "$defs", "definitions", "dependentSchemas"})  # name: schema


@functools.lru_cache(maxsize=4096)
def _linear(pattern: str) -> Any:
    return re2.compile(pattern, _RE2)


def _pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Iterator[Any]:
    if validator.is_type(instance, "string") and not _linear(pattern).search(instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _refuse(uri: str) -> Resource[Any]:
    raise NoSuchResource(ref=uri)  # type: ignore[call-arg]


_Validator = validators.extend(Draft202012Validator, {"pattern": _pattern})  # type: ignore[no-untyped-call]
_NOTHING_RETRIEVED: Registry[Any] = Registry(retrieve=_refuse)  # type: ignore[call-arg]


def schema_problem(schema: dict[str, Any]) -> str | None:
    """Why ``schema`` cannot check payloads here — not a JSON Schema (draft 2020-12), a
    reference out of it or to nothing in it, a pattern RE2 cannot match, `patternProperties`
    — or None."""
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        where = "".join(f"[{p!r}]" for p in exc.absolute_path)
        return f"not a JSON Schema: {exc.message[:300]}{f' (at {where})' if where else ''}"
    root = Resource.from_contents(schema, default_specification=DRAFT202012)
    resolver = _NOTHING_RETRIEVED.with_resource("", root).resolver()
    for where, key, value in _keywords(schema, ""):
        at = f" (at {where or '/'})"
        if key in ("$ref", "$dynamicRef") and isinstance(value, str):
            if not value.startswith("#"):
                return f"{key} {value[:200]!r} points out of the schema: only '#…' is followed{at}"
            try:
                resolver.lookup(value)
            except Unresolvable:
                return f"{key} {value[:200]!r} points at nothing in the schema{at}"
        elif key == "$id" and where:
            return f"a $id inside the schema is not supported here{at}"
        elif key == "patternProperties":
            return f"patternProperties is not supported here: use propertyNames{at}"
        elif key == "pattern" and isinstance(value, str):
            try:
                _linear(value)
            except re2.error as exc:
                why = exc.args[0].decode() if exc.args and isinstance(exc.args[0], bytes) else exc
                return f"pattern {value[:200]!r} cannot be matched in linear time (RE2): {why}{at}"
    return None


def _keywords(node: Any, where: str) -> Iterator[tuple[str, str, Any]]:
    """(where, keyword, value) of every keyword of a schema and of its subschemas (not of
    the values in ``const``, ``enum``, …; a property's name is not a keyword)."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield where, key, value
            if key in _NAMED and isinstance(value, dict):
                for name, sub in value.items():
                    yield from _keywords(sub, f"{where}/{key}/{name}")
            elif key not in _SKIP:
                yield from _keywords(value, f"{where}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _keywords(value, f"{where}/{i}")


def schema_check(schema: dict[str, Any]) -> Any:
    """A payload check from a JSON Schema: raises InvalidRequest naming the first bad field."""
    if (problem := schema_problem(schema)) is not None:
        log.warning("event=bad_payload_schema error=%s", problem)
        return None
    validator = _Validator(schema, registry=_NOTHING_RETRIEVED)

    def check(payload: Any) -> None:
        # best_match descends into anyOf (an optional nested object) to the field at fault
        error = best_match(validator.iter_errors(payload))
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


async def publish(redis: RedisClient, keys: Keys, ads: list[TaskAd]) -> None:
    """Write a worker's task entries (one HSET for all of them)."""
    if ads:
        mapping = {ad.type: msgspec.json.encode(ad) for ad in ads}
        await redis.hset(keys.tasks(), mapping=mapping)  # type: ignore[arg-type]


class TaskCatalog:
    """The catalogue as the API reads it: refreshed every ``REFRESH_EVERY`` seconds, and at
    once (at most every ``MISS_REFRESH`` seconds) when a submit names a type it does not know.
    An entry counts while its last advert is at most ``ttl`` seconds old."""

    def __init__(self, redis: RedisClient, keys: Keys, *, ttl: float = 86400.0) -> None:
        self.redis = redis
        self.keys = keys
        self.ttl = ttl
        self._ads: dict[str, TaskAd] = {}
        self._infos: dict[str, TaskInfo] = {}
        self._checks: dict[str, tuple[bytes, Any]] = {}  # type -> (schema JSON, check)
        self._loaded_at = 0.0
        self._task: asyncio.Task[None] | None = None

    def info(self, type: str) -> TaskInfo | None:
        ad = self._ads.get(type)
        if ad is None or time.time() - ad.seen_at > self.ttl:
            return None
        return self._infos.get(type)

    def names(self) -> list[str]:
        now = time.time()
        return sorted(t for t, ad in self._ads.items() if now - ad.seen_at <= self.ttl)

    def ads(self) -> list[TaskAd]:
        """Every live entry (the admin API, the OpenAPI document)."""
        now = time.time()
        return [ad for _, ad in sorted(self._ads.items()) if now - ad.seen_at <= self.ttl]

    async def ensure(self, types: set[str]) -> None:
        """Refresh now if a type is unknown and the last load is old enough."""
        if any(self.info(t) is None for t in types) and (
            time.monotonic() - self._loaded_at >= MISS_REFRESH
        ):
            await self.load()

    async def load(self) -> None:
        raw = await self.redis.hgetall(self.keys.tasks())
        ads: dict[str, TaskAd] = {}
        for name, value in raw.items():
            try:
                ad = _ad_decoder.decode(value)
            except msgspec.DecodeError:
                continue  # written by a newer jobtier: its own workers will still run it
            ads[name.decode() if isinstance(name, bytes) else name] = ad
        infos = {}
        for name, ad in ads.items():
            check = None
            if ad.payload_schema is not None:
                encoded = msgspec.json.encode(ad.payload_schema)
                cached = self._checks.get(name)
                if cached is None or cached[0] != encoded:
                    cached = self._checks[name] = (encoded, schema_check(ad.payload_schema))
                check = cached[1]
            infos[name] = TaskInfo(ad.queue, ad.max_attempts, check, ad.on_failure, ad.encrypt)
        self._ads, self._infos = ads, infos
        self._loaded_at = time.monotonic()

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="jobtier-catalog")

    async def stop(self) -> None:
        await stop_task(self._task, "task catalog refresh")

    async def _loop(self) -> None:
        await every(REFRESH_EVERY, self.load, event="catalog_refresh", log=log)

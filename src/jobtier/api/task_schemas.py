"""The OpenAPI document with the task catalogue in it, so a client (or a fuzzer) knows what a
submit of each type must carry.

While the API refuses types no worker advertises (``JOBTIER_REQUIRE_KNOWN_TYPES``, the
default), a ``JobSpec`` with any ``type`` and ``payload`` is not what it accepts: this
rewrites ``JobSpec`` (and ``FlowJob``, ``ScheduleSpec`` where served) as one variant per known
task, ``type`` its name and ``payload`` its schema, with the payload types' definitions as
components. Rebuilt when the catalogue changes.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import orjson

from jobtier.core.model import TaskAd

SPECS = ("JobSpec", "FlowJob", "ScheduleSpec")  # what names a task and carries its payload


def _component_name(task: str, name: str) -> str:
    return f"TaskPayload.{task}.{name}"


def _rebase(schema: Any, task: str) -> Any:
    """A payload schema from ``msgspec.json.schema`` (refs into its own ``$defs``) with its
    refs pointing at the components ``_component_name`` makes."""
    if isinstance(schema, dict):
        out = {}
        for key, value in schema.items():
            if key == "$defs":
                continue
            if key == "$ref" and isinstance(value, str) and value.startswith("#/$defs/"):
                name = _component_name(task, value.removeprefix("#/$defs/"))
                out[key] = f"#/components/schemas/{name}"
            else:
                out[key] = _rebase(value, task)
        return out
    if isinstance(schema, list):
        return [_rebase(item, task) for item in schema]
    return schema


def with_tasks(document: dict[str, Any], ads: Sequence[TaskAd]) -> dict[str, Any]:
    """``document`` with a variant of each spec per task of ``ads`` (unchanged without any)."""
    if not ads:
        return document
    doc = copy.deepcopy(document)
    components = doc["components"]["schemas"]
    for ad in ads:
        schema = ad.payload_schema
        if schema is None:
            continue
        for name, definition in (schema.get("$defs") or {}).items():
            components[_component_name(ad.type, name)] = _rebase(definition, ad.type)
    for spec in SPECS:
        base = components.get(spec)
        if base is None:
            continue
        variants = []
        for ad in ads:
            variant = copy.deepcopy(base)
            variant["title"] = f"{spec} of {ad.type}"
            props = variant["properties"]
            props["type"] = {"const": ad.type}
            if ad.payload_schema is not None:
                props["payload"] = {
                    **_rebase(ad.payload_schema, ad.type),
                    "description": props.get("payload", {}).get("description", ""),
                }
                required = set(variant.get("required", []))
                variant["required"] = sorted(required | {"type", "payload"})
            variants.append(variant)
        components[spec] = {
            "title": spec,
            "description": (
                (base.get("description") or "")
                + " One variant per task a live or recently seen worker runs."
            ).strip(),
            "oneOf": variants,
        }
    _batch_variants(components, ads)
    return doc


def _batch_variants(components: dict[str, Any], ads: Sequence[TaskAd]) -> None:
    """``BatchSpec`` as one variant per task (its items each a payload of the task; a typed
    task's payload is an item, so no chunk_size), and a callback's type one of the untyped
    tasks (its payload is the batch's summary, which a typed task's schema decides on)."""
    base, callback = components.get("BatchSpec"), components.get("BatchCallback")
    if base is None or callback is None:
        return
    variants = []
    for ad in ads:
        variant = copy.deepcopy(base)
        variant["title"] = f"BatchSpec of {ad.type}"
        props = variant["properties"]
        props["type"] = {"const": ad.type}
        if ad.payload_schema is not None:
            props["items"]["items"] = _rebase(ad.payload_schema, ad.type)
            props["chunk_size"] = {"type": "null", "default": None}
        variants.append(variant)
    components["BatchSpec"] = {"title": "BatchSpec", "description": base.get("description", "")}
    components["BatchSpec"]["oneOf"] = variants
    untyped = [ad.type for ad in ads if ad.payload_schema is None]
    allowed: dict[str, Any] = {"enum": untyped} if untyped else {"not": {}}
    callback["properties"]["type"] = allowed


class TaskDocument:
    """The served document, rebuilt when the catalogue's adverts change."""

    def __init__(self, document: dict[str, Any], require_known: bool) -> None:
        self.document = document
        self.require_known = require_known
        self._key: tuple[tuple[str, bytes], ...] | None = None
        self._bytes = orjson.dumps(document)

    def render(self, ads: Sequence[TaskAd]) -> bytes:
        if not self.require_known:
            return self._bytes
        key = tuple((ad.type, orjson.dumps(ad.payload_schema)) for ad in ads)
        if key != self._key:
            self._bytes = orjson.dumps(with_tasks(self.document, ads))
            self._key = key
        return self._bytes

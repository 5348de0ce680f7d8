"""MkDocs hooks (mkdocs.yml ``hooks:``): the pages generated from jobtier's own code at build
time, so they cannot drift from it.

- ``<!-- generated:openapi -->`` in a page becomes the HTTP API reference, rendered from the
  OpenAPI document the server serves at ``/v1/openapi.json`` (``jobtier.api.app.
  openapi_document``, the function ``create_app`` builds it with, given the Postgres
  extension ``jobtier api`` runs with and the default settings). The served document adds
  the payload schema of each task the live workers advertise; a build has no workers.
- ``<!-- generated:cli -->`` becomes the command-line reference, walked from the argparse
  parser ``jobtier`` itself parses with (``jobtier.cli.main.build_parser``).
- The benchmark result files (``bench/results/*.md``) join the site as pages outside the nav,
  so the pages link to the file each figure comes from and the strict build checks the link.

The renderers are plain functions of the document and the parser, so the tests call them too.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("get", "put", "post", "patch", "delete")


# --- OpenAPI ---------------------------------------------------------------------------------
def openapi_spec() -> dict[str, Any]:
    from jobtier.api.app import openapi_document
    from jobtier.api.records import postgres_extension
    from jobtier.config import Settings

    settings = Settings.from_env({})
    return openapi_document(settings, postgres_extension(settings))


def _cell(text: Any) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _schema_text(schema: dict[str, Any]) -> str:
    """A short, one-line account of a JSON Schema."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"[`{name}`](#schema-{name.lower()})"
    for combo in ("anyOf", "oneOf"):
        if combo in schema:
            return " or ".join(_schema_text(s) for s in schema[combo])
    kind = schema.get("type", "any" if "enum" not in schema else "")
    if isinstance(kind, list):
        kind = " or ".join(kind)
    if kind == "array" and "items" in schema:
        text = f"array of {_schema_text(schema['items'])}"
    else:
        text = f"`{kind}`" if kind else ""
    rules = []
    if "enum" in schema:
        rules.append("one of " + ", ".join(f"`{json.dumps(v)}`" for v in schema["enum"]))
    for key, word in (
        ("minimum", "≥"),
        ("exclusiveMinimum", ">"),
        ("maximum", "≤"),
        ("exclusiveMaximum", "<"),
        ("minLength", "length ≥"),
        ("maxLength", "length ≤"),
        ("minItems", "items ≥"),
        ("maxItems", "items ≤"),
    ):
        if key in schema:
            rules.append(f"{word} {schema[key]}")
    if "pattern" in schema:
        rules.append(f"pattern `{schema['pattern']}`")
    if "format" in schema:
        rules.append(f"format `{schema['format']}`")
    if "default" in schema:
        rules.append(f"default `{json.dumps(schema['default'])}`")
    if not text:
        return "; ".join(rules)
    return text + (f" ({'; '.join(rules)})" if rules else "")


def _security(operation: dict[str, Any], document: dict[str, Any]) -> str:
    schemes = operation.get("security", document.get("security", []))
    names = [name for requirement in schemes for name in requirement]
    if not names:
        return "none"
    words = {
        "tenantKey": "a tenant's key",
        "adminKey": "the admin key",
        "workerKey": "a worker key",
    }
    return " or ".join(words.get(name, name) for name in names)


def render_openapi(document: dict[str, Any]) -> str:
    """The document as markdown: each operation (method, path, what it does, key, parameters,
    body, answers), then each schema with its fields."""
    out: list[str] = [
        f"Generated from the OpenAPI {document['openapi']} document (`{document['info']['title']}`"
        f" API version {document['info']['version']}) at build time.",
        "",
        _cell(document["info"].get("description", "")),
        "",
        "### Operations",
        "",
    ]
    for path, item in document["paths"].items():
        for method in METHODS:
            op = item.get(method)
            if op is None:
                continue
            out += [f"#### `{method.upper()} {path}`", ""]
            if op.get("summary"):
                out += [_cell(op["summary"]) + ".", ""]
            if op.get("description"):
                out += [op["description"].strip(), ""]
            out += [f"**Key:** {_security(op, document)}.", ""]
            params = op.get("parameters", [])
            if params:
                out += [
                    "| parameter | in | schema | required | description |",
                    "|---|---|---|---|---|",
                ]
                for p in params:
                    out.append(
                        f"| `{p['name']}` | {p['in']} | {_cell(_schema_text(p.get('schema', {})))} "
                        f"| {'yes' if p.get('required') else 'no'} | {_cell(p.get('description', ''))} |"
                    )
                out.append("")
            body = op.get("requestBody")
            if body:
                for media, content in body.get("content", {}).items():
                    schema = _schema_text(content.get("schema", {}))
                    line = f"**Body** (`{media}`): {schema}."
                    if body.get("description"):
                        line += " " + _cell(body["description"])
                    out += [line, ""]
            out += ["| status | meaning | body |", "|---|---|---|"]
            for status, answer in sorted(op.get("responses", {}).items()):
                bodies = [
                    f"`{media}` {_schema_text(c.get('schema', {}))}"
                    for media, c in answer.get("content", {}).items()
                ]
                headers = ", ".join(f"`{h}`" for h in answer.get("headers", {}))
                meaning = _cell(answer.get("description", ""))
                if headers:
                    meaning += f" (headers: {headers})"
                out.append(f"| {status} | {meaning} | {_cell(', '.join(bodies)) or '—'} |")
            out.append("")
    out += ["### Schemas", ""]
    for name, schema in document["components"]["schemas"].items():
        out += [f"#### `{name}` {{ #schema-{name.lower()} }}", ""]
        if schema.get("description"):
            out += [_cell(schema["description"]), ""]
        props = schema.get("properties")
        if props:
            required = set(schema.get("required", []))
            out += ["| field | schema | required |", "|---|---|---|"]
            for field, sub in props.items():
                text = _cell(_schema_text(sub))
                if sub.get("description"):
                    text += " — " + _cell(sub["description"])
                out.append(f"| `{field}` | {text} | {'yes' if field in required else 'no'} |")
            out.append("")
        else:
            out += [_cell(_schema_text(schema)), ""]
    return "\n".join(out)


# --- CLI -------------------------------------------------------------------------------------
def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return list(action.choices.items())
    return []


def _usage(parser: argparse.ArgumentParser) -> str:
    return " ".join(parser.format_usage().removeprefix("usage: ").split())


def _render_command(parser: argparse.ArgumentParser, depth: int, out: list[str]) -> None:
    out += ["#" * depth + f" `{parser.prog}`", ""]
    if parser.description:
        # a description with line breaks keeps them (a list, as bench's): those lines as text
        prose, _, listing = parser.description.strip().partition("\n\n")
        out += [prose, ""]
        if listing:
            out += ["```text", listing, "```", ""]
    out += ["```text", _usage(parser), "```", ""]
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        metavar = action.metavar if isinstance(action.metavar, str) else None
        name = ", ".join(action.option_strings) or metavar or action.dest
        if action.option_strings and action.nargs != 0:
            name += f" {metavar or action.dest.upper()}"
        text = _cell(action.help or "")
        if action.choices:
            text += f" (one of {', '.join(f'`{c}`' for c in action.choices)})"
        if (
            action.option_strings
            and action.default not in (None, False, argparse.SUPPRESS)
            and "default" not in text
        ):
            text += f" (default: `{action.default}`)"
        rows.append(f"| `{_cell(name)}` | {text} |")
    if rows:
        out += ["| argument | meaning |", "|---|---|", *rows, ""]
    for _, sub in _subcommands(parser):
        _render_command(sub, depth + 1, out)


def render_cli(parser: argparse.ArgumentParser) -> str:
    """The parser as markdown: the command list, then each command (and each action of a
    command that has them) with its usage and arguments."""
    out = [parser.description.strip() if parser.description else "", ""]
    out += ["| command | what it does |", "|---|---|"]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                out.append(f"| [`{choice.dest}`](#jobtier-{choice.dest}) | {_cell(choice.help)} |")
    out.append("")
    for _, sub in _subcommands(parser):
        _render_command(sub, 3, out)
    return "\n".join(out)


def cli_markdown() -> str:
    from jobtier.cli.main import build_parser

    return render_cli(build_parser())


GENERATED = {
    "<!-- generated:openapi -->": lambda: render_openapi(openapi_spec()),
    "<!-- generated:cli -->": cli_markdown,
}


# --- the hooks -------------------------------------------------------------------------------
def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    for path in sorted((ROOT / "bench" / "results").glob("*.md")):
        src_uri = f"bench/results/{path.name}"
        if files.get_file_from_path(src_uri) is None:
            files.append(File.generated(config, src_uri, abs_src_path=str(path)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    for marker, render in GENERATED.items():
        if marker in markdown:
            markdown = markdown.replace(marker, render())
    return markdown

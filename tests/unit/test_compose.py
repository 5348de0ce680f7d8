"""docker-compose.yml, the Dockerfile and .dockerignore, checked without Docker.

Nothing here can run the stack (there is no Docker engine on the development machine), so the
files are parsed and held to what jobtier needs: the services and their images, health checks
and start order, Redis's durability flags, the published port, settings that
``jobtier.config.Settings`` knows (and accepts), and commands that ``jobtier``'s own parser
accepts. Each check returns the problems it finds; ``test_each_check_catches_its_breakage``
breaks a copy of the files one way at a time and makes sure the right check notices, so no
check can pass by looking at nothing.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import re
import shlex
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from jobtier.cli.main import build_parser
from jobtier.config import Settings, env_name
from jobtier.core.errors import ConfigError
from jobtier.worker.registry import TaskRegistry

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"

# service -> the jobtier subcommand it runs
JOBTIER_SERVICES = {
    "migrate": "migrate",
    "api": "api",
    "worker": "worker",
    "scheduler": "scheduler",
    "persister": "persister",
    "dispatcher": "dispatcher",
}
SERVICES = {"redis", "postgres", *JOBTIER_SERVICES}
# the services without a health check, and why
NO_HEALTHCHECK = {
    "migrate": "a one-shot: its exit status is its health (service_completed_successfully)",
}
# the processes that serve no port are checked with `jobtier check ROLE`
CHECKED_ROLES = ("worker", "scheduler", "persister", "dispatcher")
ONE_SHOTS = {"migrate"}
# service -> {dependency: condition} it must at least have
DEPENDS = {
    "migrate": {"postgres": "service_healthy"},
    "api": {
        "redis": "service_healthy",
        "postgres": "service_healthy",
        "migrate": "service_completed_successfully",
    },
    "worker": {"redis": "service_healthy"},
    "scheduler": {"redis": "service_healthy"},
    "persister": {
        "redis": "service_healthy",
        "postgres": "service_healthy",
        "migrate": "service_completed_successfully",
    },
    "dispatcher": {
        "redis": "service_healthy",
        "postgres": "service_healthy",
        "migrate": "service_completed_successfully",
    },
}
API_PORT = 8000
KNOWN_ENV = {env_name(f) for f in dataclasses.fields(Settings)}
Doc = dict[str, Any]


# --- reading the files ------------------------------------------------------------------------
def load_compose(text: str | None = None) -> Doc:
    doc = yaml.safe_load(COMPOSE.read_text() if text is None else text)
    assert isinstance(doc, dict), "docker-compose.yml is not a mapping"
    return doc


_VAR = re.compile(r"\$\$|\$\{(\w+)(?:(:?[-?])([^}]*))?\}|\$(\w+)")


def interpolate(value: str, host_env: dict[str, str] | None = None) -> str:
    """Compose's variable substitution, with an empty host environment by default: the
    values a fresh `docker compose up` runs with."""
    env = host_env or {}

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(4)
        op, default = m.group(2), m.group(3) or ""
        value = env.get(name)
        if op == ":-":
            return value or default
        if op == "-":
            return default if value is None else value
        if op in (":?", "?") and not value:
            raise ValueError(f"${{{name}}} is required: {default}")
        return value or ""

    return _VAR.sub(sub, value)


def environment(service: Doc) -> dict[str, str]:
    """A service's environment (mapping or KEY=VALUE list form), interpolated."""
    raw = service.get("environment") or {}
    if isinstance(raw, list):
        raw = dict(item.partition("=")[::2] for item in raw)
    return {str(k): interpolate("" if v is None else str(v)) for k, v in raw.items()}


def command(service: Doc) -> list[str]:
    cmd = service.get("command") or []
    return shlex.split(cmd) if isinstance(cmd, str) else [str(c) for c in cmd]


def parse_jobtier(argv: list[str]) -> Any:
    """``jobtier``'s own parser on a command (its usage error captured, not printed)."""
    with contextlib.redirect_stderr(io.StringIO()) as err:
        try:
            return build_parser().parse_args(argv)
        except SystemExit:
            raise ValueError(err.getvalue().strip().splitlines()[-1]) from None


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    lines: list[str] = []
    pending = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        lines.append(pending + stripped)
        pending = ""
    out = []
    for line in lines:
        instruction, _, args = line.partition(" ")
        out.append((instruction.upper(), args.strip()))
    return out


def dockerfile_env(text: str) -> dict[str, str]:
    """The image's ENV (KEY=VALUE form), which every container starts with."""
    env = {}
    for inst, args in dockerfile_instructions(text):
        if inst == "ENV":
            for item in shlex.split(args):
                key, _, value = item.partition("=")
                env[key] = value
    return env


# --- the checks: each returns the problems it finds ---------------------------------------------
def check_services(doc: Doc) -> list[str]:
    services = doc.get("services") or {}
    return [f"no service {name!r}" for name in sorted(SERVICES - set(services))]


def check_images(doc: Doc) -> list[str]:
    """Every jobtier service builds the repository's Dockerfile, or runs the image that one
    of them builds; all of them run the same image."""
    services = doc.get("services") or {}
    problems = []
    built, images = set(), set()
    for name in JOBTIER_SERVICES:
        service = services.get(name, {})
        images.add(service.get("image"))
        build = service.get("build")
        if build is None:
            continue
        context = build if isinstance(build, str) else build.get("context", ".")
        dockerfile = (
            "Dockerfile" if isinstance(build, str) else build.get("dockerfile", "Dockerfile")
        )
        if (ROOT / context).resolve() != ROOT or not (ROOT / context / dockerfile).is_file():
            problems.append(
                f"{name}: builds {context}/{dockerfile}, not the repository's Dockerfile"
            )
        built.add(service.get("image"))
    if not built:
        problems.append("no jobtier service builds the Dockerfile")
    for name in JOBTIER_SERVICES:
        service = services.get(name, {})
        if "build" not in service and service.get("image") not in built:
            problems.append(f"{name}: runs {service.get('image')}, not the jobtier image")
    if len(images) > 1 or None in images:
        problems.append(f"the jobtier services name different images: {images}")
    for name, expected in (("redis", "redis:7"), ("postgres", "postgres:15")):
        image = str(services.get(name, {}).get("image", ""))
        if not image.startswith(expected):
            problems.append(f"{name}: image {image!r}, expected {expected}")
    return problems


def check_healthchecks(doc: Doc) -> list[str]:
    services = doc.get("services") or {}
    problems = []
    for name, service in services.items():
        health = service.get("healthcheck") or {}
        test = health.get("test")
        has_one = bool(test) and not health.get("disable") and test != ["NONE"]
        if name in NO_HEALTHCHECK and has_one:
            problems.append(f"{name} has a health check now: take it out of NO_HEALTHCHECK")
        elif name not in NO_HEALTHCHECK and not has_one:
            problems.append(f"{name}: no health check")
    api_test = " ".join(
        map(str, (services.get("api", {}).get("healthcheck") or {}).get("test") or [])
    )
    if f"127.0.0.1:{API_PORT}/readyz" not in api_test:
        problems.append(f"api: the health check does not ask /readyz on port {API_PORT}")
    for role in CHECKED_ROLES:
        test = (services.get(role, {}).get("healthcheck") or {}).get("test") or []
        if test and test != ["CMD", "jobtier", "check", role]:
            problems.append(f"{role}: the health check is not `jobtier check {role}`: {test}")
    return problems


def check_redis(doc: Doc) -> list[str]:
    args = command((doc.get("services") or {}).get("redis", {}))
    options = {}
    for i, arg in enumerate(args):
        if arg.startswith("--") and i + 1 < len(args):
            options[arg[2:]] = args[i + 1]
    problems = []
    if options.get("appendonly") != "yes":
        problems.append("redis: AOF is not on (--appendonly yes)")
    policy = options.get("maxmemory-policy", "")
    if policy != "noeviction" and not policy.startswith("volatile-"):
        problems.append(f"redis: maxmemory-policy {policy or '(default)'} may evict jobs")
    return problems


def check_ports(doc: Doc) -> list[str]:
    api = (doc.get("services") or {}).get("api", {})
    published = []
    for port in api.get("ports") or []:
        target = port.get("target") if isinstance(port, dict) else str(port).rsplit(":", 1)[-1]
        published.append(str(target).split("/")[0])
    problems = []
    if str(API_PORT) not in published:
        problems.append(f"api: container port {API_PORT} is not published ({published})")
    try:
        args = parse_jobtier(command(api))
        image_env = dockerfile_env(DOCKERFILE.read_text()) if DOCKERFILE.is_file() else {}
        settings = Settings.from_env({**image_env, **environment(api)})
    except (ValueError, ConfigError) as exc:
        return [*problems, f"api: {exc}"]
    port = args.port if args.port is not None else settings.api_port
    host = args.host if args.host is not None else settings.api_host
    if port != API_PORT:
        problems.append(f"api: listens on {port}, the published port is {API_PORT}")
    if host != "0.0.0.0":
        problems.append(f"api: listens on {host}: unreachable from outside its container")
    return problems


def check_depends_on(doc: Doc) -> list[str]:
    services = doc.get("services") or {}
    problems = []
    for name, service in services.items():
        depends = service.get("depends_on") or {}
        if isinstance(depends, list):  # the short form means service_started
            depends = {d: {"condition": "service_started"} for d in depends}
        for dep, spec in depends.items():
            condition = (spec or {}).get("condition", "service_started")
            target = services.get(dep)
            if target is None:
                problems.append(f"{name}: depends on unknown service {dep}")
            elif condition == "service_healthy" and not (target.get("healthcheck") or {}).get(
                "test"
            ):
                problems.append(f"{name}: waits for {dep} to be healthy, which has no check")
            elif condition == "service_completed_successfully" and dep not in ONE_SHOTS:
                problems.append(f"{name}: waits for {dep} to complete, which never does")
        for dep, condition in DEPENDS.get(name, {}).items():
            got = (depends.get(dep) or {}).get("condition")
            if got != condition:
                problems.append(f"{name}: depends on {dep} with {got}, expected {condition}")
    for name in ONE_SHOTS:
        if str(services.get(name, {}).get("restart", "no")) != "no":
            problems.append(f"{name}: a one-shot must not restart")
    return problems


def check_environment(doc: Doc, text: str) -> list[str]:
    problems = []
    # every JOBTIER_* name anywhere in the file: environment keys, ${...} substitutions
    for name in sorted(set(re.findall(r"\bJOBTIER_[A-Z0-9_]+", text))):
        if name not in KNOWN_ENV:
            problems.append(f"{name} is not a setting jobtier knows")
    services = doc.get("services") or {}
    for name, service in services.items():
        for key in environment(service):
            if key.startswith("JOBTIER_") and name not in JOBTIER_SERVICES:
                problems.append(f"{name}: sets {key}, but runs no jobtier process")
    postgres = environment(services.get("postgres", {}))
    for name in JOBTIER_SERVICES:
        env = environment(services.get(name, {}))
        try:
            settings = Settings.from_env(env)
        except ConfigError as exc:
            problems.append(f"{name}: {exc}")
            continue
        redis = urlsplit(settings.redis_url)
        if (redis.hostname, redis.port) != ("redis", 6379):
            problems.append(
                f"{name}: JOBTIER_REDIS_URL {settings.redis_url} is not the redis service"
            )
        db = urlsplit(settings.database_url)
        expected = (
            "postgres",
            5432,
            postgres.get("POSTGRES_USER"),
            postgres.get("POSTGRES_PASSWORD"),
            "/" + postgres.get("POSTGRES_DB", ""),
        )
        if (db.hostname, db.port, db.username, db.password, db.path) != expected:
            problems.append(f"{name}: JOBTIER_DATABASE_URL does not match the postgres service")
        if name == "api" and not settings.tenant_keys():
            problems.append("api: JOBTIER_API_KEYS names no tenant")
        if name == "api" and not settings.admin_key:
            problems.append("api: no JOBTIER_ADMIN_KEY")
    return problems


def check_commands(doc: Doc) -> list[str]:
    services = doc.get("services") or {}
    problems = []
    for name, subcommand in JOBTIER_SERVICES.items():
        argv = command(services.get(name, {}))
        try:
            args = parse_jobtier(argv)
        except ValueError as exc:
            problems.append(f"{name}: `jobtier {' '.join(argv)}`: {exc}")
            continue
        if args.command != subcommand:
            problems.append(f"{name}: runs `jobtier {args.command}`, expected {subcommand}")
        elif subcommand == "worker":
            try:
                TaskRegistry.load(args.tasks)
            except ConfigError as exc:
                problems.append(f"{name}: {exc}")
        elif subcommand == "api" and (args.workers or 1) < 2:
            problems.append(f"{name}: one server process; the stack runs two")
    return problems


# extras a deployment switches on by a setting alone: the image must hold their packages
IMAGE_EXTRAS = ("crypto", "otlp")


def _extras_problems(installs: list[str]) -> list[str]:
    """The package's install names the extras of IMAGE_EXTRAS, each one pyproject has."""
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    extras: list[str] = []
    for args in installs:
        for word in shlex.split(args):
            found = re.fullmatch(r"\.\[([\w,-]+)\]", word)
            if found:
                extras += found.group(1).split(",")
    problems = [f"the image installs extra {e!r}, which pyproject lacks" for e in extras]
    problems = [p for p, e in zip(problems, extras, strict=True) if e not in declared]
    problems += [f"the image installs the package without the {e} extra" for e in IMAGE_EXTRAS
                 if e not in extras]  # fmt: skip
    return problems


def check_dockerfile(text: str, ignore: str) -> list[str]:
    instructions = dockerfile_instructions(text)
    problems = []
    froms = [args for inst, args in instructions if inst == "FROM"]
    if not froms or not froms[-1].startswith("python:3.11-slim"):
        problems.append(f"the image is not built FROM python:3.11-slim: {froms}")
    entrypoints = [args for inst, args in instructions if inst == "ENTRYPOINT"]
    if not entrypoints or yaml.safe_load(entrypoints[-1]) != ["jobtier"]:
        problems.append(f'the ENTRYPOINT is not ["jobtier"] (exec form): {entrypoints}')
    users = [args for inst, args in instructions if inst == "USER"]
    if not users or users[-1].split(":")[0] in ("root", "0"):
        problems.append("the image runs as root")
    installs = [args for inst, args in instructions if inst == "RUN" and "pip install" in args]
    if not installs:
        problems.append("the image does not pip install the package")
    problems += _extras_problems(installs)
    ignored = {line.strip().rstrip("/") for line in ignore.splitlines()}
    ignored.discard("")
    for inst, args in instructions:
        if inst in ("COPY", "ADD") and "--from" not in args:
            *sources, _ = args.split()
            found = 0
            for source in sources:
                if source.rstrip("/") in ignored:
                    problems.append(f"{inst} {source}: excluded by .dockerignore")
                if any(c in source for c in "*?["):  # a pattern may match nothing
                    found += any(ROOT.glob(source))
                elif (ROOT / source).exists():
                    found += 1
                else:
                    problems.append(f"{inst} {source}: not in the repository (the build fails)")
            if not found:
                problems.append(f"{inst} {args}: copies nothing (the build fails)")
    for key in dockerfile_env(text):
        if key.startswith("JOBTIER_") and key not in KNOWN_ENV:
            problems.append(f"ENV {key}: not a setting jobtier knows")
    for needed in (".venv", ".data", "bench/results", "loadtest/results", "**/__pycache__"):
        if needed not in ignored:
            problems.append(f".dockerignore does not exclude {needed}")
    return problems


# --- the tests -----------------------------------------------------------------------------------
def compose_checks() -> dict[str, Callable[[Doc, str], list[str]]]:
    return {
        "services": lambda doc, _: check_services(doc),
        "images": lambda doc, _: check_images(doc),
        "healthchecks": lambda doc, _: check_healthchecks(doc),
        "redis": lambda doc, _: check_redis(doc),
        "ports": lambda doc, _: check_ports(doc),
        "depends_on": lambda doc, _: check_depends_on(doc),
        "environment": check_environment,
        "commands": lambda doc, _: check_commands(doc),
    }


@pytest.mark.parametrize("check", list(compose_checks()))
def test_compose_file(check: str) -> None:
    text = COMPOSE.read_text()
    assert compose_checks()[check](load_compose(text), text) == []


def test_dockerfile() -> None:
    assert DOCKERFILE.is_file() and DOCKERIGNORE.is_file()
    assert check_dockerfile(DOCKERFILE.read_text(), DOCKERIGNORE.read_text()) == []


def test_every_jobtier_service_runs_the_image_entrypoint() -> None:
    """The commands are jobtier's arguments: the image's entrypoint supplies the program."""
    services = load_compose()["services"]
    for name in JOBTIER_SERVICES:
        assert "entrypoint" not in services[name], name
        assert command(services[name])[0] == JOBTIER_SERVICES[name], name


def test_interpolation_follows_compose() -> None:
    assert interpolate("${A:-x}", {}) == "x" and interpolate("${A:-x}", {"A": ""}) == "x"
    assert interpolate("${A-x}", {"A": ""}) == "" and interpolate("${A}b", {"A": "a"}) == "ab"
    assert interpolate("$$A ${B:-k:v}") == "$A k:v"


def _set(path: str, value: Any) -> Callable[[Doc], None]:
    """A mutation: set (or, with value None, delete) the item at a dotted path."""

    def mutate(doc: Doc) -> None:
        *parents, last = path.split(".")
        node: Any = doc
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if value is None:
            del node[last]
        elif isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return mutate


def _all(*mutations: Callable[[Doc], None]) -> Callable[[Doc], None]:
    def mutate(doc: Doc) -> None:
        for m in mutations:
            m(doc)

    return mutate


BREAKAGES: list[tuple[str, Callable[[Doc], None], str]] = [
    ("services", _set("services.scheduler", None), "no service 'scheduler'"),
    (
        "images",
        _all(_set("services.worker.build", None), _set("services.worker.image", "python:3.11")),
        "worker: runs python:3.11, not the jobtier image",
    ),
    ("images", _set("services.worker.build", "./other"), "not the repository's Dockerfile"),
    ("images", _set("services.api.image", "other:1"), "different images"),
    ("images", _set("services.redis.image", "redis:6"), "redis: image"),
    ("healthchecks", _set("services.api.healthcheck", None), "api: no health check"),
    ("healthchecks", _set("services.postgres.healthcheck", None), "postgres: no health check"),
    ("healthchecks", _set("services.api.healthcheck.test.3", "pass"), "does not ask /readyz"),
    ("healthchecks", _set("services.scheduler.healthcheck", None), "scheduler: no health check"),
    ("healthchecks", _set("services.persister.healthcheck.test.3", "worker"), "not `jobtier check"),
    ("redis", _set("services.redis.command.2", "no"), "AOF is not on"),
    ("redis", _set("services.redis.command.4", "allkeys-lru"), "may evict"),
    ("ports", _set("services.api.ports", None), "is not published"),
    ("ports", _set("services.api.command.2", "127.0.0.1"), "listens on 127.0.0.1"),
    ("ports", _set("services.api.command.4", "9000"), "listens on 9000"),
    (
        "depends_on",
        _set("services.api.depends_on.migrate.condition", "service_started"),
        "api: depends on migrate with service_started",
    ),
    ("depends_on", _set("services.worker.depends_on", None), "worker: depends on redis"),
    ("depends_on", _set("services.migrate.restart", "always"), "must not restart"),
    (
        "depends_on",
        _set("services.worker.depends_on.migrate", {"condition": "service_healthy"}),
        "which has no check",
    ),
    ("environment", _set("x-jobtier-env.JOBTIER_REDIS_URI", "redis://redis"), "JOBTIER_REDIS_URI"),
    ("environment", _set("x-jobtier-env.JOBTIER_API_KEYS", "nocolon"), "is not 'key:tenant'"),
    ("environment", _set("x-jobtier-env.JOBTIER_SHARDS", "many"), "JOBTIER_SHARDS='many'"),
    (
        "environment",
        _set("x-jobtier-env.JOBTIER_REDIS_URL", "redis://localhost:6379/0"),
        "is not the redis service",
    ),
    (
        "environment",
        _set("services.postgres.environment.POSTGRES_DB", "other"),
        "does not match the postgres service",
    ),
    ("environment", _set("services.redis.environment", {"JOBTIER_PREFIX": "x"}), "runs no jobtier"),
    ("commands", _set("services.worker.command.0", "wrker"), "worker: `jobtier wrker"),
    ("commands", _set("services.scheduler.command", ["persister"]), "expected scheduler"),
    ("commands", _set("services.worker.command.1", "jobtier.nosuchmodule"), "cannot import"),
    ("commands", _set("services.api.command.6", "1"), "one server process"),
]


@pytest.mark.parametrize(("check", "mutate", "expected"), BREAKAGES, ids=[b[2] for b in BREAKAGES])
def test_each_check_catches_its_breakage(
    check: str, mutate: Callable[[Doc], None], expected: str
) -> None:
    text = COMPOSE.read_text()
    doc = copy.deepcopy(load_compose(text))
    mutate(doc)
    # the environment check also reads the raw text: give it the mutated file's
    problems = compose_checks()[check](doc, yaml.safe_dump(doc))
    assert any(expected in p for p in problems), problems


def test_a_service_may_run_the_built_image_without_building_it() -> None:
    doc = copy.deepcopy(load_compose())
    del doc["services"]["worker"]["build"]
    assert check_images(doc) == []


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ('ENTRYPOINT ["jobtier"]', 'ENTRYPOINT ["python"]', "ENTRYPOINT is not"),
        ('ENTRYPOINT ["jobtier"]', "ENTRYPOINT jobtier", "ENTRYPOINT is not"),
        ("USER jobtier", "USER root", "runs as root"),
        ("FROM python:3.11-slim", "FROM python:3.12", "FROM python:3.11-slim"),
        ("COPY src ./src", "COPY srcs ./src", "COPY srcs: not in the repository"),
        ("COPY pyproject.toml README.md* ./", "COPY READ*.txt ./", "copies nothing"),
        ('RUN pip install ".[crypto,otlp]"', "RUN true", "does not pip install"),
        ('".[crypto,otlp]"', ".", "without the crypto extra"),
        ('".[crypto,otlp]"', '".[crypto]"', "without the otlp extra"),
        ('".[crypto,otlp]"', '".[crypto,otlp,nope]"', "extra 'nope', which pyproject lacks"),
        ("ENV JOBTIER_API_HOST=", "ENV JOBTIER_API_HOSTNAME=", "ENV JOBTIER_API_HOSTNAME"),
    ],
)
def test_each_dockerfile_check_catches_its_breakage(old: str, new: str, expected: str) -> None:
    text = DOCKERFILE.read_text()
    assert old in text, f"the Dockerfile no longer says {old!r}: update this test"
    problems = check_dockerfile(text.replace(old, new), DOCKERIGNORE.read_text())
    assert any(expected in p for p in problems), problems


def test_dockerignore_check_catches_its_breakage() -> None:
    ignore = DOCKERIGNORE.read_text()
    assert check_dockerfile(DOCKERFILE.read_text(), ignore.replace(".venv\n", "")) != []
    problems = check_dockerfile(DOCKERFILE.read_text(), ignore + "src\n")
    assert any("excluded by .dockerignore" in p for p in problems), problems


# --- the `replicas` profile: a replica and three sentinels ---------------------------------------
PROFILE = "replicas"
SENTINEL_PORT = 26379


def _options(argv: list[str]) -> dict[str, list[str]]:
    """``--name value...`` options of a redis-server command line."""
    out: dict[str, list[str]] = {}
    name = ""
    for arg in argv[1:]:
        if arg.startswith("--"):
            name = arg[2:]
            out[name] = []
        elif name:
            out[name].append(arg)
    return out


def _sentinel_conf(service: Doc) -> dict[str, list[str]]:
    """The sentinel's configuration lines its command writes, by directive (``sentinel
    monitor`` as ``monitor``)."""
    script = command(service)[-1]
    conf: dict[str, list[str]] = {}
    for line in script.splitlines():
        words = line.split()
        if words and words[0] == "sentinel":
            conf[words[1]] = words[2:]
        elif words and words[0] == "port":
            conf["port"] = words[1:]
    return conf


def test_the_default_stack_has_no_profile_service() -> None:
    """`docker compose up` (no profile) runs what it ran before the profile existed."""
    services = load_compose()["services"]
    default = {name for name, s in services.items() if not s.get("profiles")}
    assert default == SERVICES


def test_the_replicas_profile_runs_a_durable_replica_and_three_sentinels() -> None:
    services = load_compose()["services"]
    profiled = {name for name, s in services.items() if PROFILE in (s.get("profiles") or [])}
    sentinels = sorted(name for name in profiled if name.startswith("sentinel-"))
    assert profiled == {"redis-replica", *sentinels} and len(sentinels) == 3
    replica = _options(command(services["redis-replica"]))
    assert replica["replicaof"] == ["redis", "6379"]
    # promoted, it must keep acknowledged jobs as the master did
    assert replica["appendonly"] == ["yes"] and replica["maxmemory-policy"] == ["noeviction"]
    for name in sentinels:
        argv = command(services[name])
        assert argv[:2] == ["sh", "-c"] and "--sentinel" in argv[-1], name
        conf = _sentinel_conf(services[name])
        assert conf["port"] == [str(SENTINEL_PORT)]
        master, host, port, quorum = conf["monitor"]
        assert (host, port, quorum) == ("redis", "6379", "2"), name
        assert master == Settings().redis_sentinel_master  # the name jobtier asks for
        assert conf["resolve-hostnames"] == ["yes"]  # `redis` is a name, not an address
        assert (services[name].get("healthcheck") or {}).get("test") == [
            "CMD", "redis-cli", "-p", str(SENTINEL_PORT), "ping"
        ]  # fmt: skip


def test_jobtier_services_use_the_sentinels_only_when_named() -> None:
    services = load_compose()["services"]
    sentinels = sorted(name for name in services if name.startswith("sentinel-"))
    named = ",".join(f"{name}:{SENTINEL_PORT}" for name in sentinels)
    for name in JOBTIER_SERVICES:
        raw = services[name].get("environment") or {}
        off = Settings.from_env({k: interpolate(str(v)) for k, v in raw.items()})
        assert off.redis_sentinels == "", name
        host_env = {"JOBTIER_REDIS_SENTINELS": named}
        on = Settings.from_env({k: interpolate(str(v), host_env) for k, v in raw.items()})
        assert on.sentinel_addresses() == [(s, SENTINEL_PORT) for s in sentinels], name

"""Schemathesis against the live app: every answer must be what ``/v1/openapi.json`` says.

The app runs on a loopback uvicorn (real Redis and Postgres, the Postgres extension, as the
e2e fixtures do) in a thread of its own: schemathesis calls it synchronously from the test.
Each operation is driven by its generated cases (schema examples, boundary values of every
constraint, then random fuzzing; valid and invalid data), with a tenant key, or the admin
key on admin routes. A case fails on:

* any 5xx (``not_a_server_error``);
* a status code, content type, body or header the document does not give for the
  operation (``status_code_conformance``, ``content_type_conformance``,
  ``response_schema_conformance``, ``response_headers_conformance``);
* invalid data accepted (``negative_data_rejection``) or valid data refused
  (``positive_data_acceptance``, but for the rules the document states only in prose);
* a route that ignores a missing key, or a method it lacks answered with anything but a 405
  with ``Allow`` (``ignored_auth``, ``unsupported_method``, ``allow_header_conformance``).

Bounded and replayable: ``FUZZ_EXAMPLES`` cases per operation for the fuzzing phase (``make
test``: the default; ``make fuzz``: thousands), drawn from a new seed each run so that runs
together try more than one would. The seed is printed before and after the cases
(``fuzz seed …``); ``FUZZ_SEED=<seed>`` draws that run's cases again.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
import uvicorn
from schemathesis import Case
from schemathesis.config import SchemathesisConfig
from schemathesis.core.transport import Response
from schemathesis.specs.openapi.checks import positive_data_acceptance

from jobtier.api.app import create_app
from jobtier.api.records import PostgresExtension
from jobtier.config import Settings
from jobtier.dev.local_redis import free_port
from tests.fixtures.api import ADMIN, KEYS, advertise_tasks_sync

FUZZ_EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "12"))
SEED = int(os.environ.get("FUZZ_SEED") or secrets.randbits(32))

# Rules the document states only in words (JSON Schema cannot say them), by the member they
# name and the status a refusal has: a run-at in the past, a cron expression, a time zone, a
# cursor this API did not make, a dependency that is no job of the tenant's, a flow's ref used
# twice, its after naming no ref (or making a cycle). Valid data refused for anything else is
# a deviation.
PROSE_RULES = {
    "run_at": 422, "since": 422, "cron": 422, "timezone": 422, "cursor": 400,
    "idempotency_key": 400,
    "depends_on": 422, "ref": 422, "after": 422,
    "url": 422,  # a callback URL that does not resolve to a public address (webhooks/safety.py)
    "min": 422,  # the scaling read's min above its max (api/scaling.py)
    # a keyed submit beside an option it excludes (or in a batch), a max_wait below its
    # seconds, an encrypted payload debounced (docs/debounce-throttle.md)
    "debounce": 422, "throttle": 422, "max_wait": 422, "unique": 422,
    # a durable submit asking for more replicas than the deployment's masters have
    "Jobtier-Replicas": 400,
    # a concurrency_limit without its concurrency_key; a queue's rate period without a rate
    # (or a concurrency), which would lift its limits
    "concurrency_limit": 422, "rate": 422,
    # a dead-letter replay with no filter that does not say "all": true
    "all": 422,
    # a schedule's dates out of range, an end not after its start, a window with no slot (a
    # change of its interval may leave none too)
    "start_at": 422, "end_at": 422, "interval": 422,
    # a job's expiry: in the past, not after its run_at or delay, both given, with a key
    "expires_at": 422, "expires_in": 422,
    # a job's own timeout beside debounce, throttle or unique
    "timeout": 422,
}  # fmt: skip
# JSON Schema's integer is any number without a fraction, 3.0 too; the server takes 3 only
# (stated in the document's description)
INTEGER_AS_FLOAT = re.compile(r"Expected `int( \| null)?`, got `float`")


class ThreadedApi:
    """The app on a loopback uvicorn, in a thread with its own event loop."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server: uvicorn.Server | None = None
        self.failed: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="fuzzed-api", daemon=True)
        self.ready = threading.Event()

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # reported by start()
            self.failed = exc
        finally:
            self.ready.set()

    async def _serve(self) -> None:
        extension = PostgresExtension(self.settings)
        extension.webhook_resolver = _no_dns  # callback URLs: IP literals only, no DNS traffic
        app = create_app(self.settings, extension)
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, loop="none", lifespan="on",
            log_config=None, access_log=False,
        )  # fmt: skip
        self.server = uvicorn.Server(config)
        serving = asyncio.create_task(self.server.serve())
        while not self.server.started and not serving.done():
            await asyncio.sleep(0.01)
        self.ready.set()
        await serving

    def start(self) -> None:
        self.thread.start()
        assert self.ready.wait(30), "the API did not start"
        if self.failed is not None or self.server is None or not self.server.started:
            raise RuntimeError(f"the API did not start: {self.failed!r}")

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive(), "the API thread did not stop"


async def _no_dns(host: str, port: int) -> list[str]:
    """The fuzzer's callback URLs name random hosts: none is looked up (a refusal, 422)."""
    raise OSError(f"{host}: names are not resolved in the fuzz test")


@pytest.fixture
def live_api(pg_settings: Settings) -> Iterator[ThreadedApi]:
    settings = pg_settings.replace(
        api_keys=",".join(f"{k}:{t}" for t, k in KEYS.items()),
        admin_key=ADMIN,
        gc_freeze=False,
        sse_heartbeat_seconds=0.2,  # an SSE read ends after its first event or heartbeat
    )
    advertise_tasks_sync(settings)  # the test tasks are known, as if their workers ran
    api = ThreadedApi(settings)
    try:
        api.start()
        yield api
    finally:
        api.stop()


def fuzz_config(base_url: str) -> SchemathesisConfig:
    return SchemathesisConfig.from_dict(
        {
            "seed": SEED,
            "base-url": base_url,
            "max-stream-events": 1,
            "request-timeout": 30,
            "auth": {
                "openapi": {
                    "tenantKey": {"bearer": KEYS["acme"]},
                    "adminKey": {"bearer": ADMIN},
                }
            },
            "generation": {"mode": "all", "max-examples": FUZZ_EXAMPLES, "database": "none"},
            # no learning from the server's answers (ids, times): a seed draws the same cases
            # every run
            "phases": {
                phase: {
                    "extra-data-sources": {"responses": False},
                    **({"error-feedback": {"enabled": False}} if phase == "fuzzing" else {}),
                }
                for phase in ("examples", "coverage", "fuzzing")
            }
            | {"stateful": {"enabled": False}},
            "checks": {
                # 413/414/431 are documented refusals of invalid (too large) data
                "negative_data_rejection": {
                    "expected-statuses": [400, 401, 403, 404, 405, 413, 414, 415, 422, 431]
                },
            },
        }
    )


@pytest.fixture
def api_schema(live_api: ThreadedApi) -> Any:
    return schemathesis.openapi.from_url(
        f"{live_api.url}/v1/openapi.json", config=fuzz_config(live_api.url)
    )


def positive_data_accepted(ctx: Any, response: Response, case: Case[Any]) -> bool | None:
    """``positive_data_acceptance``, but for a refusal naming a rule stated only in prose."""
    if response.status_code in (400, 422):
        problem = response.json()
        field = str(problem.get("field") or "").rpartition(".")[2]
        if PROSE_RULES.get(field) == response.status_code:
            return None
        if INTEGER_AS_FLOAT.match(str(problem.get("detail", ""))):
            return None
    return positive_data_acceptance(ctx, response, case)


schema = schemathesis.pytest.from_fixture("api_schema")


CASES: Counter[str] = Counter()


@pytest.fixture(scope="module", autouse=True)
def report_cases(pytestconfig: pytest.Config) -> Iterator[None]:
    """Say the seed before the cases (a run that hangs or is killed still told it), and how
    many cases ran with it after (not captured: in the terminal summary's place)."""
    reporter = pytestconfig.pluginmanager.get_plugin("terminalreporter")
    capture = pytestconfig.pluginmanager.get_plugin("capturemanager")

    def say(line: str) -> None:
        if reporter is not None and capture is not None:
            with capture.global_and_fixture_disabled():
                reporter.write_line(line)

    replay = f"fuzz seed {SEED} (FUZZ_SEED={SEED} replays these cases)"
    say(f"\n{replay}")
    yield
    if CASES:
        say(f"\nfuzzed {CASES.total()} cases over {len(CASES)} operations; {replay}")


# One test item runs every operation's cases (~12,700 with the schema's examples): 300 s, the
# suite's bound per test, is too short on a slow shared machine (a run took over 300 s while
# the whole suite took 28 minutes, against 13 an hour before). The bound is against a hang,
# and each request has its own 30 s one.
@pytest.mark.timeout(1200)
@schema.parametrize()
def test_the_api_answers_as_its_document_says(case: Case[Any]) -> None:
    CASES[case.operation.label] += 1
    case.call_and_validate(
        excluded_checks=[positive_data_acceptance],
        additional_checks=[positive_data_accepted],
    )

"""Pure unit tests of the engine's seams: codes, keys, settings, retry policy, task loading."""

from __future__ import annotations

import functools
import random
import re
from fractions import Fraction
from importlib import resources
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jobtier.config import Settings, masked_url, settings_table
from jobtier.core.errors import Code, ConfigError, InvalidRequest
from jobtier.core.keys import Keys, ulid
from jobtier.core.names import JOB_ID_RE
from jobtier.engine.payload_schema import schema_check
from jobtier.store.calls import CODES, claim_call, claim_replay
from jobtier.store.scripts import NAMES, lua_source
from jobtier.worker.registry import RetryPolicy, Task, TaskRegistry, task


def test_lua_result_codes_match_the_python_enum() -> None:
    lib = lua_source("lib")
    lua_codes = dict(re.findall(r"^local ([A-Z_]+) = (\d+)$", lib, re.MULTILINE))
    assert {k: int(v) for k, v in lua_codes.items()} == {c.name: c.value for c in Code}


def _lua_list(lib: str, name: str) -> list[str]:
    found = re.search(rf"^local {name} = \{{(.*?)\}}", lib, re.MULTILINE | re.DOTALL)
    assert found, name
    return re.findall(r"'([a-z_]+)'", found.group(1))


def _function_body(lib: str, signature: str) -> str:
    return lib.split(f"local function {signature}", 1)[1].split("\nend\n", 1)[0]


def test_load_builds_every_field_from_its_place_in_the_hmget_reply() -> None:
    """lib.lua's load() names each field by its index in one table constructor (to size the
    table once) after an HMGET written out in full (render.lua's job_fields); a field added
    to FIELDS but not there, or out of order, would be read into the wrong name."""
    lib = lua_source("lib")
    fields = _lua_list(lib, "FIELDS")
    names = [f"'{name}'" for name in fields]
    body = _function_body(lib, "load(id, more, more2, more3, more4)")
    assert "job_fields(key, more, more2, more3, more4)" in body
    hmget = _function_body(lib, "job_fields(key, more, more2, more3, more4)")
    calls = re.findall(r"redis\.call\('HMGET', key, ([^)]*)\)", hmget, re.DOTALL)
    listed = [[t.strip() for t in call.split(",")] for call in calls]
    assert sorted(listed) == sorted(
        [
            [*names, "more", "more2", "more3", "more4"],
            [*names, "more", "more2", "more3"],
            [*names, "more", "more2"],
            [*names, "more"],
            names,
        ]
    )
    at = re.search(r"^local C_AT, T_AT, ERROR_AT, PROGRESS_AT = (.*)$", lib, re.MULTILINE)
    assert at and [int(i) for i in at.group(1).split(",")] == [
        fields.index(name) + 1 for name in ("c", "t", "error", "progress")
    ]
    constructor = body.split("local j = {", 1)[1]
    pairs = dict(re.findall(r"([a-z_][a-z_0-9]*) = v\[(\d+)\]", constructor))
    assert {name: int(i) for name, i in pairs.items()} == {
        "id": 1,
        "tenant": 2,
        "wf": fields.index("wf") + 1,
        "error": fields.index("error") + 1,
        "progress": fields.index("progress") + 1,
        "more": len(fields) + 1,
        "more2": len(fields) + 2,
        "more3": len(fields) + 3,
        "more4": len(fields) + 4,
    }


def test_reformat_reads_and_drops_every_field_of_the_formats_before() -> None:
    """reformat.lua's OLD: format 1's small fields in the order of 'c' and 't' (it copies
    the first ones by position), then 'created', format 2's 's' and the document; nothing
    format 3 keeps."""
    from jobtier.store import format as job_format

    text = (resources.files("jobtier.store") / "lua" / "reformat.lua").read_text()
    old = _lua_list(text, "OLD")
    packed = [*job_format.C_FIELDS, *job_format.T_FIELDS]
    assert old == [*packed, "created", "s", "doc"]
    assert f"for i = 1, {len(packed)} do" in text
    hmget = re.search(r"redis\.call\('HMGET', key, (.*?)unpack\(OLD\)\)", text, re.DOTALL)
    assert hmget
    assert f"local READ = {hmget.group(1).count(',')}" in text
    kept = {"id", "tenant", "c", "t", "wf", "error", "progress", "dd", "payload", "result"}
    assert not kept & set(old)


def test_packed_values_are_read_in_the_order_they_are_written() -> None:
    """'c' and 't' (core/keys.py, "Job hashes"): packed_c/packed_t concatenate j's fields in
    one order, load() unpacks them with string.match into variables it names in the same
    order, and job_format.C_FIELDS/T_FIELDS (the Python reader) agree."""
    from jobtier.store import format as job_format

    lib = lua_source("lib")
    body = _function_body(lib, "load(id, more, more2, more3, more4)")
    constructor = dict(re.findall(r"([a-z_]+) = ([a-z_]+)[,}]", body.split("local j = {", 1)[1]))
    for packed, pattern, names in (
        ("packed_c(j)", "C_PATTERN", job_format.C_FIELDS),
        ("packed_t(j)", "T_PATTERN", job_format.T_FIELDS),
    ):
        written = re.findall(r"j\.([a-z_]+)", _function_body(lib, packed))
        assert tuple(written) == names, packed
        match = re.search(rf"local ([a-z_,\s]+?) = string\.match\(v\[\w+\], {pattern}\)", body)
        assert match, pattern
        variables = [v.strip() for v in match.group(1).split(",")]
        # the constructor assigns each variable to the field of its name (typ: a Lua keyword
        # would not do as a name)
        assert [constructor[name] for name in names] == variables, pattern
        captures = re.search(rf"^local {pattern} = '(.*)'$", lib, re.MULTILINE)
        assert captures and captures.group(1).count("(") == len(names), pattern


def _documented_suffixes() -> set[str]:
    """The per-shard key suffixes core/keys.py's docstring lists (``jt:{s}:q:<priority>`` -> q:)."""
    import jobtier.core.keys

    doc = jobtier.core.keys.__doc__ or ""
    out = set()
    for line in doc.splitlines():
        m = re.match(r"^\s+jt:\{s\}:([a-z:]+)(<|\s)", line)
        if m:
            out.add(m.group(1))
    return out


def test_the_keys_the_lua_builds_are_the_ones_keys_py_documents() -> None:
    """Every ``BASE .. 'suffix'`` in the scripts names a documented per-shard key, and each
    documented key is built by some script or by Keys (no stale layout on either side)."""
    built = set()
    for name in [*NAMES, "lib", "read_status"]:
        built |= set(re.findall(r"BASE \.\. '([a-z:]+)'", lua_source(name)))
    # a sorted set named by a variable (add_timed(set, ...), next_score(set)): its callers
    for name in [*NAMES, "lib"]:
        built |= set(re.findall(r"(?:add_timed|next_score)\('([a-z]+)'", lua_source(name)))
    documented = _documented_suffixes()
    assert built, "no key found in the scripts: the pattern is stale"
    assert built - documented == set(), "keys built by Lua but not documented in core/keys.py"
    keys = Keys("jt", 4)
    from_python = {
        re.sub(r"^jt:\{\d+\}:", "", m)
        for m in (
            keys.ready(1, "q", "high", "t").split(":q:")[0] + ":q:", keys.sched(1), keys.active(1),
            keys.ring(1, "q", "high").split(":ring:")[0] + ":ring:", keys.queue_counts(1),
            keys.parked(1), keys.ckeys(1), keys.park(1, "q", "t").split(":park:")[0] + ":park:",
            keys.ck(1, "t", "k").split(":ck:")[0] + ":ck:",
            keys.limit("q").split(":limit:")[0] + ":limit:",
            keys.permits("q").split(":permits:")[0] + ":permits:",
            keys.starts("q").split(":starts:")[0] + ":starts:",
            keys.dead(1), keys.waiting(1), keys.log(1), keys.cron(1), keys.events(1),
            keys.wake(1), keys.job_in(1, "x")[:-1], keys.cron_def(1, "x")[:-1],
            keys.log_refused(1), keys.job_format(1), keys.format_done(1),
        )
    }  # fmt: skip
    assert from_python - documented == set(), "keys built by core/keys.py but not documented"
    assert documented - built - from_python == set(), "documented keys nobody builds"


@pytest.mark.parametrize("name", NAMES)
def test_every_script_has_a_header_and_includes_the_library(name: str) -> None:
    text = (
        lua_source.__globals__["resources"].files("jobtier.store") / "lua" / f"{name}.lua"
    ).read_text()
    header = text.split("--!include", 1)[0]
    assert header.startswith(f"-- {name}.lua:")
    for part in ("KEYS[1]", "ARGV[1]", "Returns"):
        assert part in header, f"{name}.lua header lacks {part}"
    assert "local function commit" in lua_source(name)


def test_job_ids_route_to_their_shard() -> None:
    keys = Keys("jt", 16)
    for shard in range(16):
        job_id = keys.new_id(shard)
        assert JOB_ID_RE.fullmatch(job_id) and keys.shard_of(job_id) == shard
        assert keys.job(job_id) == f"jt:{{{shard}}}:job:{job_id}"
    with pytest.raises(ValueError):
        keys.shard_of(ulid() + "-16")  # a shard this deployment doesn't have
    for bad in ["", "x-1", ulid() + "-01", ulid().lower() + "-1", ulid() + "-1\n"]:
        assert not keys.valid_id(bad)


def test_ulids_sort_by_time() -> None:
    assert ulid(1000) < ulid(1001) < ulid(2**40)
    assert len(ulid()) == 26


@given(st.integers(0, 2**48 - 1), st.binary(min_size=10, max_size=10))
def test_ulid_digits_match_the_plain_base32_encoding(ms: int, entropy: bytes) -> None:
    """ulid() builds its digits from 10-bit pairs: the same as encoding the 128-bit number 5
    bits at a time, most significant first."""
    value = ms << 80 | int.from_bytes(entropy, "big")
    crockford = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
    plain = "".join(crockford[(value >> (5 * i)) & 31] for i in reversed(range(26)))
    assert ulid(ms, entropy) == plain


def test_new_ids_are_valid_random_and_spread_over_every_shard() -> None:
    """new_id's 16 entropy digits come from random bytes, one digit per byte: every digit is
    a Crockford one, each position takes all 32 of them, and the shard bytes reach every
    shard; ids made in one millisecond share its 10 time digits, and a shard asked for is
    kept."""
    keys = Keys("jt", 16)
    ids = [keys.new_id() for _ in range(5000)]
    assert all(JOB_ID_RE.fullmatch(i) for i in ids) and len(set(ids)) == len(ids)
    assert {keys.shard_of(i) for i in ids} == set(range(16))
    crockford = set("0123456789ABCDEFGHJKMNPQRSTVWXYZ")
    for position in range(10, 26):
        assert {i[position] for i in ids} == crockford
    assert keys.new_id(5).endswith("-5") and keys.shard_of(keys.new_id(0)) == 0
    assert ulid(1234)[:10] == ulid(1234)[:10] == ulid(1234, bytes(10))[:10] < ulid(1235)[:10]
    assert len(ulid()) == 26 and set(ulid()) <= crockford


def test_codes_by_index_are_the_code_members() -> None:
    assert len(CODES) == len(Code) and all(CODES[c.value] is c for c in Code)


def test_a_claims_replay_is_the_same_claim_asking_for_no_job() -> None:
    call = claim_call(3, "w", 25, 30_000, [("default", -1), ("media", 4)], ["echo"])
    name, shard, args = claim_replay(call)
    assert (name, shard, args[0], args[1]) == ("claim", 3, "w", 0)
    assert args[2:] == call[2][2:]  # the lease, queues, types and token (claim.lua's ARGV)
    assert call[2][1] == 25  # the call itself unchanged


def test_shard_for_is_stable() -> None:
    keys = Keys("jt", 16)
    assert keys.shard_for("tenant", "key") == keys.shard_for("tenant", "key")
    assert {keys.shard_for("t", str(i)) for i in range(200)} == set(range(16))


def test_settings_from_environment() -> None:
    s = Settings.from_env(
        {"JOBTIER_SHARDS": "8", "JOBTIER_NEAR_CACHE": "off", "JOBTIER_LEASE_SECONDS": "2.5"}
    )
    assert (s.shards, s.near_cache, s.lease_seconds) == (8, False, 2.5)
    with pytest.raises(ConfigError, match="JOBTIER_SHARDS"):
        Settings.from_env({"JOBTIER_SHARDS": "many"})
    with pytest.raises(ConfigError, match="between 1 and 4096"):
        Settings.from_env({"JOBTIER_SHARDS": "0"})
    with pytest.raises(ConfigError, match="key:tenant"):
        Settings.from_env({"JOBTIER_API_KEYS": "just-a-key"})
    with pytest.raises(ConfigError, match="JOBTIER_WORKER_KEYS and JOBTIER_API_KEYS share"):
        Settings.from_env({"JOBTIER_API_KEYS": "k1:acme", "JOBTIER_WORKER_KEYS": "w1, k1"})
    with pytest.raises(ConfigError, match="JOBTIER_WORKER_KEYS and JOBTIER_ADMIN_KEY share"):
        Settings.from_env({"JOBTIER_ADMIN_KEY": "adm", "JOBTIER_WORKER_KEYS": "adm"})
    both = {"JOBTIER_API_KEYS": "k1:acme", "JOBTIER_ADMIN_KEY": "adm"}
    assert Settings.from_env({**both, "JOBTIER_WORKER_KEYS": "w1"}).worker_key_list() == ["w1"]
    with pytest.raises(ConfigError, match="unknown settings"):
        Settings.from_env({}, no_such_setting=1)
    keys = Settings.from_env({"JOBTIER_API_KEYS": "k1:acme, k2:globex"}).tenant_keys()
    assert keys == {"k1": "acme", "k2": "globex"}
    assert Settings.from_env({"JOBTIER_API_KEYS": "k1:acme"}).public()["api_keys"] == "***"
    # of the URLs, the passwords only: where jobtier connects stays readable
    urls = Settings.from_env({
        "JOBTIER_DATABASE_URL": "postgresql://app:pw@db.internal:5432/jobs?password=pw2",
        "JOBTIER_REDIS_URL": "redis://:pw3@cache:6379/0",
    }).public()  # fmt: skip
    assert urls["database_url"] == "postgresql://app:***@db.internal:5432/jobs?password=***"
    assert urls["redis_url"] == "redis://:***@cache:6379/0"
    # a password's unencoded / ? # (which a URL parser reads as the path's): masked whole
    for raw, shown in [
        ("postgresql://jobtier:ab/cd+ef@db:5432/jobs", "postgresql://jobtier:***@db:5432/jobs"),
        ("postgresql://u:a?b#c@db/jobs", "postgresql://u:***@db/jobs"),
        ("postgresql:///jobs?host=/tmp&password=x", "postgresql:///jobs?host=/tmp&password=***"),
        ("unix:///run/redis.sock?db=0", "unix:///run/redis.sock?db=0"),
    ]:
        assert masked_url(raw) == shown, raw
    assert len(settings_table()) == len(Settings.__dataclass_fields__)


@given(attempt=st.integers(1, 30), seed=st.integers(0, 2**32))
def test_backoff_stays_within_its_jitter(attempt: int, seed: int) -> None:
    policy = RetryPolicy(max_attempts=5, base=0.5, factor=3.0, cap=60.0, jitter=0.2)
    plain = min(0.5 * 3.0 ** (attempt - 1), 60.0)
    delay = policy.delay(attempt, random.Random(seed))
    assert plain <= delay <= plain * 1.2


def test_task_decorator_and_registry() -> None:
    @task(retries=4, timeout=3, non_retryable=[KeyError])
    async def resize(ctx: object, payload: object) -> str:
        return "ok"

    @task
    def sync_one(ctx: object, payload: object) -> int:
        return 1

    assert isinstance(resize, Task) and resize.max_attempts == 5 and resize.is_async
    assert not sync_one.is_async and sync_one(None, None) == 1
    registry = TaskRegistry([resize, sync_one])
    assert registry.names() == ["resize", "sync_one"]
    with pytest.raises(ConfigError, match="two tasks"):
        registry.add(task(name="resize")(lambda ctx, p: None))
    with pytest.raises(ConfigError, match="must match"):
        task(name="bad name")(lambda ctx, p: None)
    with pytest.raises(ConfigError, match="non_retryable"):
        task(name="t", non_retryable=["KeyError"])(lambda ctx, p: None)  # type: ignore[list-item]


def test_a_task_the_worker_could_not_call_is_refused_when_declared() -> None:
    """Each was accepted, and failed every job (or raised an unhelpful error) instead."""

    async def no_ctx(payload: object) -> None:
        return None

    with pytest.raises(ConfigError, match=r"called with \(ctx, payload\); no_ctx\(payload"):
        task(no_ctx)
    with pytest.raises(ConfigError, match="decorates a function"):
        task(42)  # type: ignore[call-overload]
    with pytest.raises(ConfigError, match="retries is a whole number, not '3'"):
        task(name="r", retries="3")(lambda ctx, p: None)  # type: ignore[call-overload]
    with pytest.raises(ConfigError, match="timeout is a number"):
        task(name="t", timeout="30")(lambda ctx, p: None)  # type: ignore[call-overload]
    # one class where several may be given
    one = task(name="one", non_retryable=KeyError, breaker="b", breaker_on=OSError)(
        lambda ctx, p: None
    )
    assert one.non_retryable == (KeyError,) and one.breaker_on == (OSError,)
    # what binds (ctx, payload) is fine: defaults, *args, a wrapper that supplies more to
    # what it wraps
    task(name="extra")(lambda ctx, payload, more=1: None)
    task(name="star")(lambda *args: None)

    def with_db(f: Any) -> Any:
        @functools.wraps(f)
        async def wrapper(ctx: object, payload: object) -> Any:
            return await f(ctx, payload, "db")

        return wrapper

    @task
    @with_db
    async def uses_db(ctx: object, payload: object, db: str) -> str:
        return db

    assert uses_db.name == "uses_db"

    def logged(f: Any) -> Any:  # the usual decorator: passes on whatever it is given
        @functools.wraps(f)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            return await f(*args, **kwargs)

        return wrapper

    @logged
    async def no_ctx_logged(payload: object) -> None:
        return None

    with pytest.raises(ConfigError, match="called with"):
        task(no_ctx_logged)
    # numbers of other types are kept as int and float (they go into the task's advert)
    odd = task(name="odd", backoff_base=Fraction(1, 2), timeout=Fraction(3, 2))(lambda ctx, p: None)  # type: ignore[call-overload]
    assert (odd.retry.base, odd.timeout) == (0.5, 1.5)
    assert type(odd.retry.base) is float and type(odd.timeout) is float
    msgspec.json.encode(odd.timeout)  # (a Fraction does not encode: its advert would fail)


def test_loading_tasks_from_a_module() -> None:
    demo = TaskRegistry.load("jobtier.demo")
    assert {"echo", "sleep", "fail", "cpu"} <= set(demo.names())
    assert TaskRegistry.load("tests.tasks:registry").get("flaky") is not None
    assert TaskRegistry.load("jobtier.demo:echo").names() == ["echo"]
    with pytest.raises(ConfigError, match="cannot import"):
        TaskRegistry.load("no.such.module")
    with pytest.raises(ConfigError, match="no attribute"):
        TaskRegistry.load("jobtier.demo:nothing")
    with pytest.raises(ConfigError, match="defines no @task"):
        TaskRegistry.load("jobtier.core.keys")


def test_small_field_reads_the_packed_values() -> None:
    """job_format.small_field: one value of 't' or 'c' (a worker id or a concurrency key with
    spaces stays whole, last); None for a job Redis does not hold."""
    from jobtier.store import format as job_format

    assert job_format.small_fields("state") == ("t",)
    assert job_format.small_fields("queue") == ("c",)
    t = b"running 3 1 1796067784647   0 2 3 1796067784647 worker with spaces"
    assert job_format.small_field((t,), "state") == b"running"
    assert job_format.small_field((t,), "updated") == b"1796067784647"
    assert job_format.small_field((t,), "run_at") == b""
    assert job_format.small_field((t,), "worker") == b"worker with spaces"
    c = b"echo normal 3 2026-01-01T00:00:00.000Z default key with spaces"
    assert job_format.small_field((c,), "queue") == b"default"
    assert job_format.small_field((c,), "ckey") == b"key with spaces"
    assert job_format.small_field((None,), "state") is None
    fields = job_format.job_fields({b"id": b"x", b"t": t, b"c": c})
    assert fields["worker"] == "worker with spaces" and fields["type"] == "echo"
    assert "t" not in fields and "c" not in fields


def test_prepare_checks_every_name_each_time_and_hashes_only_keyed_requests() -> None:
    """prepare() keeps the names it found valid (a batch repeats them), and still refuses a
    bad tenant, type or queue after good ones; the request hash (what submit.lua compares for
    an idempotency key) is made only for a job given a key."""
    from jobtier.core.errors import InvalidRequest
    from jobtier.core.model import JobSpec
    from jobtier.engine.queue import Queue
    from jobtier.store.context import Store
    from jobtier.store.redis import connect

    settings = Settings.from_env({}, redis_url="redis://127.0.0.1:1/0")
    queue = Queue(Store(settings, connect(settings)))
    for _ in range(2):
        item = queue.produce.prepare(JobSpec(type="mail.send", payload=1, queue="q1"), "acme")
        assert (item.type, item.queue, item.tenant, item.request_hash) == (
            "mail.send",
            "q1",
            "acme",
            "",
        )
    one = queue.produce.prepare(JobSpec(type="mail.send", payload=1, idempotency_key="k"), "acme")
    two = queue.produce.prepare(JobSpec(type="mail.send", payload=2, idempotency_key="k"), "acme")
    assert len(one.request_hash) == 32 and one.request_hash != two.request_hash
    bad: list[tuple[JobSpec, str]] = [
        (JobSpec(type="mail send", payload=1), "acme"),
        (JobSpec(type=["mail.send"], payload=1), "acme"),  # type: ignore[arg-type]
        (JobSpec(type="mail.send", payload=1, queue="q 1"), "acme"),
        (JobSpec(type="mail.send", payload=1, queue=7), "acme"),  # type: ignore[arg-type]
        (JobSpec(type="mail.send", payload=1), "ac me"),
    ]
    for spec, tenant in bad * 2:  # twice: a refused name is not kept as valid
        with pytest.raises(InvalidRequest):
            queue.produce.prepare(spec, tenant)


async def test_scripts_that_keep_disappearing_fail_as_a_redis_error() -> None:
    """A Redis that loses the script after every load (SCRIPT FLUSH in a loop): run_scripts
    gives up after three rounds with a RedisError, which callers' handlers back off from and
    retry, as from any failure of Redis (a RuntimeError ended the worker's claim loop)."""

    from redis.exceptions import NoScriptError, RedisError

    from jobtier.store.scripts import Script, run_scripts

    class Forgetful:  # a pipeline whose every call is refused as missing; loads succeed
        loads = 0

        def pipeline(self, transaction: bool) -> Forgetful:
            self.calls: list[Any] = []
            return self

        def execute_command(self, *args: Any) -> None:
            self.calls.append(args)

        async def execute(self, raise_on_error: bool) -> list[Any]:
            return [NoScriptError("No matching script") for _ in self.calls]

        async def script_load(self, text: str) -> None:
            self.loads += 1

    redis = Forgetful()
    with pytest.raises(RedisError, match="keep disappearing"):
        await run_scripts(redis, [(Script("submit"), (1, "k", "b")), (Script("claim"), ())])  # type: ignore[arg-type]
    assert redis.loads == 6  # both scripts loaded again each round


class _Link(msgspec.Struct):
    url: str


class _Page(msgspec.Struct):
    url: str
    width: int = 128
    link: _Link | None = None
    links: list[_Link] = []


@pytest.mark.parametrize(
    ("payload", "field", "said"),
    [
        ({}, "payload.url", "required, and missing"),
        ({"url": "x", "link": {}}, "payload.link.url", "required, and missing"),
        ({"url": None}, "payload.url", "null"),
        ({"url": "x", "link": {"url": None}}, "payload.link.url", "null"),
        ({"url": "x", "links": [{"url": 1}]}, "payload.links[0].url", "str"),
        (None, "payload", "null"),
    ],
)
def test_a_payload_error_names_the_field_in_json_words(
    payload: object, field: str, said: str
) -> None:
    """Both checks, the worker's (msgspec) and the API's (the catalogue's JSON Schema), name the
    field at fault (the missing one, not the object that lacks it) and speak JSON."""

    @task
    async def page(ctx: object, payload: _Page) -> None: ...

    checks = [schema_check(msgspec.json.schema(_Page), strict) for strict in (False, True)]
    for check in (page.check_payload, *checks):
        assert check is not None
        with pytest.raises(InvalidRequest) as refused:
            check(payload)
        assert refused.value.field == field
        assert str(refused.value).startswith(f"{field}: ") and said in str(refused.value)
        assert "None" not in str(refused.value)

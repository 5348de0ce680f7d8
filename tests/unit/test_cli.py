"""The `jobtier` command: --help everywhere, clear errors for bad input."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import pytest

from jobtier.cli.main import build_parser, main

COMMANDS = [
    "run", "api", "worker", "scheduler", "persister", "dispatcher", "migrate", "prune", "bench",
    "config", "check", "jobs", "dead-letters", "queues", "job-format", "scripts", "breakers",
    "reconcile", "workers", "schedules", "audit",
]  # fmt: skip


def test_every_command_exists_and_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    choices = cast(dict[str, Any], build_parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr]
    assert sorted(choices) == sorted(COMMANDS)
    for command in COMMANDS:
        with pytest.raises(SystemExit) as exit_:
            main([command, "--help"])
        assert exit_.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith(f"usage: jobtier {command}") and len(out) > 200, command


def test_usage_shows_an_action_as_optional_only_where_it_is() -> None:
    """A command with actions shows ``ACTION`` in its usage where one must be given, and
    ``[ACTION]`` where without one it does something (``queues`` and ``breakers`` list)."""
    parsers = cast(dict[str, Any], build_parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr]
    seen = {}
    for command, parser in parsers.items():
        actions = [a for a in parser._actions if a.dest == "action"]
        if actions:
            usage = parser.format_usage()
            seen[command] = "[ACTION]" in usage
            assert ("[ACTION]" in usage) == (not actions[0].required), (command, usage)
    assert seen["queues"] and seen["breakers"] and not all(seen.values()), seen


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "jobtier.cli.main", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def test_job_format_without_redis_is_a_clear_error() -> None:
    env = {**os.environ, "JOBTIER_REDIS_URL": "redis://127.0.0.1:1"}
    r = run("job-format", env=env)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "Redis unreachable at JOBTIER_REDIS_URL" in r.stderr and "nothing changed" in r.stderr
    r = run("job-format", "--upgrade", env=env)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "Redis unreachable at JOBTIER_REDIS_URL" in r.stderr and "run it again" in r.stderr


def test_bad_input_is_a_clear_error() -> None:
    r = run("worker", "no_such_module_here")
    assert r.returncode == 2 and "cannot import task module 'no_such_module_here'" in r.stderr
    r = run("worker", "jobtier.demo", "--concurrency", "many")
    assert r.returncode == 2 and "--concurrency/-c: not a whole number: 'many'" in r.stderr
    # refused by the arguments, not by a traceback once the servers have started
    for args, says in [
        (("worker", "jobtier.demo", "-c", "0"), "--concurrency/-c: must be at least 1, not 0"),
        (("run", "--concurrency", "-2"), "--concurrency: must be at least 1, not -2"),
        (("run", "--grace", "-3"), "--grace: must be 0 or more seconds, not -3"),
        (("run", "--redis-port", "99999"), "--redis-port: must be a port, 1 to 65535"),
        (("api", "--port", "0"), "--port: must be a port, 1 to 65535, not 0"),
        (("api", "--host", "999.1.1.1"), "granian listens on an IP address, not a name"),
        # a file's path for the module: a TypeError's traceback (./x.py), or a package 'x'
        (("worker", "./mytasks.py"), "give the task module's name ('mytasks')"),
    ]:
        r = run(*args)
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr
    # settings no process could start with: one line naming the variable, exit 2
    for env, says in [
        ({"JOBTIER_LOG_LEVEL": "LOUD"}, "JOBTIER_LOG_LEVEL must be one of DEBUG"),
        ({"JOBTIER_REDIS_URL": "notaurl"}, "JOBTIER_REDIS_URL must start with redis://"),
        ({"JOBTIER_API_PORT": "99999"}, "JOBTIER_API_PORT must be a port, 1 to 65535"),
        ({"JOBTIER_API_WORKERS": "0"}, "JOBTIER_API_WORKERS must be at least 1"),
        ({"JOBTIER_REDIS_MAX_CONNECTIONS": "0"}, "JOBTIER_REDIS_MAX_CONNECTIONS must be at"),
        ({"JOBTIER_API_KEYS": "a:t,a:u"}, "JOBTIER_API_KEYS gives key a… to two tenants"),
        (
            {"JOBTIER_API_KEYS": "same:t", "JOBTIER_ADMIN_KEY": "same"},
            "JOBTIER_ADMIN_KEY is also a tenant's key",
        ),
    ]:
        r = run("config", env={**env, "PATH": ""})
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr
    for url in ("postgresql://x@127.0.0.1:1/db", "garbage"):
        r = run("migrate", env={"JOBTIER_DATABASE_URL": url, "PATH": ""})
        assert r.returncode == 1 and "jobtier migrate: cannot connect to Postgres" in r.stderr
        assert "Traceback" not in r.stderr
    r = run("bench", "nonsense")
    assert r.returncode == 2 and "invalid choice" in r.stderr
    r = run("config", env={"JOBTIER_SHARDS": "zero", "PATH": ""})
    assert r.returncode == 2 and "JOBTIER_SHARDS='zero' is not a valid int" in r.stderr
    r = run("prune", env={"JOBTIER_DATABASE_URL": "postgresql://x@127.0.0.1:1/db", "PATH": ""})
    assert r.returncode == 1 and "cannot connect to Postgres at JOBTIER_DATABASE_URL" in r.stderr
    r = run("api", env={"PATH": ""})  # no keys configured
    assert r.returncode == 2 and "no API keys" in r.stderr


@pytest.mark.parametrize("server", ["granian", "uvicorn"])
def test_an_api_whose_port_is_taken_says_so_in_one_line(server: str) -> None:
    """Before: granian's traceback (and a Rust backtrace); uvicorn logged itself ready
    first. Now refused before the server starts, nothing else tried."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        env = {"JOBTIER_API_KEYS": "k:t", "JOBTIER_ADMIN_KEY": "a", "PATH": ""}
        r = run("api", "--port", port, "--server", server, env=env)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"the API cannot listen on 127.0.0.1:{port} (Address already in use)" in r.stderr


def test_a_misspelled_setting_is_said_with_the_one_it_may_mean() -> None:
    """A JOBTIER_* variable no setting reads was silently nothing: now a warning naming it
    (and the setting it is close to), from the commands that read settings to run."""
    env = {"JOBTIER_LEASE_SECOND": "5", "JOBTIER_NOPE": "1", "JOBTIER_URL": "x", "PATH": ""}
    r = run("config", env=env)
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stderr.splitlines() if "event=unknown_setting" in x]
    assert len(lines) == 2, r.stderr  # JOBTIER_URL is the client commands' own
    assert "name=JOBTIER_LEASE_SECOND" in lines[0]
    assert lines[0].endswith("did you mean JOBTIER_LEASE_SECONDS?")
    assert "name=JOBTIER_NOPE" in lines[1] and "did you mean" not in lines[1]


def test_no_command_prints_the_commands() -> None:
    r = run()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "usage: jobtier" in r.stderr and "persister" in r.stderr and "dead-letters" in r.stderr


def test_python_dash_m_jobtier_is_the_command() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "jobtier", "--help"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: jobtier ") and "persister" in r.stdout


# Run as ``python -m jobtier.cli``, with a Ctrl-C arriving while the commands load: an import
# hook raises it at the import of cli/main.py, where it lands whatever the machine's speed.
_CTRL_C_WHILE_LOADING = """
import runpy, sys

class CtrlC:
    def find_spec(self, name, path=None, target=None):
        if name == "jobtier.cli.main":
            raise KeyboardInterrupt

sys.meta_path.insert(0, CtrlC())
runpy.run_module("jobtier.cli", run_name="__main__")
"""


def test_a_ctrl_c_while_the_commands_load_ends_it_without_a_traceback() -> None:
    r = subprocess.run(
        [sys.executable, "-c", _CTRL_C_WHILE_LOADING],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == -signal.SIGINT, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr and "KeyboardInterrupt" not in r.stderr, r.stderr


@pytest.mark.parametrize("args", [["config"], ["config", "--table"]])
def test_a_reader_that_stops_early_gets_no_traceback(args: list[str]) -> None:
    """``jobtier config | head -1``: the reader is gone before the command has written all
    (here before it writes anything, so that it is so whatever the timing; the output,
    under or over the stream's buffer, meets it at exit or in the middle)."""
    read, write = os.pipe()
    os.close(read)
    try:
        r = subprocess.run(
            [sys.executable, "-m", "jobtier.cli.main", *args],
            stdout=write, stderr=subprocess.PIPE, text=True, timeout=60,
        )  # fmt: skip
    finally:
        os.close(write)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "BrokenPipeError" not in r.stderr, r.stderr


def test_a_broken_pipe_that_is_not_stdouts_is_not_hidden(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Only a reader of our output that went away is met quietly: a BrokenPipeError from
    anything else (a connection a command writes to) is raised like any fault."""

    def broken(args: Any, settings: Any) -> int:
        raise BrokenPipeError("a peer went away")

    parser = build_parser()
    monkeypatch.setattr("jobtier.cli.main.build_parser", lambda: parser)
    commands = cast(dict[str, Any], parser._subparsers._group_actions[0].choices)  # type: ignore[union-attr]
    commands["config"].set_defaults(func=broken)
    with pytest.raises(BrokenPipeError, match="a peer went away"):
        main(["config"])  # stdout (pytest's capture) is there to write to


def test_config_masks_secrets() -> None:
    r = run("config", env={"JOBTIER_API_KEYS": "sekret:acme", "PATH": ""})
    assert r.returncode == 0 and "sekret" not in r.stdout and "JOBTIER_API_KEYS=***" in r.stdout


def test_run_banner_says_how_to_get_the_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from jobtier.config import Settings
    from jobtier.dev import stack

    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "jobtier").write_text("#!/bin/sh\n")
    (bin_dir / "jobtier").chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(bin_dir / "python"))
    settings = Settings(
        api_keys="dev-k:acme",
        admin_key="admin-k",
        redis_url="redis://127.0.0.1:16379/0",
        database_url="postgresql://jobtier@127.0.0.1:15432/jobtier",
    )

    # not on PATH (make run): one line puts the virtualenv's bin first, then the exports
    monkeypatch.setenv("PATH", "/nonexistent")
    stack._welcome(settings)
    err = capsys.readouterr().err
    assert err.count("jobtier command") == 1
    assert f'export PATH={bin_dir}:"$PATH"' in err and f". {bin_dir}/activate" in err
    assert "JOBTIER_KEY=dev-k JOBTIER_ADMIN_KEY=admin-k" in err and "jobtier queues" in err
    # a worker of your own started beside it finds the same Redis (not the default 6379)
    assert "export JOBTIER_REDIS_URL=redis://127.0.0.1:16379/0 " in err
    assert "JOBTIER_DATABASE_URL=postgresql://jobtier@127.0.0.1:15432/jobtier" in err
    # whose key it is: a job submitted for another tenant (SQL's default) is not found with it
    assert "JOBTIER_KEY is tenant acme's" in err and "tenant => 'acme'" in err
    assert "WORKER_KEY" not in err  # no worker key set: none to show
    stack._welcome(settings.replace(worker_keys="wk-1,wk-2"))
    assert "WORKER_KEY=wk-1 node examples/node-worker/worker.mjs" in capsys.readouterr().err
    # the demo's first job, with the demo tasks; with tasks of your own (--tasks), one of them
    assert """-d '{"type": "sleep", "payload": {"seconds": 3}}'""" in err
    assert """jobtier.submit('sleep', '{"seconds": 3}', tenant => 'acme')""" in err
    stack._welcome(settings, ["send_receipt", "notify"])
    mine = capsys.readouterr().err
    assert """-d '{"type": "send_receipt", "payload": null}'""" in mine and "sleep" not in mine
    assert "jobtier.submit('send_receipt', 'null', tenant => 'acme')" in mine
    assert "the worker runs: send_receipt, notify" in mine

    # on PATH already: nothing to say
    monkeypatch.setenv("PATH", str(bin_dir))
    stack._welcome(settings)
    err = capsys.readouterr().err
    assert "export PATH" not in err and "JOBTIER_ADMIN_KEY=admin-k" in err


def test_history_names_a_change_within_a_state() -> None:
    from datetime import UTC, datetime

    from jobtier.cli.manage import history_rows
    from jobtier.core.model import State, Transition

    at = datetime(2026, 1, 1, tzinfo=UTC)
    run = State.RUNNING
    rows = history_rows([
        Transition(1, None, State.QUEUED, at, "api", 0),
        Transition(2, State.QUEUED, run, at, "w1", 1),
        Transition(3, run, run, at, "w1", 1, progress={"pct": 5}),
        Transition(4, run, run, at, "api", 1, progress={"pct": 5}, cancel_requested=True),
        Transition(5, run, run, at, "w1", 1, progress={"pct": 6}, cancel_requested=True),
        Transition(6, run, State.CANCELLED, at, "w1", 1, cancel_requested=True),
    ])  # fmt: skip
    assert [row[2] for row in rows] == [
        "- -> queued", "queued -> running", "running: progress", "cancel requested",
        "running: progress", "running -> cancelled",
    ]  # fmt: skip


def test_reconcile_refuses_a_window_that_is_not_a_duration() -> None:
    for bad in ("soon", "0", "-5m", "15x"):
        r = run("reconcile", f"--since={bad}")
        assert r.returncode == 2 and "is not a duration" in r.stderr, (bad, r.stderr)


def test_the_clis_states_and_priorities_are_the_models() -> None:
    from jobtier.cli.manage import PRIORITIES, STATES
    from jobtier.core.model import Priority, State

    # (`submitted`: an outbox row's, not relayed yet; the listing is of jobs)
    assert set(STATES) == {s.value for s in State} - {"submitted"}
    assert tuple(p.value for p in Priority) == PRIORITIES


def test_a_replay_by_filter_names_what_it_passed_over() -> None:
    from types import SimpleNamespace

    from jobtier.cli.manage import dead_replay
    from jobtier.client import Replayed, SkippedReplay

    answer = Replayed(["J1"])
    answer.skipped = [SkippedReplay(id="J2", holder="J3")]
    client = SimpleNamespace(replay_dead_letters=lambda **_: answer)
    args = argparse.Namespace(job_id=None, type="t", since=None, all=False, limit=100, json=False)
    assert dead_replay(client, args).splitlines() == [  # type: ignore[arg-type]
        "replayed 1 job(s)",
        "J1",
        "passed over:",
        "J2: its unique key is held by job J3",
    ]


def test_a_task_module_in_the_folder_it_runs_from_is_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ``jobtier`` script's path holds its own folder, not the one it runs from (as
    ``python -m`` would): the tasks' module there is found all the same."""
    from jobtier.worker.registry import TaskRegistry

    (tmp_path / "tasks_here_only.py").write_text(
        "from jobtier import task\n\n@task\nasync def here(ctx, payload):\n    return 1\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "tasks_here_only", raising=False)
    try:
        assert TaskRegistry.load("tasks_here_only").names() == ["here"]
    finally:
        sys.modules.pop("tasks_here_only", None)

"""The process pool's options and the tasks it refuses, without Redis: clear errors at
declaration or at the worker's start, never a child that cannot find its task."""

from __future__ import annotations

from typing import Any

import pytest

from jobtier.cli.main import build_parser
from jobtier.cli.process_args import MIB, process_options
from jobtier.core.errors import ConfigError
from jobtier.worker.procpool import ProcessOptions, check_importable, died, runs_in_process
from jobtier.worker.registry import task
from tests import procpool_tasks


def test_task_refuses_a_bad_executor_and_an_async_task_in_a_process() -> None:
    with pytest.raises(ConfigError, match="executor must be 'thread' or 'process'"):
        task(executor="fork")(procpool_tasks.pid_of.fn)

    async def coroutine(ctx: Any, payload: Any) -> None:
        return None

    with pytest.raises(ConfigError, match="runs a plain def"):
        task(executor="process")(coroutine)


def test_a_task_the_child_cannot_import_by_name_is_refused() -> None:
    def local(ctx: Any, payload: Any) -> None:
        return None

    with pytest.raises(ConfigError, match="top level of a module"):
        check_importable(task(executor="process")(local))
    check_importable(procpool_tasks.pid_of)  # a module's top-level function is fine


def test_which_tasks_run_in_processes() -> None:
    assert runs_in_process(procpool_tasks.pid_of, "thread")  # its own executor wins
    assert not runs_in_process(procpool_tasks.plain, "thread")
    assert runs_in_process(procpool_tasks.plain, "process")
    assert not runs_in_process(procpool_tasks.echo, "process")  # async: on the event loop


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"size": 0}, "size must be at least 1"),
        ({"max_jobs": -1}, "0 \\(no limit\\) or more"),
        ({"max_rss_bytes": -1}, "0 \\(no limit\\) or more"),
        ({"kill_grace": -1.0}, "graces must be 0 or more"),
    ],
)
def test_process_options_refuse_bad_values(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ProcessOptions(**options)


def test_the_worker_command_takes_the_pool_options(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    pool = ["--processes", "3", "--process-max-jobs", "100", "--process-max-rss", "512"]
    args = parser.parse_args(["worker", "m", "--executor", "process", *pool])
    assert args.executor == "process"
    assert process_options(args) == ProcessOptions(3, 100, 512 * MIB)
    defaults = process_options(parser.parse_args(["worker", "m"]))
    assert defaults == ProcessOptions() and parser.parse_args(["worker", "m"]).executor == "thread"
    for bad in (["--processes", "0"], ["--process-max-jobs", "-1"], ["--executor", "fork"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["worker", "m", *bad])
        assert bad[0] in capsys.readouterr().err


def test_a_dead_child_is_described_by_its_signal_or_exit_code() -> None:
    assert died(7, -9) == (
        "the process running the task (pid 7) died: killed by signal SIGKILL "
        "(a crash, or the out-of-memory killer)"
    )
    assert "killed by signal SIGSEGV" in died(7, -11)
    assert died(7, 3).endswith("exited with code 3 before it answered")

"""Helpers for tests of asyncio code: gather that fails instead of hanging, loop spinning, and
a check that nothing was reported to the loop's exception handler."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Awaitable
from typing import Any


class Boom(Exception):
    pass


async def gather(*aws: Awaitable[Any]) -> list[Any]:
    """gather with return_exceptions, failing (not hanging) if something never settles."""
    async with asyncio.timeout(10):
        return await asyncio.gather(*aws, return_exceptions=True)


async def spin(n: int = 5) -> None:
    """Let the loop run a few iterations (tasks start, futures propagate)."""
    for _ in range(n):
        await asyncio.sleep(0)


class LoopErrors:
    """Everything reported to the loop's exception handler ("... was never retrieved")."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.errors: list[dict[str, Any]] = []
        loop.set_exception_handler(lambda _loop, context: self.errors.append(context))

    def check(self) -> None:
        gc.collect()  # unretrieved task/future exceptions are reported when collected
        assert self.errors == []

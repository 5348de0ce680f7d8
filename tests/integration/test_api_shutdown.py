"""The API's lifespan shutdown is bounded: a background loop that lost its cancellation (on
Python 3.11 ``asyncio.wait_for`` returns the inner call's result when the cancel arrives just
as that call finished; redis-py writes through it, jobtier's connections no longer do, a
library still may) is cancelled again,
and one that never ends is left behind with a log line, instead of holding the process up.

The loop here is the admission refresh, cancelled while it waits in the extension's lag
probe; the probe plays the part of the Redis call that loses the cancellation."""

from __future__ import annotations

import asyncio
from typing import Any

from jobtier.api.app import Extension
from tests.fixtures.api import StartApi
from tests.fixtures.engine import wait_for


class LagProbe:
    """An extension's lag probe, which the admission loop calls about once a second. Once
    ``armed`` it waits until cancelled, then returns as if nothing had happened (the
    cancellation is lost); ``stubborn``: it ignores every cancellation until ``released``."""

    def __init__(self, *, stubborn: bool = False) -> None:
        self.stubborn = stubborn
        self.armed = False
        self.waiting = asyncio.Event()
        self.released = asyncio.Event()
        self.lost = 0

    async def __call__(self) -> int:
        if not self.armed:
            return 0
        self.armed = False
        self.waiting.set()
        while not self.released.is_set():
            try:
                await self.released.wait()
            except asyncio.CancelledError:
                self.lost += 1
                if not self.stubborn:
                    return 0
        raise asyncio.CancelledError  # released: the loop ends as cancelled


async def _api_waiting_in(probe: LagProbe, start_api: StartApi) -> Any:
    ext = Extension()
    ext.lag = probe
    api = await start_api(ext)
    probe.armed = True
    await wait_for(probe.waiting.is_set, timeout=30)
    return api


async def test_an_api_stops_although_a_loop_lost_its_cancellation(
    start_api: StartApi, caplog: Any
) -> None:
    probe = LagProbe()
    api = await _api_waiting_in(probe, start_api)
    await api.stop()  # (raises TimeoutError if the app's shutdown never ends)
    assert api.task.done() and not api.task.cancelled()
    assert probe.lost == 1, "the admission loop was not cancelled in the probe"
    assert api.server.lifespan.state["admission"]._task.done()
    assert "event=shutdown_abandoned" not in caplog.text


async def test_a_loop_that_never_ends_is_left_behind_and_named_in_the_log(
    start_api: StartApi, caplog: Any
) -> None:
    probe = LagProbe(stubborn=True)
    api = await _api_waiting_in(probe, start_api)
    await api.stop()
    assert api.task.done() and not api.task.cancelled()
    assert probe.lost >= 2, "it was cancelled once only"
    assert "event=shutdown_abandoned part=admission refresh" in caplog.text
    loop_task = api.server.lifespan.state["admission"]._task
    assert not loop_task.done()
    probe.released.set()  # nothing outlives the test
    await wait_for(loop_task.done, timeout=30)

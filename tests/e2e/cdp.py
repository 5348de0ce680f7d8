"""Headless Chromium driven over the Chrome DevTools Protocol, for the browser tests.

No browser-automation package and nothing downloaded: Debian's ``chromium`` is started with
``--remote-debugging-port=0`` (it writes the port it chose to ``DevToolsActivePort`` in its
profile folder), and CDP's JSON messages go over a websocket whose client side (RFC 6455:
handshake, masked text frames out, unfragmenting in, ping/pong) is written here, on asyncio
streams, so the browser and the server under test share the test's event loop.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import itertools
import json
import os
import shutil
import signal
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

NAMES = ("chromium", "chromium-browser", "google-chrome-stable", "google-chrome")
FLAGS = (
    "--headless",
    "--no-sandbox",  # the tests may run as root, where Chromium's sandbox refuses to start
    "--disable-gpu",
    "--disable-quic",
    "--disable-dev-shm-usage",  # containers often have a tiny /dev/shm
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--force-color-profile=srgb",
    "--remote-debugging-port=0",
)
_WS_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


def find_chromium() -> str | None:
    """``$JOBTIER_CHROMIUM``, else the first Chromium or Chrome on ``PATH``."""
    explicit = os.environ.get("JOBTIER_CHROMIUM")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    for name in NAMES:
        found = shutil.which(name)
        if found:
            return found
    return None


class CdpError(Exception):
    pass


class WebSocket:
    """The client side of one websocket: text messages in and out."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def connect(cls, url: str) -> WebSocket:
        parts = urlsplit(url)
        host, port = parts.hostname or "127.0.0.1", parts.port or 80
        reader, writer = await asyncio.open_connection(host, port)
        key = base64.b64encode(os.urandom(16))
        writer.write(
            b"GET %s HTTP/1.1\r\nHost: %s:%d\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            b"Sec-WebSocket-Key: %s\r\nSec-WebSocket-Version: 13\r\n\r\n"
            % (parts.path.encode(), host.encode(), port, key)
        )
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        accept = base64.b64encode(hashlib.sha1(key + _WS_GUID).digest()).decode()
        if not head.startswith("HTTP/1.1 101") or accept not in head:
            writer.close()
            raise CdpError(f"websocket handshake refused: {head.splitlines()[0]!r}")
        return cls(reader, writer)

    def _frame(self, opcode: int, payload: bytes) -> None:
        n = len(payload)
        if n < 126:
            head = bytes([0x80 | opcode, 0x80 | n])
        elif n < 1 << 16:
            head = bytes([0x80 | opcode, 0x80 | 126]) + n.to_bytes(2, "big")
        else:
            head = bytes([0x80 | opcode, 0x80 | 127]) + n.to_bytes(8, "big")
        mask = os.urandom(4)  # a client must mask every frame
        stretched = (mask * (n // 4 + 1))[:n]
        masked = (int.from_bytes(payload, "big") ^ int.from_bytes(stretched, "big")).to_bytes(
            n, "big"
        )
        self.writer.write(head + mask + masked)

    async def send(self, text: str) -> None:
        self._frame(0x1, text.encode())
        await self.writer.drain()

    async def recv(self) -> str | None:
        """The next text message; None once the other side closes."""
        message = bytearray()
        while True:
            b0, b1 = await self.reader.readexactly(2)
            n = b1 & 0x7F
            if n >= 126:
                n = int.from_bytes(await self.reader.readexactly(2 if n == 126 else 8), "big")
            mask = await self.reader.readexactly(4) if b1 & 0x80 else None
            data = await self.reader.readexactly(n)
            if mask:
                data = bytes(b ^ mask[i % 4] for i, b in enumerate(data))
            opcode = b0 & 0x0F
            if opcode == 0x8:
                return None
            if opcode == 0x9:  # ping
                self._frame(0xA, data)
                continue
            if opcode == 0xA:
                continue
            message += data  # text, binary or a continuation of either
            if b0 & 0x80:
                return message.decode()

    async def close(self) -> None:
        with contextlib.suppress(OSError):
            self._frame(0x8, b"\x03\xe8")  # 1000: normal closure
            self.writer.close()
            await self.writer.wait_closed()


class Page:
    """One browser tab: CDP commands, JavaScript evaluation, input and screenshots.

    JavaScript exceptions and console errors the page raises are kept in ``errors``.
    """

    def __init__(self, ws: WebSocket) -> None:
        self.ws = ws
        self.errors: list[str] = []
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._reader = asyncio.create_task(self._read(), name="cdp-reader")

    async def _read(self) -> None:
        try:
            while (text := await self.ws.recv()) is not None:
                msg = json.loads(text)
                future = self._pending.pop(msg.get("id", -1), None)
                if future is not None and not future.done():
                    future.set_result(msg)
                elif msg.get("method") == "Runtime.exceptionThrown":
                    details = msg["params"]["exceptionDetails"]
                    self.errors.append(
                        details.get("exception", {}).get("description", str(details))
                    )
                elif (
                    msg.get("method") == "Runtime.consoleAPICalled"
                    and msg["params"]["type"] == "error"
                ):
                    args = msg["params"]["args"]
                    self.errors.append(" ".join(str(a.get("value", a)) for a in args))
        except (asyncio.IncompleteReadError, OSError):
            pass
        finally:
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(CdpError("the browser closed the connection"))

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        ident = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[ident] = future
        await self.ws.send(json.dumps({"id": ident, "method": method, "params": params}))
        async with asyncio.timeout(30):
            msg = await future
        if "error" in msg:
            raise CdpError(f"{method}: {msg['error']}")
        result: dict[str, Any] = msg.get("result", {})
        return result

    async def evaluate(self, expression: str) -> Any:
        """The JSON value of a JavaScript expression (promises are awaited)."""
        reply = await self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in reply:
            raise CdpError(f"{expression!r} threw: {reply['exceptionDetails']}")
        return reply["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = 15.0) -> Any:
        """Poll a JavaScript expression until it is truthy; its value. The bound only stops a
        broken page from hanging the test."""
        async with asyncio.timeout(timeout):
            while not (value := await self.evaluate(expression)):
                await asyncio.sleep(0.1)
        return value

    async def goto(self, url: str) -> None:
        await self.call("Page.navigate", url=url)
        await self.wait_for(
            f"location.href === {json.dumps(url)} && document.readyState === 'complete'"
        )

    async def type_into(self, selector: str, text: str) -> None:
        """Focus an input and type, as a user's keyboard would."""
        await self.evaluate(f"document.querySelector({json.dumps(selector)}).focus()")
        await self.call("Input.insertText", text=text)

    async def click(self, selector: str) -> None:
        """A real mouse click in the middle of an element."""
        box = await self.evaluate(
            f"(() => {{ const r = document.querySelector({json.dumps(selector)})"
            ".getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; })()"
        )
        for kind in ("mousePressed", "mouseReleased"):
            await self.call(
                "Input.dispatchMouseEvent",
                type=kind,
                x=box[0],
                y=box[1],
                button="left",
                clickCount=1,
            )

    async def press(self, key: str, *, shift: bool = False) -> None:
        """One key pressed and released, as a keyboard sends it: ``Tab``, ``Enter``,
        ``Escape``, ``ArrowDown``, or a character."""
        codes = {"Tab": 9, "Enter": 13, "Escape": 27, " ": 32, "ArrowDown": 40, "ArrowUp": 38}
        code = codes.get(key, ord(key.upper()[0]))
        text = {"Enter": "\r", " ": " "}.get(key, key if len(key) == 1 else "")
        base: dict[str, Any] = {
            "key": key, "code": key if len(key) > 1 else f"Key{key.upper()}",
            "windowsVirtualKeyCode": code, "nativeVirtualKeyCode": code,
            "modifiers": 8 if shift else 0,
        }  # fmt: skip
        await self.call("Input.dispatchKeyEvent", type="keyDown", text=text, **base)
        await self.call("Input.dispatchKeyEvent", type="keyUp", **base)

    async def focused(self) -> str:
        """What has the keyboard focus: its id, else its tag and text."""
        value: str = await self.evaluate(
            "(() => { const e = document.activeElement;"
            " return e ? (e.id || `${e.tagName.toLowerCase()}:${e.textContent.trim()}`) : ''; })()"
        )
        return value

    async def resize(
        self, width: int, height: int, *, scale: float = 1.0, mobile: bool = False
    ) -> None:
        """The viewport's size and device scale (a phone: ``mobile``, touch)."""
        await self.call(
            "Emulation.setDeviceMetricsOverride",
            width=width, height=height, deviceScaleFactor=scale, mobile=mobile,
        )  # fmt: skip

    async def screenshot(self, path: Path, *, full: bool = True) -> None:
        """The page's content as PNG (the viewport sized to the content's height first), or
        what the viewport shows (``full=False``)."""
        height = await self.evaluate(
            "Math.ceil(document.body.getBoundingClientRect().height)" if full else "innerHeight"
        )
        metrics = await self.evaluate("[innerWidth, devicePixelRatio]")
        await self.call(
            "Emulation.setDeviceMetricsOverride",
            width=metrics[0], height=height, deviceScaleFactor=metrics[1], mobile=False,
        )  # fmt: skip
        # the resize handler redraws the canvases in the next frame's resize step: two
        # animation frames later that drawing has been painted
        await self.evaluate(
            "new Promise(done => requestAnimationFrame(() => requestAnimationFrame(() => done(1))))"
        )
        shot = await self.call("Page.captureScreenshot", format="png")
        await asyncio.to_thread(path.write_bytes, base64.b64decode(shot["data"]))

    async def close(self) -> None:
        await self.ws.close()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader


@contextlib.asynccontextmanager
async def chromium_page(
    executable: str, width: int = 1280, height: int = 900, scale: float = 1.0
) -> AsyncIterator[Page]:
    """A headless Chromium with a fresh profile, and its one tab; all gone afterwards."""
    profile = Path(tempfile.mkdtemp(prefix="jobtier-chromium-"))
    log = (profile / "chromium.log").open("wb")
    proc = await asyncio.create_subprocess_exec(
        executable, *FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}",
        "about:blank", stdout=log, stderr=log, start_new_session=True,
    )  # fmt: skip
    page = None
    try:
        port_file = profile / "DevToolsActivePort"
        async with asyncio.timeout(30):
            # two lines, port and browser path, once Chromium listens
            while not port_file.exists() or len(port_file.read_text().split()) < 2:
                if proc.returncode is not None:
                    raise CdpError(f"chromium exited with {proc.returncode}: {_tail(profile)}")
                await asyncio.sleep(0.05)
        port = int(port_file.read_text().split()[0])
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            async with asyncio.timeout(15):
                while not (
                    tabs := [
                        t for t in (await http.get("/json/list")).json() if t["type"] == "page"
                    ]
                ):
                    await asyncio.sleep(0.05)
        page = Page(await WebSocket.connect(tabs[0]["webSocketDebuggerUrl"]))
        await page.call("Runtime.enable")
        await page.call("Page.enable")
        await page.call(
            "Emulation.setDeviceMetricsOverride",
            width=width, height=height, deviceScaleFactor=scale, mobile=False,
        )  # fmt: skip
        yield page
    finally:
        if page is not None:
            # leave the page first: its open streams end as a closed tab's do, so a server
            # under test never waits on a connection of a browser that is going away
            with contextlib.suppress(CdpError, OSError, TimeoutError):
                async with asyncio.timeout(5):
                    await page.call("Page.navigate", url="about:blank")
            await page.close()
        if proc.returncode is None:
            proc.terminate()  # the browser closes its renderers and helpers itself
            try:
                async with asyncio.timeout(10):
                    await proc.wait()
            except TimeoutError:
                # its own session: the group is this browser and its children, nothing else
                os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
        log.close()
        await asyncio.to_thread(_remove, profile)


def _remove(profile: Path) -> None:
    # a helper process may still be flushing into the profile as the browser exits
    for _ in range(10):
        shutil.rmtree(profile, ignore_errors=True)
        if not profile.exists():
            return
        time.sleep(0.1)


def _tail(profile: Path) -> str:
    try:
        return (profile / "chromium.log").read_text(errors="replace")[-2000:]
    except OSError:
        return ""

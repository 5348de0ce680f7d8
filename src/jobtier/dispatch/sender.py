"""One HTTP attempt of a delivery: pinned to a checked address, bounded in time and size.

httpcore (httpx's transport layer) is used directly: its connection pool accepts a network
backend, which is where ``PinnedBackend`` resolves and checks the host and connects to the
checked address. Redirects are not followed (the Standard Webhooks advice: a 3xx is a
failure). At most ``max_response_bytes`` of an answer are read; the attempt as a whole,
connection included, is bounded by ``timeout``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpcore

from jobtier.dispatch.safety import AddressPolicy, PinnedBackend, RefusedConnect

USER_AGENT = b"jobtier-webhooks/1"
RESPONSE_KEPT = 500  # characters of an answer's body kept in the attempt's record


@dataclass(slots=True)
class Answer:
    """What an attempt got: a status (None when no answer came) or the error."""

    status: int | None
    duration_ms: float
    error: str | None = None
    body: str | None = None
    retry_after: float | None = None
    refused: bool = False  # the address policy refused every address: nothing was sent


class Sender:
    """Sends attempts through one connection pool (keep-alive across deliveries)."""

    def __init__(
        self,
        policy: AddressPolicy,
        *,
        timeout: float,
        max_response_bytes: int,
        max_connections: int = 100,
    ) -> None:
        self.backend = PinnedBackend(policy)
        self.timeout = timeout
        self.max_response_bytes = max_response_bytes
        self.pool = httpcore.AsyncConnectionPool(
            network_backend=self.backend,
            max_connections=max_connections,
            max_keepalive_connections=max_connections,
            keepalive_expiry=30.0,
            retries=0,
        )

    async def close(self) -> None:
        await self.pool.aclose()

    async def post(self, url: str, headers: dict[str, str], body: bytes) -> Answer:
        """POST ``body`` to ``url``; never raises for what the receiver or network does."""
        start = time.perf_counter()
        sent = [
            (b"content-type", b"application/json"),
            (b"user-agent", USER_AGENT),
            *((k.encode(), v.encode()) for k, v in headers.items()),
        ]
        t = self.timeout
        try:
            async with asyncio.timeout(t):
                async with self.pool.stream(
                    "POST", url, headers=sent, content=body,
                    extensions={"timeout": {"connect": t, "read": t, "write": t, "pool": t}},
                ) as response:  # fmt: skip
                    kept = await self._read_capped(response)
                    status = response.status
                    retry_after = _retry_after(response.headers)
        except RefusedConnect as exc:
            return Answer(None, _ms(start), str(exc), refused=True)
        except TimeoutError:
            return Answer(None, _ms(start), f"timed out after {t:g} s")
        except httpcore.TimeoutException as exc:
            return Answer(None, _ms(start), f"timed out ({type(exc).__name__})")
        except (httpcore.NetworkError, httpcore.ProtocolError, httpcore.UnsupportedProtocol,
                OSError) as exc:  # fmt: skip
            return Answer(None, _ms(start), f"{type(exc).__name__}: {exc}"[:500])
        text = kept.decode("utf-8", "replace")[:RESPONSE_KEPT]
        return Answer(status, _ms(start), body=text, retry_after=retry_after)

    async def _read_capped(self, response: httpcore.Response) -> bytes:
        """At most ``max_response_bytes`` of the answer; a longer one is cut (the stream's
        close drops the connection rather than read the rest)."""
        kept = bytearray()
        stream = response.stream
        assert hasattr(stream, "__aiter__")
        async for chunk in stream:
            room = self.max_response_bytes - len(kept)
            kept += chunk[:room]
            if len(chunk) >= room:
                break
        return bytes(kept[: RESPONSE_KEPT * 4])


def _ms(start: float) -> float:
    return round((time.perf_counter() - start) * 1000, 3)


def _retry_after(headers: list[tuple[bytes, bytes]]) -> float | None:
    for name, value in headers:
        if name.lower() == b"retry-after":
            try:
                return max(0.0, float(value.decode("latin-1").strip()))
            except ValueError:
                return None  # an HTTP date: the schedule's delay stands
    return None

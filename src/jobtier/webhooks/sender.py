"""One HTTP attempt of a delivery: pinned to a checked address, bounded in time and size.

aiohttp's connector resolves through ``PinnedResolver``, so it only ever connects to a
checked address (an IP literal, which aiohttp never resolves, is checked here). One connector
keeps connections alive across deliveries. Redirects are not followed (a 3xx is a failure).
At most ``max_response_bytes`` of an answer are read; ``timeout`` bounds the whole attempt.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from dataclasses import dataclass

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from multidict import CIMultiDictProxy
from yarl import URL

from jobtier.webhooks.safety import AddressPolicy, Refused, RefusedConnect, Target

USER_AGENT = "jobtier-webhooks/1"
RESPONSE_KEPT = 500  # characters of an answer's body kept in the attempt's record


class PinnedResolver(AbstractResolver):
    """aiohttp's resolver for deliveries: hands the connector only the addresses the policy
    allows, so the address checked is the address connected to. TLS still verifies the
    certificate against the host name. aiohttp asks no resolver about IP literals:
    ``Sender.post`` checks those itself."""

    def __init__(self, policy: AddressPolicy) -> None:
        self.policy = policy
        self.pinned: list[str] = []  # the last few addresses handed to the connector (tests)

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        target = Target("", host.lower().strip("[]").rstrip("."), port)
        try:
            addresses = await self.policy.addresses(target, strict=False)
        except Refused as exc:
            raise RefusedConnect(f"refused: {exc}") from exc
        self.pinned = [*self.pinned[-15:], *addresses]
        return [
            ResolveResult(
                hostname=host,
                host=a,
                port=port,
                proto=0,
                flags=socket.AI_NUMERICHOST,
                family=socket.AF_INET6 if ":" in a else socket.AF_INET,
            )
            for a in addresses
        ]

    async def close(self) -> None:
        pass


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
        self.policy = policy
        self.timeout = timeout
        self.max_response_bytes = max_response_bytes
        self.max_connections = max_connections
        self.resolver = PinnedResolver(policy)
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        # made on first use: a session belongs to the running event loop
        if self._session is None:
            connector = aiohttp.TCPConnector(
                resolver=self.resolver,
                use_dns_cache=False,  # every new connection is resolved and checked again
                limit=self.max_connections,
                keepalive_timeout=30.0,
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                headers={"user-agent": USER_AGENT},
                skip_auto_headers=("accept", "accept-encoding"),
                auto_decompress=False,
                trust_env=False,  # no proxy from the environment: the checked address is used
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def post(self, url: str, headers: dict[str, str], body: bytes) -> Answer:
        """POST ``body`` to ``url``; never raises for what the receiver or network does."""
        start = time.perf_counter()
        t = self.timeout
        try:
            await self._check_literal(url)
            async with asyncio.timeout(t):
                async with self._open().post(
                    url,
                    data=body,
                    headers={"content-type": "application/json", **headers},
                    allow_redirects=False,
                    timeout=aiohttp.ClientTimeout(total=None),  # asyncio.timeout bounds it
                ) as response:
                    kept, whole = await self._read_capped(response)
                    status = response.status
                    retry_after = _retry_after(response.headers)
                    if not whole:
                        response.close()  # drop the connection rather than read the rest
        except RefusedConnect as exc:
            return Answer(None, _ms(start), str(exc), refused=True)
        except TimeoutError:
            return Answer(None, _ms(start), f"timed out after {t:g} s")
        except aiohttp.ClientConnectorError as exc:
            cause = exc.__cause__ if isinstance(exc.__cause__, RefusedConnect) else None
            if cause is not None:
                return Answer(None, _ms(start), str(cause), refused=True)
            return Answer(None, _ms(start), f"{type(exc).__name__}: {exc}"[:500])
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            return Answer(None, _ms(start), f"{type(exc).__name__}: {exc}"[:500])
        text = kept.decode("utf-8", "replace")[:RESPONSE_KEPT]
        return Answer(status, _ms(start), body=text, retry_after=retry_after)

    async def _check_literal(self, url: str) -> None:
        """An IP literal host is judged here (aiohttp connects to it without a resolver)."""
        host = URL(url).raw_host or ""
        try:
            ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            return  # a name: PinnedResolver judges it at connect time
        try:
            await self.policy.addresses(AddressPolicy.parse(url), strict=False)
        except Refused as exc:
            raise RefusedConnect(f"refused: {exc}") from exc

    async def _read_capped(self, response: aiohttp.ClientResponse) -> tuple[bytes, bool]:
        """(at most ``max_response_bytes`` of the answer, whether that was all of it)."""
        kept = bytearray()
        while len(kept) < self.max_response_bytes:
            chunk = await response.content.read(self.max_response_bytes - len(kept))
            if not chunk:
                return bytes(kept[: RESPONSE_KEPT * 4]), True
            kept += chunk
        return bytes(kept[: RESPONSE_KEPT * 4]), response.content.at_eof()


def _ms(start: float) -> float:
    return round((time.perf_counter() - start) * 1000, 3)


def _retry_after(headers: CIMultiDictProxy[str]) -> float | None:
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value.strip()))
    except ValueError:
        return None  # an HTTP date: the schedule's delay stands

"""Outbound safety: which addresses a callback may reach, checked after DNS resolution.

A callback URL comes from a tenant, and the dispatcher sends to it from inside our network:
unchecked, a tenant could make it POST to a database's HTTP port or a cloud metadata service
(server-side request forgery). So at subscribe time (the API) every address the host
resolves to must be public; at delivery time (the dispatcher) it is resolved again, only
public addresses are used, and the connection is made to the very address checked
(``sender.PinnedResolver``): with no second resolution, DNS rebinding cannot redirect it.
``JOBTIER_WEBHOOK_ALLOWED_HOSTS`` lists exceptions (host names, addresses, CIDR networks).
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from jobtier.runtime.listen import is_ip_address

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
# host, port -> the addresses the name resolves to (a seam for tests)
Resolver = Callable[[str, int], Awaitable[list[str]]]

MAX_URL_LENGTH = 2000
RESOLVE_TIMEOUT = 5.0


class Refused(Exception):
    """A callback URL or address the policy does not allow (the message says why)."""


class RefusedConnect(Exception):
    """A delivery's connection not made: the host resolved to no allowed address."""


async def system_resolve(host: str, port: int) -> list[str]:
    """The addresses ``host`` resolves to, through the system's resolver."""
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(RESOLVE_TIMEOUT):
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def _plain(ip: IPAddress) -> IPAddress:
    """The IPv4 address an IPv4-mapped one carries (::ffff:127.0.0.1 reaches 127.0.0.1)."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def public(ip: IPAddress) -> bool:
    """True for an address on the public internet: not loopback, private, link-local (which
    holds the cloud metadata address 169.254.169.254), shared (100.64/10), unique-local
    (fd00:ec2::254, AWS's IPv6 metadata), documentation, reserved, unspecified or
    multicast."""
    ip = _plain(ip)
    return ip.is_global and not ip.is_multicast and not ip.is_unspecified


@dataclass(frozen=True)
class Target:
    scheme: str
    host: str  # lower case, without brackets
    port: int


_NUMERIC_HOST = re.compile(r"(?:0x[0-9a-f]*|[0-9]+)(?:\.(?:0x[0-9a-f]*|[0-9]+))*")


class AddressPolicy:
    """What callbacks may reach: public addresses, plus ``allowed`` (names, IPs, networks)."""

    def __init__(self, allowed: str = "", resolver: Resolver | None = None) -> None:
        self.names: set[str] = set()
        self.networks: list[IPNetwork] = []
        for item in (p.strip() for p in allowed.split(",")):
            if not item:
                continue
            try:
                self.networks.append(ipaddress.ip_network(item.strip("[]"), strict=False))
            except ValueError:
                self.names.add(item.lower().rstrip("."))
        self.resolve = resolver or system_resolve

    def address_allowed(self, ip: IPAddress) -> bool:
        ip = _plain(ip)
        return public(ip) or any(ip in net for net in self.networks)

    @staticmethod
    def parse(url: str) -> Target:
        """The URL's scheme, host and port, or ``Refused`` for a URL no callback may have."""
        if len(url) > MAX_URL_LENGTH:
            raise Refused(f"the URL is longer than {MAX_URL_LENGTH} characters")
        if any(ord(c) <= 32 or ord(c) == 127 for c in url):
            raise Refused("the URL has spaces or control characters")
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as exc:
            raise Refused(f"the URL is malformed ({exc})") from None
        if parts.scheme not in ("http", "https"):
            raise Refused("the URL must be http:// or https://")
        if not parts.hostname:
            raise Refused("the URL has no host")
        if parts.username is not None or parts.password is not None:
            raise Refused("the URL may not carry credentials (user:password@)")
        if parts.fragment:
            raise Refused("the URL may not have a #fragment")
        host = parts.hostname.lower().rstrip(".")
        if _NUMERIC_HOST.fullmatch(host) and not is_ip_address(host):
            # 2130706433, 0x7f.1, 127.1: the resolver takes them for addresses, the sender
            # refuses them (not canonical): such a callback could never be delivered
            raise Refused("the URL's host is an IPv4 address not written a.b.c.d")
        try:  # as the resolver will: a label over 63 characters, or one IDNA refuses
            host.encode("idna")
        except UnicodeError as exc:
            # the codec's own words ("label empty or too long"), without its wrapper's
            reason = str(exc).rpartition("UnicodeError: ")[2].rstrip(")") or str(exc)
            raise Refused(f"the URL's host is not a valid DNS name ({reason})") from None
        default = 443 if parts.scheme == "https" else 80
        return Target(parts.scheme, host, port or default)

    async def addresses(self, target: Target, *, strict: bool) -> list[str]:
        """The addresses a delivery to ``target`` may connect to.

        The host is resolved (an IP literal is itself) and each address judged. ``strict``
        (subscribe time) refuses the URL if any address is not allowed; otherwise (delivery
        time) the allowed ones are returned and the URL is refused only when none is. A host
        named in the allow-list may resolve anywhere.
        """
        try:
            literal: IPAddress | None = ipaddress.ip_address(target.host)
        except ValueError:
            literal = None
        if literal is not None:
            if not self.address_allowed(literal):
                raise Refused(f"{literal} is not a public address")
            return [str(literal)]
        try:
            found = await self.resolve(target.host, target.port)
        except (OSError, TimeoutError, UnicodeError) as exc:
            raise Refused(f"{target.host} does not resolve ({exc})") from None
        if not found:
            raise Refused(f"{target.host} does not resolve")
        if target.host in self.names:
            return found
        judged = [(a, self.address_allowed(ipaddress.ip_address(a))) for a in found]
        bad = [a for a, ok in judged if not ok]
        good = [a for a, ok in judged if ok]
        if bad and (strict or not good):
            raise Refused(f"{target.host} resolves to {bad[0]}, which is not a public address")
        return good

    async def check_url(self, url: str) -> Target:
        """Subscribe-time check (the API): ``Refused`` unless every address is allowed."""
        target = self.parse(url)
        await self.addresses(target, strict=True)
        return target

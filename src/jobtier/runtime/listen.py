"""Addresses: whether a server could listen on one, told before anything starts, and
whether a host is written as an IP address."""

from __future__ import annotations

import ipaddress
import socket


def is_ip_address(host: str) -> bool:
    """Whether ``host`` is an IP address as written (not a name to resolve)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def cannot_listen(host: str, port: int) -> str | None:
    """Why a server could not listen on ``host:port`` now (the system's words: 'Address
    already in use', 'Cannot assign requested address'), or None. A probe, bound and closed
    at once: a server taking the port meanwhile is still met by the real bind."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except OSError as exc:
        return exc.strerror or str(exc)
    return None

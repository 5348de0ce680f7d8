"""The address policy and the signatures, as pure functions (no connection is made)."""

from __future__ import annotations

import base64
import ipaddress
import logging
import time

import pytest
from standardwebhooks.webhooks import Webhook as Verifier

from jobtier.webhooks import signing
from jobtier.webhooks.safety import AddressPolicy, Refused, Target, public


@pytest.mark.parametrize(
    "address",
    ["127.0.0.1", "10.0.0.1", "172.16.0.1", "192.168.1.1", "169.254.169.254", "100.64.0.1",
     "0.0.0.0", "224.0.0.1", "::1", "fd00:ec2::254", "fe80::1", "::ffff:127.0.0.1",
     "::ffff:10.0.0.1", "198.51.100.7", "::"],
)  # fmt: skip
def test_non_public_addresses_are_refused(address: str) -> None:
    assert not public(ipaddress.ip_address(address))


@pytest.mark.parametrize("address", ["93.184.216.34", "2606:2800:220:1:248:1893:25c8:1946"])
def test_public_addresses_are_allowed(address: str) -> None:
    assert public(ipaddress.ip_address(address))


async def test_the_allow_list_takes_names_addresses_and_networks() -> None:
    async def resolve(host: str, port: int) -> list[str]:
        return {"dev.local": ["10.9.9.9"], "mixed.example": ["93.184.216.34", "10.0.0.5"]}[host]

    policy = AddressPolicy("127.0.0.1, 192.168.5.0/24, dev.local", resolve)
    assert await policy.addresses(Target("http", "127.0.0.1", 80), strict=True) == ["127.0.0.1"]
    assert await policy.addresses(Target("http", "192.168.5.9", 80), strict=True)
    assert await policy.addresses(Target("http", "dev.local", 80), strict=True) == ["10.9.9.9"]
    with pytest.raises(Refused):
        await policy.addresses(Target("http", "127.0.0.2", 80), strict=True)
    # a name resolving to a public and a private address: refused when subscribing; at
    # delivery only the public address is used
    with pytest.raises(Refused, match=r"10\.0\.0\.5"):
        await policy.addresses(Target("http", "mixed.example", 80), strict=True)
    mixed = await policy.addresses(Target("http", "mixed.example", 80), strict=False)
    assert mixed == ["93.184.216.34"]


@pytest.mark.parametrize(
    "url",
    ["ftp://a.example/", "http://", "http://u:p@a.example/", "http://a.example/#x",
     "http://a.example:99999/", "http://a .example/", "https://a.example/" + "x" * 2000,
     "http://" + "a" * 64 + ".example/", "http://\x80x.example/", "http://a..example/",
     # IPv4 addresses not written a.b.c.d: resolved, then refused by the sender, for good
     "https://2130706433/x", "http://0x7f.1/", "http://127.1/", "http://134744072/"],
)  # fmt: skip
def test_urls_no_callback_may_have(url: str) -> None:
    with pytest.raises(Refused):
        AddressPolicy.parse(url)


@pytest.mark.parametrize("url", ["http://127.0.0.1/", "http://1e100.example/", "http://[::1]/"])
def test_addresses_written_plainly_and_names_with_digits_parse(url: str) -> None:
    AddressPolicy.parse(url)


def test_signatures_verify_with_the_reference_library_and_sign_with_every_secret() -> None:
    new, old = signing.new_secret(), signing.new_secret()
    assert new.startswith("whsec_") and len(base64.b64decode(new[6:])) == 32
    body = b'{"type":"job.succeeded","data":{"id":"x"}}'
    headers = signing.headers([new, old], "msg_x_3_job", int(time.time()), body)
    assert headers["webhook-signature"].count("v1,") == 2
    for secret in (new, old):  # a receiver that knows either secret accepts it
        assert Verifier(secret).verify(body, headers) == {
            "type": "job.succeeded",
            "data": {"id": "x"},
        }


def test_a_postgres_outage_is_not_taken_for_redis_s(caplog: pytest.LogCaptureFixture) -> None:
    """A connection Postgres refuses is an OSError, as Redis's are: the dispatcher's reading
    loop logged it as event=redis_unavailable (and Postgres's own line after it)."""
    from jobtier.webhooks.dispatcher import Dispatcher, PostgresDown

    try:
        try:
            raise ConnectionRefusedError(111, "Connection refused")
        except ConnectionRefusedError as refused:
            raise PostgresDown from refused
    except PostgresDown as exc:
        down = exc
    with caplog.at_level(logging.WARNING, logger="jobtier.webhooks"):
        assert Dispatcher._failed(None, down, 0.1) is False  # type: ignore[arg-type]
        assert Dispatcher._failed(None, ConnectionRefusedError(111, "x"), 0.1) is True  # type: ignore[arg-type]
    said = [r.getMessage() for r in caplog.records]
    assert said[0].startswith("event=postgres_unavailable") and "Connection refused" in said[0]
    assert said[1].startswith("event=redis_unavailable"), said  # Redis's own still is

"""Standard Webhooks signatures (https://www.standardwebhooks.com, symmetric scheme).

A tenant's secret is 32 random bytes shown as ``whsec_`` + base64. Each attempt is sent with
``webhook-id`` (the delivery's id, the same on every attempt: receivers deduplicate by it),
``webhook-timestamp`` (the attempt's Unix time in seconds) and ``webhook-signature``: ``v1,`` +
base64 of HMAC-SHA256 over ``{id}.{timestamp}.{body}`` keyed with the secret's bytes, one per
secret in force, space-separated (after a rotation the previous secret signs too, for a
while, so receivers can switch without losing a delivery).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets as _secrets
from collections.abc import Sequence

PREFIX = "whsec_"
SECRET_BYTES = 32  # the spec asks for 24 to 64


def new_secret() -> str:
    """A fresh signing secret, ``whsec_`` + base64 of 32 random bytes."""
    return PREFIX + base64.b64encode(_secrets.token_bytes(SECRET_BYTES)).decode()


def signature(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """One ``v1,<base64>`` signature of the attempt."""
    key = base64.b64decode(secret.removeprefix(PREFIX), validate=True)
    mac = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


def headers(secrets: Sequence[str], msg_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    """The three Standard Webhooks headers of one attempt: a signature per secret in force."""
    signatures = " ".join(signature(s, msg_id, timestamp, body) for s in secrets)
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": signatures,
    }

"""Payloads and results encrypted at rest (docs/encryption.md): the envelope and its keys.

A sealed value is a JSON object that stands where the plain JSON would, in Redis, in the
transition log Postgres copies, and in the result store::

    {"$enc":"v1","kid":"k2","n":"<nonce, base64>","c":"<AES-GCM ciphertext and tag, base64>"}

Its associated data binds the job id and the part (``payload`` or ``result``): a ciphertext
copied to another job, or from a payload to a result, fails authentication. ``kid`` names
the key it was sealed with, so a ``Keyring`` holding the old keys still opens it after a
rotation; the first key of a keyring seals. Decrypt-only keys (``JOBTIER_DECRYPTION_KEYS``)
open and never seal: a rotation adds the new key so everywhere first, then promotes it.

``cryptography`` is imported only when a keyring is built (the ``jobtier[crypto]`` extra):
processes without keys, and the client, never load it.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
from typing import Any

import msgspec

from jobtier.core.errors import ConfigError, JobtierError
from jobtier.core.names import QUEUE_NAME_RE

PREFIX = b'{"$enc":"v1",'  # every sealed value starts so (``seal`` writes it first)
MASK = b'"[encrypted]"'  # what readers without the keys show (the console, logs)
KID_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
KEY_SIZES = (16, 24, 32)  # AES-128, -192, -256
NONCE_BYTES = 12
_decode = msgspec.json.Decoder(dict[str, Any]).decode


class _Envelope(msgspec.Struct):
    # in this order, so that every envelope starts with PREFIX; msgspec encodes and decodes
    # the base64 fields itself (faster than binascii)
    enc: str = msgspec.field(name="$enc")
    kid: str
    n: bytes
    c: bytes


_decode_envelope = msgspec.json.Decoder(_Envelope).decode
_encode = msgspec.json.Encoder().encode


class SealError(JobtierError):
    """A sealed value that cannot be opened; ``kind`` is its short name (a job's error type)."""

    kind = "DecryptionFailed"


class KeyMissing(SealError):
    """Sealed with a key this process does not hold (or with keys, where it has none)."""

    kind = "EncryptionKeyMissing"


class KeysNotConfigured(ConfigError):
    """A value this process must encrypt, and it has no ``JOBTIER_ENCRYPTION_KEYS`` (the API
    answers 503: its configuration, not the request, is at fault)."""


def is_sealed(data: bytes | None) -> bool:
    return bool(data) and data[: len(PREFIX)] == PREFIX  # type: ignore[index]


def _aad(job_id: str, part: str) -> bytes:
    return f"jobtier/v1\x00{job_id}\x00{part}".encode()


class Keyring:
    """Named AES-GCM keys: the first of ``keys`` seals, every one (``opening`` too) opens."""

    def __init__(
        self, keys: list[tuple[str, bytes]], opening: list[tuple[str, bytes]] | None = None
    ) -> None:
        try:
            from cryptography.exceptions import InvalidTag
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        except ImportError:
            raise ConfigError(
                "JOBTIER_ENCRYPTION_KEYS needs the cryptography package: "
                "pip install 'jobtier[crypto]'"
            ) from None
        if not keys:
            raise ConfigError("a keyring needs at least one key")
        self._invalid = InvalidTag
        both: list[tuple[str, bytes]] = [*keys, *(opening or [])]
        self.kids = [kid for kid, _ in both]
        if len(set(self.kids)) < len(self.kids):
            raise ConfigError(
                "JOBTIER_ENCRYPTION_KEYS and JOBTIER_DECRYPTION_KEYS name the same key id"
            )
        self._ciphers = {kid: AESGCM(key) for kid, key in both}
        self._sealing = self.kids[0]
        self._cipher = self._ciphers[self._sealing]

    @staticmethod
    def parse_keys(text: str, name: str = "JOBTIER_ENCRYPTION_KEYS") -> list[tuple[str, bytes]]:
        """``kid1:base64key,kid2:base64key`` as (kid, key) pairs; ``ConfigError`` naming the
        setting and the bad entry (never its key)."""
        keys: list[tuple[str, bytes]] = []
        for item in filter(None, (p.strip() for p in text.split(","))):
            kid, sep, encoded = item.partition(":")
            if not sep or not KID_RE.fullmatch(kid):
                raise ConfigError(
                    f"{name} entries are 'kid:base64key', the kid matching {KID_RE.pattern}"
                )
            try:
                key = base64.b64decode(encoded, validate=True)
            except (binascii.Error, ValueError):
                raise ConfigError(f"{name}: key {kid!r} is not base64") from None
            if len(key) not in KEY_SIZES:
                raise ConfigError(
                    f"{name}: key {kid!r} is {len(key)} bytes; AES-GCM takes 16, 24 or 32"
                )
            if kid in (k for k, _ in keys):
                raise ConfigError(f"{name} names key {kid!r} twice")
            keys.append((kid, key))
        return keys

    @classmethod
    def from_text(cls, text: str, opening: str = "") -> Keyring | None:
        """The keyring of a ``JOBTIER_ENCRYPTION_KEYS`` value and a
        ``JOBTIER_DECRYPTION_KEYS`` one; None for none."""
        keys = cls.parse_keys(text)
        more = cls.parse_keys(opening, "JOBTIER_DECRYPTION_KEYS")
        if more and not keys:
            raise ConfigError("JOBTIER_DECRYPTION_KEYS needs JOBTIER_ENCRYPTION_KEYS")
        return cls(keys, more) if keys else None

    @property
    def sealing_kid(self) -> str:
        return self._sealing

    def seal(self, job_id: str, part: str, plain: bytes) -> bytes:
        nonce = os.urandom(NONCE_BYTES)
        sealed = self._cipher.encrypt(nonce, plain, _aad(job_id, part))
        return _encode(_Envelope("v1", self._sealing, nonce, sealed))  # starts with PREFIX

    def open(self, job_id: str, part: str, data: bytes) -> bytes:
        """The plain bytes of a sealed value; ``KeyMissing`` or ``SealError`` (tampered,
        moved from another job or part, or not an envelope)."""
        try:
            envelope = _decode_envelope(data)
        except msgspec.DecodeError:  # (ValidationError too: a missing or mistyped field)
            raise SealError(f"the {part} of job {job_id} is not a readable envelope") from None
        if envelope.enc != "v1":
            raise SealError(f"the {part} of job {job_id} is in an envelope version unknown here")
        kid, nonce, sealed = envelope.kid, envelope.n, envelope.c
        cipher = self._ciphers.get(kid)
        if cipher is None:
            raise KeyMissing(
                f"the {part} of job {job_id} is encrypted with key id {kid[:64]!r}, which "
                f"this process does not hold (it holds {', '.join(self.kids)}; a worker retries "
                "the job later, after its deploy may have brought the key)"
            )
        try:
            return bytes(cipher.decrypt(nonce, sealed, _aad(job_id, part)))
        except (self._invalid, ValueError):
            raise SealError(
                f"the {part} of job {job_id} fails authentication: its ciphertext was altered, "
                "or copied from another job"
            ) from None


def unseal(keyring: Keyring | None, job_id: str, part: str, data: bytes) -> bytes:
    """``data`` as it was before sealing (itself when it is not sealed)."""
    if not is_sealed(data):
        return data
    if keyring is None:
        raise KeyMissing(
            f"the {part} of job {job_id} is encrypted, and this process has no "
            "JOBTIER_ENCRYPTION_KEYS"
        )
    return keyring.open(job_id, part, data)


def masked(data: bytes | None) -> bytes | None:
    """``data``, or ``MASK`` when it is sealed: what a reader without the keys shows."""
    return MASK if is_sealed(data) else data


def is_envelope(value: Any) -> bool:
    """A decoded JSON value that is a sealed one (a dependency's result, a compensation's
    ``payload``)."""
    return isinstance(value, dict) and value.get("$enc") == "v1"


def open_value(keyring: Keyring | None, job_id: str, part: str, value: Any) -> Any:
    """A decoded JSON value as it was before sealing (itself when it is not sealed)."""
    if not is_envelope(value):
        return value
    return msgspec.json.decode(unseal(keyring, job_id, part, msgspec.json.encode(value)))


def open_compensation(keyring: Keyring | None, payload: bytes, failed_id: str) -> bytes:
    """A compensation job's payload (lib.lua: ``{"job_id", "type", "payload", "error"}``)
    with the failed job's sealed payload opened as ``failed_id``'s.

    ``failed_id`` is the one Redis recorded when it created the compensation (claim.lua hands
    it over); a payload whose own ``job_id`` differs is not the server's, and is left as it is:
    a submitter must never get a copied envelope opened by naming its job in a payload."""
    if b'"payload":{"$enc":"v1",' not in payload:
        return payload
    value = _decode(payload)
    inner = value.get("payload")
    if not is_envelope(inner) or value.get("job_id") != failed_id:
        return payload
    value["payload"] = open_value(keyring, failed_id, "payload", inner)
    return msgspec.json.encode(value)


def settings_problems(
    encryption_keys: str, decryption_keys: str, encrypted_queues: frozenset[str]
) -> list[str]:
    """What is wrong with the encryption settings (``Settings.validate``), in words naming
    their variables."""
    try:
        keys = Keyring.parse_keys(encryption_keys)
        more = Keyring.parse_keys(decryption_keys, "JOBTIER_DECRYPTION_KEYS")
    except ConfigError as exc:
        return [str(exc)]
    if more and not keys:
        return ["JOBTIER_DECRYPTION_KEYS needs JOBTIER_ENCRYPTION_KEYS"]
    if {k for k, _ in keys} & {k for k, _ in more}:
        return ["JOBTIER_ENCRYPTION_KEYS and JOBTIER_DECRYPTION_KEYS name the same key id"]
    bad = [q for q in encrypted_queues if not QUEUE_NAME_RE.fullmatch(q)]
    if bad:
        return [f"JOBTIER_ENCRYPTED_QUEUES: {bad[0][:70]!r} is not a queue name"]
    if encrypted_queues and not keys:
        return ["JOBTIER_ENCRYPTED_QUEUES needs JOBTIER_ENCRYPTION_KEYS"]
    return []

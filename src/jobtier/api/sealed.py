"""Encrypted payloads and results in answers (docs/encryption.md): opened for the tenant
whose job it is (the API holds the keys), shown as ``"[encrypted]"`` on the admin routes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from jobtier.api.problems import Problem
from jobtier.core.sealing import KeyMissing, Keyring, SealError, unseal


@contextlib.contextmanager
def seal_problems(job_id: str) -> Iterator[None]:
    """A value this API cannot open answers with why, never a plain byte of it: 503 for a
    key this API lacks (its configuration: another replica, or its next deploy, has it), 500
    for a ciphertext that fails authentication."""
    try:
        yield
    except KeyMissing as exc:
        raise Problem(503, "encryption-keys-missing", str(exc), job_id=job_id) from None
    except SealError as exc:
        raise Problem(500, "encryption", str(exc), job_id=job_id) from None


def opened(keyring: Keyring | None, job_id: str, part: str, data: bytes) -> bytes:
    """``data`` opened (itself when not sealed), as ``seal_problems`` answers."""
    with seal_problems(job_id):
        return unseal(keyring, job_id, part, data)

"""Encrypted payloads and results in answers (docs/encryption.md): opened for the tenant
whose job it is (the API holds the keys), shown as ``"[encrypted]"`` on the admin routes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from jobtier.api.problems import Problem
from jobtier.core.sealing import Keyring, SealError, unseal


@contextlib.contextmanager
def seal_problems(job_id: str) -> Iterator[None]:
    """A value this API cannot open answers 500 with why (a key id it lacks, a ciphertext
    that fails authentication), never a plain byte of it."""
    try:
        yield
    except SealError as exc:
        raise Problem(500, "encryption", str(exc), job_id=job_id) from None


def opened(keyring: Keyring | None, job_id: str, part: str, data: bytes) -> bytes:
    """``data`` opened (itself when not sealed), as ``seal_problems`` answers."""
    with seal_problems(job_id):
        return unseal(keyring, job_id, part, data)

"""Tasks of a made-up image service; their tests are in test_example_tasks.py.

Run them for real with ``jobtier worker example_tasks`` (from this folder).
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

from jobtier import JobContext, task


class BadImage(Exception):
    """Retrying cannot fix it: listed as non-retryable below."""


@task(retries=3, backoff_base=1.0, backoff_factor=2.0, jitter=0.0, non_retryable=[BadImage])
async def thumbnail(ctx: JobContext, payload: dict[str, Any]) -> dict[str, Any]:
    image = payload["image"]
    if not image.endswith(".png"):
        raise BadImage(f"{image} is not a PNG")
    if payload.get("storage_down"):
        raise ConnectionError("storage unavailable")  # retried, with backoff
    sizes = payload.get("sizes", [64, 128])
    urls = []
    for done, size in enumerate(sizes, 1):
        await asyncio.sleep(0)  # the real resizing and upload would be here
        # keyed by the job id: a second run of the same job overwrites, never duplicates
        urls.append(f"https://cdn.example/{ctx.job_id}/{size}.png")
        ctx.progress({"done": done, "of": len(sizes)})
    return {"urls": urls}


@task(retries=0)
def checksum(ctx: JobContext, payload: dict[str, Any]) -> str:
    """A plain ``def``: the worker runs it in a thread, so it polls for a cancel."""
    digest = hashlib.sha256()
    for done, chunk in enumerate(payload["chunks"], 1):
        ctx.check_cancelled()
        digest.update(chunk.encode())
        ctx.progress(done)
    return digest.hexdigest()

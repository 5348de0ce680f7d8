"""The ASGI entry point for servers started by `jobtier api` (one app per server process)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jobtier import logs
from jobtier.config import Settings
from jobtier.runtime import tracing

if TYPE_CHECKING:
    from jobtier.api.app import JobtierApp


def app_from_env() -> JobtierApp:
    """Build the app from ``JOBTIER_*`` (granian/uvicorn call this in each server process)."""
    from jobtier.api.app import create_app
    from jobtier.api.records import postgres_extension

    settings = Settings.from_env()
    logs.setup(settings.log_level, settings.log_format)
    tracing.setup(settings, "api")  # JOBTIER_OTEL=1: this server process's own provider
    return create_app(settings, postgres_extension(settings), own_process=True)

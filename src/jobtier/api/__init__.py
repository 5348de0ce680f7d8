"""The HTTP API: ``create_app(settings)`` builds the Starlette application."""

from jobtier.api.app import create_app

__all__ = ["create_app"]

"""The API's requests as OpenTelemetry server spans, when tracing is on (runtime/tracing.py).

Each HTTP request is a span, a child of the context its ``traceparent`` header names (else
the first of its trace), current while the request is served: a submit made in it hands the
span's context to the jobs it creates, whose attempts are then its children. Status reads
answered by the fast path are spans too. The span is named by the method and the route's
template (``POST /v1/jobs``; routing.py puts the template in the scope); a 5xx answer, or an
exception out of the app, marks it failed. Probes and scrapes (``UNTRACED``) make none: a
load balancer's and Prometheus's every few seconds would fill the traces.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jobtier.runtime import tracing

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer


UNTRACED = frozenset({"/healthz", "/readyz", "/metrics"})


class ServerSpans:
    """ASGI middleware: a span around each HTTP request of ``app``."""

    def __init__(self, app: ASGIApp, tracer: Tracer) -> None:
        self.app = app
        self.tracer = tracer
        self.kind = tracing.kind("SERVER")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNTRACED:
            await self.app(scope, receive, send)
            return
        method = scope["method"]
        parent = tracing.context_from_headers(scope["headers"]) or tracing.context_of(None)
        attributes: dict[str, Any] = {
            "http.request.method": method,
            "url.path": scope["path"],
            "url.scheme": scope.get("scheme", "http"),
            "network.protocol.version": scope.get("http_version", "1.1"),
        }
        span = self.tracer.start_span(method, parent, self.kind, attributes)
        status = 0

        async def sent(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        token = tracing.attach(span, parent)
        try:
            await self.app(scope, receive, sent)
        except Exception as exc:
            tracing.failed(span, exc, f"{type(exc).__name__} while serving the request")
            raise
        finally:
            tracing.detach(token)
            route = scope.get("route")
            if route is not None:
                span.update_name(f"{method} {route}")
                span.set_attribute("http.route", route)
            if status:
                span.set_attribute("http.response.status_code", status)
                if status >= 500:
                    tracing.failed(span, None, f"HTTP {status}")
            span.end()

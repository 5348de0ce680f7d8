"""OpenTelemetry tracing, when it is wanted (docs/tracing.md).

Tracing is on in a process once a TracerProvider is there to trace with: one the application
set (``opentelemetry.trace.set_tracer_provider``), one a ``jobtier`` role set up from
``JOBTIER_OTEL=1`` and the ``OTEL_*`` settings (``setup``), or one given to ``install``.
Otherwise it is off. jobtier imports nothing of OpenTelemetry to find out (it need not be
installed): an application that set a provider has imported ``opentelemetry.trace``, so until
some code has, the check is a dict lookup; after (redis-py imports it when it is installed),
a look at the global provider, until one is set.

What is traced: a submit inside a span hands that span's W3C ``traceparent`` to the jobs it
creates (``traceparent``; store/context.py sends it with the submit, and each job keeps it as
``tp``); a worker's attempt of the job is a span whose parent it is (worker/attempt_spans.py);
the API's requests are server spans (api/server_spans.py), and the persister's batches spans.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from importlib import import_module
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

from jobtier.config import Settings
from jobtier.core.errors import ConfigError

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider as SdkProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, Tracer, TracerProvider

NAME = "jobtier"  # the instrumentation scope of every span jobtier makes
_tracer: Tracer | None = None  # found once, then kept (a process sets its provider once)
_installed: TracerProvider | None = None  # install()'s, which wins over the global one
_configured: SdkProvider | None = None  # setup()'s, shut down (flushed) by shutdown()
_propagator: Any = None  # the W3C trace context propagator, made on first use


def tracer() -> Tracer | None:
    """jobtier's tracer, or None while tracing is off."""
    if _tracer is not None:
        return _tracer
    return _find()


def _find() -> Tracer | None:
    global _tracer
    api = sys.modules.get("opentelemetry.trace")
    if api is None:  # nobody set a provider (that imports this first): off, nothing imported
        return None
    provider = _installed or api.get_tracer_provider()
    if isinstance(provider, api.ProxyTracerProvider | api.NoOpTracerProvider):
        return None  # the application may set one later: looked for again next time
    _tracer = provider.get_tracer(NAME)
    return _tracer


def install(provider: TracerProvider | None) -> None:
    """Trace with ``provider`` rather than the global one (None: the global one again) —
    for an application that keeps its provider to itself, and for tests."""
    global _installed, _tracer
    if provider is not None:
        import opentelemetry.trace  # noqa: F401  (what _find looks for)
    _installed, _tracer = provider, None


def traceparent() -> str:
    """The W3C traceparent of the current span, for a submit to hand to its jobs; '' when
    tracing is off or no span is current."""
    if (_tracer or _find()) is None:
        return ""
    from opentelemetry.trace import get_current_span

    ctx = get_current_span().get_span_context()
    if not ctx.is_valid:
        return ""
    # a parent that was not sampled is kept too: the worker's span then follows its decision
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"


def _w3c() -> Any:
    global _propagator
    if _propagator is None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        _propagator = TraceContextTextMapPropagator()
    return _propagator


def context_of(traceparent: str | None) -> Context:
    """The context whose (remote) span is the one ``traceparent`` names: a span started in
    it is its child. For none, an empty context (a span started in it starts a trace); a
    malformed one is ignored so too, as the W3C specification asks.

    Parsed here rather than by the propagator (once per attempt: its regular expression
    costs several times this); the value is one ``traceparent()`` wrote."""
    from opentelemetry import trace
    from opentelemetry.context import Context

    parts = traceparent.split("-") if traceparent else ()
    if len(parts) == 4 and parts[0] == "00" and len(parts[1]) == 32 and len(parts[2]) == 16:
        try:
            trace_id, span_id, flags = int(parts[1], 16), int(parts[2], 16), int(parts[3], 16)
        except ValueError:
            return Context()
        if trace_id and span_id:
            remote = trace.SpanContext(trace_id, span_id, True, trace.TraceFlags(flags & 0xFF))
            return trace.set_span_in_context(trace.NonRecordingSpan(remote), Context())
    return Context()


def context_from_headers(headers: Iterable[tuple[bytes, bytes]]) -> Context | None:
    """The context an HTTP request's ``traceparent`` (and ``tracestate``) headers carry."""
    carrier: dict[str, str] = {}
    for name, value in headers:
        if name in (b"traceparent", b"tracestate"):
            carrier[name.decode()] = value.decode("latin-1")
    if "traceparent" not in carrier:
        return None
    ctx: Context = _w3c().extract(carrier)
    return ctx


def attach(span: Span, parent: Context | None = None) -> object:
    """Make ``span`` the current one (in ``parent``'s context); ``detach`` the token after."""
    from opentelemetry import context, trace

    return context.attach(trace.set_span_in_context(span, parent))


def detach(token: object) -> None:
    from opentelemetry import context

    context.detach(token)  # type: ignore[arg-type]


def failed(span: Span, exc: BaseException | None, description: str) -> None:
    """Mark ``span`` as failed: ``exc`` recorded as its exception event (when there is one),
    error status with ``description``."""
    from opentelemetry.trace import Status, StatusCode

    if exc is not None:
        span.record_exception(exc)
    span.set_status(Status(StatusCode.ERROR, description))


def kind(name: str) -> Any:
    """The ``SpanKind`` member ``name`` (SERVER, CONSUMER, INTERNAL)."""
    from opentelemetry.trace import SpanKind

    return SpanKind[name]


def consumer() -> Any:
    """``SpanKind.CONSUMER``, looked up once (the kind of every attempt's span)."""
    global _consumer
    if _consumer is None:
        _consumer = kind("CONSUMER")
    return _consumer


_consumer: Any = None


# --- the roles' own provider (JOBTIER_OTEL=1) -----------------------------------------------
OTLP_HTTP = "opentelemetry.exporter.otlp.proto.http.trace_exporter"


def setup(settings: Settings, role: str) -> bool:
    """For a role started by the ``jobtier`` command with ``JOBTIER_OTEL=1``: a TracerProvider
    made from the OTEL_* settings, its spans sent in batches to each exporter
    ``OTEL_TRACES_EXPORTER`` names. A provider the process already has is kept. True when
    tracing is on after it."""
    if not settings.otel:
        return tracer() is not None
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider as Provider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        raise ConfigError(
            "JOBTIER_OTEL=1 needs the OpenTelemetry SDK: pip install 'jobtier[otel]'"
        ) from None
    if tracer() is not None:
        return True
    exporters = [_exporter(n.strip()) for n in settings.otel_exporter.split(",")]
    service = settings.otel_service_name or f"jobtier-{role}"
    provider = Provider(resource=Resource.create({"service.name": service}))
    for exporter in exporters:
        if exporter is not None:
            provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    global _configured
    _configured = provider
    return tracer() is not None


def _exporter(name: str) -> SpanExporter | None:
    """The span exporter ``OTEL_TRACES_EXPORTER`` names: otlp (OTLP over HTTP, to
    ``OTEL_EXPORTER_OTLP_ENDPOINT``), console (stdout), none, or any exporter package's."""
    if name in ("", "none"):
        return None
    if name == "otlp":
        try:
            module = import_module(OTLP_HTTP)
        except ImportError:
            raise ConfigError(
                "OTEL_TRACES_EXPORTER=otlp needs the OTLP exporter: pip install "
                "'jobtier[otlp]' (or set OTEL_TRACES_EXPORTER=console)"
            ) from None
        exporter: SpanExporter = module.OTLPSpanExporter()
        return exporter
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    found = entry_points(group="opentelemetry_traces_exporter", name=name)
    if not found:
        raise ConfigError(f"OTEL_TRACES_EXPORTER names {name!r}: no installed exporter has it")
    made: SpanExporter = next(iter(found)).load()()
    return made


def shutdown() -> None:
    """Send the spans still buffered, before the process exits (setup's provider only: an
    application's own is the application's to shut down)."""
    if _configured is not None:
        _configured.shutdown()

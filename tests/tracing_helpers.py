"""The tracing tests' spans: a provider handed to ``tracing.install`` exporting to the SDK's
InMemorySpanExporter (the process's global provider stays unset: other tests run
untraced), and the span ids as the tests compare them."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Span

from jobtier.runtime import tracing


@dataclass
class Traced:
    provider: TracerProvider
    exporter: InMemorySpanExporter

    def spans(self, name: str | None = None) -> list[ReadableSpan]:
        return [s for s in self.exporter.get_finished_spans() if name is None or s.name == name]

    def attempts(self, job_id: str) -> list[ReadableSpan]:
        """The attempt spans of ``job_id``, in the order they ended."""
        return [
            s
            for s in self.exporter.get_finished_spans()
            if s.attributes and s.attributes.get("jobtier.job.id") == job_id
        ]


@contextmanager
def traced_in_memory() -> Iterator[Traced]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider)
    try:
        yield Traced(provider, exporter)
    finally:
        tracing.install(None)
        provider.shutdown()


def ids(span: ReadableSpan | Span) -> tuple[int, int]:
    """(trace id, span id) of a finished span or of one still open."""
    ctx = span.get_span_context() if isinstance(span, Span) else span.context
    assert ctx is not None
    return ctx.trace_id, ctx.span_id

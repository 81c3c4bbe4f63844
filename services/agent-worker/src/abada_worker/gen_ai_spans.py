"""Client spans for the model and tool calls, named and tagged as OpenTelemetry's GenAI conventions say."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind
from opentelemetry.util.types import AttributeValue

tracer = trace.get_tracer("abada.worker")


@contextmanager
def gen_ai_span(operation: str, target: str, attributes: Mapping[str, AttributeValue]) -> Iterator[Span]:
    """A client span named `{operation} {target}` (`chat gemini-2.5-flash`, `execute_tool search`),
    with `gen_ai.operation.name` beside the given attributes."""
    with tracer.start_as_current_span(
        f"{operation} {target}",
        kind=SpanKind.CLIENT,
        attributes={"gen_ai.operation.name": operation, **attributes},
    ) as span:
        yield span

"""OpenTelemetry for a service, configured only by the standard OTEL_* variables, off when unset.

Tracing turns on when OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set (and
neither OTEL_SDK_DISABLED=true nor OTEL_TRACES_EXPORTER=none says otherwise). The protocol is
OTEL_EXPORTER_OTLP_TRACES_PROTOCOL / OTEL_EXPORTER_OTLP_PROTOCOL: `http/protobuf` (the default) or
`grpc`; endpoint, headers, timeouts, batching (OTEL_BSP_*), OTEL_SERVICE_NAME and
OTEL_RESOURCE_ATTRIBUTES are read by the SDK itself. gRPC servers and channels created afterwards
carry the W3C trace context in their metadata.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

log = logging.getLogger(__name__)

_configured = False


def tracing_wanted(environ: Mapping[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return False
    return bool(env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def _exporter(env: Mapping[str, str]) -> SpanExporter:
    protocol = (
        env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter()
    if protocol != "http/protobuf":
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL must be http/protobuf or grpc, not {protocol!r}")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    return HttpExporter()


def configure_tracing(service_name: str) -> bool:
    """Sets up the tracer provider and gRPC propagation when OTEL_* asks for it; True when on."""
    global _configured
    if _configured or not tracing_wanted():
        return _configured
    env = os.environ
    # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES, when set, win over the service's own name.
    resource = Resource.create({"service.name": service_name}).merge(
        Resource.create({"service.name": env["OTEL_SERVICE_NAME"]})
        if env.get("OTEL_SERVICE_NAME")
        else Resource({})
    )
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(_exporter(env)))
    trace.set_tracer_provider(provider)
    from opentelemetry.instrumentation.grpc import (
        GrpcAioInstrumentorClient,
        GrpcAioInstrumentorServer,
        filters,
    )

    # Health and reflection are left alone: probes are no work worth a trace, and the health
    # servicer's handlers are plain functions, which the aio interceptor would await.
    untraced = filters.any_of(filters.health_check(), filters.service_prefix("grpc.reflection"))
    # The instrumentors' constructors carry no annotations (opentelemetry-instrumentation-grpc).
    GrpcAioInstrumentorServer(filter_=filters.negate(untraced)).instrument()  # type: ignore[no-untyped-call]
    GrpcAioInstrumentorClient(filter_=filters.negate(untraced)).instrument()  # type: ignore[no-untyped-call]
    _configured = True
    log.info("tracing on", extra={"otel_service_name": resource.attributes.get("service.name")})
    return True


def shutdown_tracing() -> None:
    """Exports what is still buffered; called on a clean stop (the SDK also does it at exit)."""
    provider = trace.get_tracer_provider()
    shutdown = getattr(provider, "shutdown", None)
    if callable(shutdown):
        shutdown()


def inject_traceparent() -> str:
    """The current span's W3C `traceparent`, or "" outside a recorded span."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier.get("traceparent", "")


def context_from_traceparent(traceparent: str) -> Context | None:
    """An OpenTelemetry context continuing the trace of `traceparent`; None when there is none."""
    if not traceparent:
        return None
    context = propagate.extract({"traceparent": traceparent})
    return context if trace.get_current_span(context).get_span_context().is_valid else None


class TraceContextFilter(logging.Filter):
    """Adds `trace_id` and `span_id` to every record written inside a recorded span."""

    def filter(self, record: logging.LogRecord) -> bool:
        context = trace.get_current_span().get_span_context()
        if context.is_valid:
            record.trace_id = format(context.trace_id, "032x")
            record.span_id = format(context.span_id, "016x")
        return True

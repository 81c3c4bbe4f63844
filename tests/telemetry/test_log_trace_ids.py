"""Every JSON log line written inside a span carries its trace id; lines outside a span carry none."""

from __future__ import annotations

import io
import json
import logging

import pytest
from abada_common.logs import JsonFormatter
from abada_common.telemetry import TraceContextFilter, tracing_wanted
from abada_worker.logs import redactor
from opentelemetry.sdk.trace import TracerProvider


@pytest.mark.parametrize(
    "formatter",
    [
        JsonFormatter("engine"),
        JsonFormatter("agent-worker", redact=redactor.redact),
        JsonFormatter("credential-broker"),
    ],
    ids=["engine", "worker", "broker"],
)
def test_json_lines_inside_a_span_carry_its_trace_id(formatter):
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    handler.addFilter(TraceContextFilter())
    logger = logging.getLogger(f"trace-test-{id(formatter)}")
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.INFO)
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("work") as span:
        logger.info("inside")
        expected = format(span.get_span_context().trace_id, "032x")
    logger.info("outside")
    inside, outside = (json.loads(line) for line in stream.getvalue().splitlines())
    assert inside["trace_id"] == expected and len(inside["span_id"]) == 16
    assert "trace_id" not in outside


def test_tracing_is_off_unless_the_standard_variables_ask_for_it():
    assert not tracing_wanted({})
    assert tracing_wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"})
    assert tracing_wanted({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"})
    assert not tracing_wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318", "OTEL_SDK_DISABLED": "true"})
    assert not tracing_wanted(
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318", "OTEL_TRACES_EXPORTER": "none"}
    )

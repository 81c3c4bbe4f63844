"""The worker's Prometheus figures, served at /metrics beside /healthz."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

MODEL_CALL_SECONDS = Histogram(
    "abada_worker_model_call_seconds",
    "Model call latency, by model and outcome (ok or failed).",
    ["model", "outcome"],
    buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40, 80),
)
MODEL_TOKENS = Counter(
    "abada_worker_model_tokens_total",
    "Tokens spent on model calls, by model and direction.",
    ["model", "direction"],
)
TOOL_CALL_SECONDS = Histogram(
    "abada_worker_tool_call_seconds",
    "Tool call latency, by server/tool and outcome (ok, tool_error or failed).",
    ["tool", "outcome"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30),
)
LEASE_RENEWALS = Counter(
    "abada_worker_lease_renewals_total", "ExtendLease calls, by outcome (ok, lost or failed).", ["outcome"]
)


def observe_model_call(
    model: str, seconds: float, input_tokens: int, output_tokens: int, failed: bool = False
) -> None:
    MODEL_CALL_SECONDS.labels(model, "failed" if failed else "ok").observe(seconds)
    if input_tokens:
        MODEL_TOKENS.labels(model, "input").inc(input_tokens)
    if output_tokens:
        MODEL_TOKENS.labels(model, "output").inc(output_tokens)

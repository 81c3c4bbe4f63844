"""The broker's Prometheus figures: credentials issued and refused, served at ABADA_BROKER_METRICS_ADDRESS."""

from __future__ import annotations

from prometheus_client import Counter, start_http_server

CREDENTIALS = Counter(
    "abada_broker_credentials_total",
    "Credential requests by purpose (task or deploy) and outcome (issued, or why refused).",
    ["purpose", "outcome"],
)


def serve_metrics(address: str) -> int:
    """Starts `GET /metrics` on HOST:PORT (port 0 picks one) in a thread; returns the port."""
    host, _, port = address.rpartition(":")
    server, _thread = start_http_server(int(port), addr=host or "127.0.0.1")
    return int(server.server_address[1])

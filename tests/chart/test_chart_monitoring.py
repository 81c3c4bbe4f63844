"""Prometheus and pod hardening as an operator sets them through values.

ServiceMonitors (Prometheus Operator, monitoring.coreos.com/v1), off by default: each is followed from
its selector to a Service, a Service port, a container port and the address the component's own
settings parser reads, so a monitor that scrapes the wrong port fails here, not on a dashboard. The
engine's /metrics answers only a `metrics` (or `operator`) token: its monitor must present one.

Pod and container security contexts: the hardened defaults stay exactly as they were, and a user's
keys merge over them per component (engine and its migration Job, broker, every pool or one pool).
"""

from __future__ import annotations

import copy
import json
import pathlib
from collections.abc import Callable
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
from abada_broker.config import BrokerSettings
from abada_engine.config import EngineSettings
from abada_worker.settings import load_settings
from chart_support import (
    Manifest,
    Release,
    each,
    iter_containers,
    only_container,
    pod_spec,
    render,
    render_set,
)
from helm_python import HelmValuesError
from network_policy_evaluator import Endpoint, allowed, one_pod, pods_of
from test_chart_kubernetes_schemas import KUBERNETES_VERSIONS, check
from test_chart_service_contract import kubelet_env, pod_name_of

SERVICE_MONITOR = json.loads((pathlib.Path(__file__).parent / "servicemonitor.schema.json").read_text())
MONITORED = "servicemonitor-on.yaml"
PROMETHEUS = Endpoint("Prometheus", "10.244.6.6", "monitoring", {"app": "prometheus"})

HARDENED_POD = {
    "runAsNonRoot": True,
    "runAsUser": 10001,
    "runAsGroup": 10001,
    "fsGroup": 10001,
    "seccompProfile": {"type": "RuntimeDefault"},
}
HARDENED_CONTAINER = {
    "runAsNonRoot": True,
    "runAsUser": 10001,
    "runAsGroup": 10001,
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "privileged": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def scraped(release: Release, monitor: Manifest) -> list[tuple[Manifest, dict[str, Any], int]]:
    """Each (Deployment, container, container port) the monitor's one endpoint reaches."""
    (endpoint,) = monitor["spec"]["endpoints"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    reached = []
    for service in each(
        (s for s in release.of_kind("Service") if _matches(selector, s["metadata"]["labels"])), "Service"
    ):
        (port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
        (deployment,) = [
            d
            for d in release.of_kind("Deployment")
            if _matches(service["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"])
        ]
        container = only_container(deployment)
        (number,) = [p["containerPort"] for p in container["ports"] if p["name"] == port["targetPort"]]
        reached.append((deployment, container, int(number)))
    return reached


def listening_port(address: str | None) -> int:
    assert address is not None
    host, _, port = address.rpartition(":")
    assert host == "0.0.0.0", f"{address}: not reachable from outside the pod"
    return int(port)


def monitor_of(release: Release, component: str) -> Manifest:
    (monitor,) = [m for m in release.of_kind("ServiceMonitor") if release.component(m) == component]
    return monitor


def test_no_service_monitor_unless_asked(value_set: str, release: Release) -> None:
    if value_set == MONITORED:
        assert len(release.of_kind("ServiceMonitor")) == 3
        return
    assert release.of_kind("ServiceMonitor") == []
    # Nor the per-pool Services that exist only for the workers' monitor.
    assert {release.component(s) for s in release.of_kind("Service")} == {"engine", "broker"}


def test_each_monitor_scrapes_the_port_its_process_serves_metrics_on() -> None:
    release = render_set(MONITORED)
    for monitor in release.of_kind("ServiceMonitor"):
        jsonschema.validate(monitor, SERVICE_MONITOR)
        (endpoint,) = monitor["spec"]["endpoints"]
        assert endpoint["path"] == "/metrics" and endpoint["scheme"] == "http"
        assert (endpoint["interval"], endpoint["scrapeTimeout"]) == ("15s", "5s")
        assert monitor["metadata"]["labels"]["release"] == "prometheus"

    ((engine, container, port),) = scraped(release, monitor_of(release, "engine"))
    settings = EngineSettings.from_env(kubelet_env(container, pod_name_of(engine)))
    assert port == listening_port(settings.http_address) == 8080

    ((broker, container, port),) = scraped(release, monitor_of(release, "broker"))
    broker_settings = BrokerSettings.from_env(kubelet_env(container, pod_name_of(broker)))
    assert port == listening_port(broker_settings.metrics_address) == 9090

    pools = scraped(release, monitor_of(release, "worker"))
    assert sorted(d["metadata"]["name"] for d, _, _ in pools) == [
        "abada-worker-agent",
        "abada-worker-billing",
    ]
    for deployment, container, port in pools:
        worker_settings = load_settings([], kubelet_env(container, pod_name_of(deployment)))
        assert port == listening_port(worker_settings.health_address) == 8081
    # Every series of a pool says which pool it came from.
    assert monitor_of(release, "worker")["spec"]["targetLabels"] == ["abada.dev/worker-pool"]


def test_only_the_engine_monitor_presents_a_token_and_it_is_the_one_named() -> None:
    release = render_set(MONITORED)
    (engine_endpoint,) = monitor_of(release, "engine")["spec"]["endpoints"]
    assert engine_endpoint["authorization"] == {
        "type": "Bearer",
        "credentials": {"name": "abada-prometheus-scrape", "key": "bearer"},
    }
    for component in ("broker", "worker"):
        (endpoint,) = monitor_of(release, component)["spec"]["endpoints"]
        assert not {"authorization", "bearerTokenSecret", "basicAuth"} & endpoint.keys()
    defaults = render({"serviceMonitor": {"enabled": True}})
    (endpoint,) = monitor_of(defaults, "engine")["spec"]["endpoints"]
    assert endpoint["authorization"]["credentials"] == {"name": "abada-metrics-scrape", "key": "token"}
    assert (endpoint["interval"], endpoint["scrapeTimeout"]) == ("30s", "10s")


def test_the_guide_says_how_to_make_the_scrape_token() -> None:
    guide = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    rows = [
        line for line in guide.splitlines() if line.startswith("| `") and "`abada-metrics-scrape`" in line
    ]
    assert any("role `metrics`" in row for row in rows), (
        "docs/operations.md: no token row for abada-metrics-scrape"
    )


def test_prometheus_is_let_in_to_every_metrics_port_and_nothing_else() -> None:
    release = render_set(MONITORED)
    engine, broker = one_pod(release, "engine"), one_pod(release, "broker")
    assert allowed(release, PROMETHEUS, engine, 8080)
    assert allowed(release, PROMETHEUS, broker, 9090)
    for worker in each(pods_of(release, "worker"), "worker pod"):
        assert allowed(release, PROMETHEUS, worker, 8081)
    assert not allowed(release, PROMETHEUS, engine, 50051)
    assert not allowed(release, PROMETHEUS, broker, 50061)
    # Without scrapeFrom nobody outside is let in to the broker's or the workers' metrics.
    default = render_set("default")
    assert not allowed(default, PROMETHEUS, one_pod(default, "broker"), 9090)
    assert not allowed(default, PROMETHEUS, one_pod(default, "worker"), 8081)


@pytest.mark.parametrize(
    ("broken", "why"),
    [
        (lambda m: m["spec"]["endpoints"][0].update(scrapeTimeout="5 seconds"), "a duration in words"),
        (lambda m: m["spec"]["endpoints"][0].update(scheme="grpc"), "a scheme Prometheus cannot scrape"),
        (lambda m: m["spec"]["endpoints"][0].update(bearerToken="abc"), "a field the CRD does not have"),
        (lambda m: m["spec"]["endpoints"][0].update(port=8080), "a port number where a name goes"),
        (lambda m: m["spec"]["endpoints"][0]["authorization"]["credentials"].pop("key"), "no Secret key"),
        (lambda m: m["spec"].pop("selector"), "no selector"),
    ],
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_the_service_monitor_check_catches_mistakes(broken: Callable[[Manifest], object], why: str) -> None:
    # The vendored schema must refuse what the CRD would refuse, or passing it means nothing.
    monitor = copy.deepcopy(monitor_of(render_set(MONITORED), "engine"))
    broken(monitor)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(monitor, SERVICE_MONITOR)


def test_by_default_every_pod_keeps_the_hardened_security_contexts(release: Release) -> None:
    for workload in each(release.workloads(), "workload"):
        assert pod_spec(workload)["securityContext"] == HARDENED_POD, workload["metadata"]["name"]
        for container in iter_containers(workload):
            assert container["securityContext"] == HARDENED_CONTAINER, workload["metadata"]["name"]


OVERRIDES: dict[str, Any] = {
    "engine": {
        "podSecurityContext": {"runAsUser": 20000, "runAsGroup": 20000, "fsGroup": 20000},
        # null drops a default key.
        "securityContext": {"runAsUser": 20000, "runAsGroup": 20000, "privileged": None},
    },
    "broker": {"securityContext": {"capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]}}},
    "workerDefaults": {"podSecurityContext": {"fsGroupChangePolicy": "OnRootMismatch"}},
    "workers": [
        {"topic": "abada:agent"},
        {
            "name": "billing",
            "topic": "billing:reconcile",
            "podSecurityContext": {"seccompProfile": {"type": "Localhost", "localhostProfile": "abada.json"}},
            "securityContext": {"runAsUser": 30000},
        },
    ],
}


def test_security_contexts_are_overridable_per_component_and_pool() -> None:
    release = render(OVERRIDES)
    for manifest in release.manifests:
        check(manifest)  # still what Kubernetes accepts

    def contexts(workload: Manifest) -> tuple[dict[str, Any], dict[str, Any]]:
        return pod_spec(workload)["securityContext"], only_container(workload)["securityContext"]

    engine_container = {**HARDENED_CONTAINER, "runAsUser": 20000, "runAsGroup": 20000}
    del engine_container["privileged"]
    engine_pod = {**HARDENED_POD, "runAsUser": 20000, "runAsGroup": 20000, "fsGroup": 20000}
    assert contexts(release.deployment_of("engine")) == (engine_pod, engine_container)
    # The migration Job runs the engine's image: it takes the engine's contexts.
    (job,) = release.of_kind("Job")
    assert contexts(job) == (engine_pod, engine_container)

    broker_pod, broker_container = contexts(release.deployment_of("broker"))
    assert broker_pod == HARDENED_POD
    assert broker_container == {
        **HARDENED_CONTAINER,
        "capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]},
    }

    pools = {
        d["metadata"]["name"]: d for d in release.of_kind("Deployment") if release.component(d) == "worker"
    }
    assert contexts(pools["abada-worker-abada-agent"]) == (
        {**HARDENED_POD, "fsGroupChangePolicy": "OnRootMismatch"},
        HARDENED_CONTAINER,
    )
    # A pool's own keys merge over workerDefaults', which merge over the chart's.
    assert contexts(pools["abada-worker-billing"]) == (
        {
            **HARDENED_POD,
            "fsGroupChangePolicy": "OnRootMismatch",
            "seccompProfile": {"type": "Localhost", "localhostProfile": "abada.json"},
        },
        {**HARDENED_CONTAINER, "runAsUser": 30000},
    )
    for deployment in pools.values():
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate(deployment, version, strict=True)


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"engine": {"securityContext": {"readOnlyRootFS": True}}}, "readOnlyRootFS"),
        ({"broker": {"podSecurityContext": {"runAsUser": "root"}}}, "/broker/podSecurityContext/runAsUser"),
        ({"workers": [{"topic": "t", "securityContext": {"capabilities": {"remove": ["ALL"]}}}]}, "remove"),
        ({"serviceMonitor": {"interval": "30 seconds"}}, "/serviceMonitor/interval"),
        ({"serviceMonitor": {"engineToken": {"existingSecret": ""}}}, "/serviceMonitor/engineToken"),
    ],
    ids=[
        "misspelt container key",
        "uid as text",
        "unknown capabilities key",
        "interval in words",
        "no token",
    ],
)
def test_the_schema_refuses_what_kubernetes_or_prometheus_would(values: dict[str, Any], where: str) -> None:
    with pytest.raises(HelmValuesError) as refused:
        render(values)
    assert where in str(refused.value)

"""Who may talk to whom, judged the way Kubernetes judges NetworkPolicies (network_policy_evaluator)."""

from __future__ import annotations

import pytest
from chart_support import NAMESPACE, VALUE_SETS, Release, each, render, render_set
from network_policy_evaluator import (
    Endpoint,
    allowed,
    one_pod,
    pods_of,
    policy_types,
    release_pods,
    selector_matches,
)

KUBE_DNS = Endpoint("kube-dns", "10.96.0.10", "kube-system", {"k8s-app": "kube-dns"})
# Where ci/ and the defaults put Vault and PostgreSQL.
VAULT = {
    "default": Endpoint("Vault", "10.50.0.2", "vault", {"app.kubernetes.io/name": "vault"}),
    "mtls-on.yaml": Endpoint("Vault", "10.30.0.10"),
}
POSTGRESQL = {
    "default": Endpoint("PostgreSQL", "10.1.2.3"),
    "keda-on.yaml": Endpoint("PostgreSQL", "10.20.0.5"),
}
CRM_TOOL_SERVER = Endpoint("CRM MCP server", "10.60.0.7", "crm", {"app": "crm-mcp"})
GEMINI = Endpoint("the Gemini API", "142.250.74.10")
OTHER_APP = Endpoint("another app in the namespace", "10.244.9.9", NAMESPACE, {"app": "something-else"})
OPERATOR = Endpoint("an operator's CLI pod", "10.244.8.8", "abada-operators", {"app": "abada-cli"})
KEDA_OPERATOR = Endpoint("the KEDA operator", "10.244.7.7", "keda", {"app": "keda-operator"})
PROMETHEUS = Endpoint("Prometheus", "10.244.6.6", "monitoring", {"app": "prometheus"})


def vault_of(value_set: str) -> Endpoint:
    return VAULT.get(value_set, VAULT["default"])


def postgresql_of(value_set: str) -> Endpoint:
    return POSTGRESQL.get(value_set, POSTGRESQL["default"])


def test_every_pod_is_isolated_both_ways(release: Release) -> None:
    policies = release.of_kind("NetworkPolicy")
    for pod in each(release_pods(release).values(), "pod"):
        for direction in ("Ingress", "Egress"):
            assert any(
                direction in policy_types(p) and selector_matches(p["spec"]["podSelector"], pod.labels or {})
                for p in policies
            ), f"{pod.description} is not isolated for {direction}"


def test_only_the_broker_reaches_vault(value_set: str) -> None:
    release = render_set(value_set)
    vault = vault_of(value_set)
    port = 8200
    reaching = {
        pod.description for pod in release_pods(release).values() if allowed(release, pod, vault, port)
    }
    assert reaching == {"abada-broker pod"}


def test_only_the_engine_and_its_migration_reach_postgresql(value_set: str) -> None:
    release = render_set(value_set)
    database = postgresql_of(value_set)
    reaching = {
        pod.description for pod in release_pods(release).values() if allowed(release, pod, database, 5432)
    }
    assert reaching == {"abada-engine pod", "abada-migrate pod"}


def test_workers_reach_engine_broker_tool_servers_model_and_dns() -> None:
    release = render_set("keda-on.yaml")
    engine, broker = one_pod(release, "engine"), one_pod(release, "broker")
    for worker in each(pods_of(release, "worker"), "worker pod"):
        assert allowed(release, worker, engine, 50051)
        assert allowed(release, worker, broker, 50061)
        assert allowed(release, worker, CRM_TOOL_SERVER, 8000)
        assert allowed(release, worker, Endpoint("tool server by address", "10.40.3.3"), 443)
        assert allowed(release, worker, GEMINI, 443)
        assert allowed(release, worker, KUBE_DNS, 53, "UDP")
        # ... and nothing else: not the stats port, not other ports of the tool servers, not the database.
        assert not allowed(release, worker, engine, 8080)
        assert not allowed(release, worker, CRM_TOOL_SERVER, 22)
        assert not allowed(release, worker, Endpoint("a private address", "10.99.0.1"), 443)
        assert not allowed(release, worker, OTHER_APP, 80)


def test_engine_is_reached_by_workers_broker_and_operators_only() -> None:
    release = render_set("keda-on.yaml")
    engine = one_pod(release, "engine")
    callers = {
        pod.description
        for pod in [*release_pods(release).values(), OPERATOR, OTHER_APP, KEDA_OPERATOR]
        if allowed(release, pod, engine, 50051)
    }
    assert callers == {
        "abada-worker-abada-agent pod",
        "abada-worker-billing pod",
        "abada-broker pod",
        OPERATOR.description,
    }


def test_keda_reaches_the_stats_port_only_when_it_polls_it() -> None:
    metrics_api, prometheus = render_set("keda-on.yaml"), render_set("prometheus-trigger.yaml")
    assert allowed(metrics_api, KEDA_OPERATOR, one_pod(metrics_api, "engine"), 8080)
    assert not allowed(metrics_api, KEDA_OPERATOR, one_pod(metrics_api, "engine"), 50051)
    assert not allowed(prometheus, KEDA_OPERATOR, one_pod(prometheus, "engine"), 8080)
    # With the prometheus trigger it is Prometheus that reads /metrics.
    assert allowed(prometheus, PROMETHEUS, one_pod(prometheus, "engine"), 8080)
    assert not allowed(metrics_api, PROMETHEUS, one_pod(metrics_api, "engine"), 8080)


INGRESS_CONTROLLER = Endpoint(
    "the ingress controller", "10.244.5.5", "ingress-nginx", {"app": "ingress-nginx"}
)


def test_the_console_is_opened_through_the_ingress_controller_only_when_let_in() -> None:
    peers = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}}]
    shut, opened = render({}), render({"engine": {"console": {"ingressFrom": peers}}})
    assert not allowed(shut, INGRESS_CONTROLLER, one_pod(shut, "engine"), 8080)
    assert allowed(opened, INGRESS_CONTROLLER, one_pod(opened, "engine"), 8080)
    # The HTTP port only: the gRPC port stays for workers, the broker and operators.
    assert not allowed(opened, INGRESS_CONTROLLER, one_pod(opened, "engine"), 50051)
    assert not allowed(opened, OTHER_APP, one_pod(opened, "engine"), 8080)


def test_broker_is_reached_by_workers_and_the_engine_only(value_set: str) -> None:
    release = render_set(value_set)
    broker = one_pod(release, "broker")
    callers = {
        pod.description
        for pod in [*release_pods(release).values(), OPERATOR, OTHER_APP]
        if allowed(release, pod, broker, 50061)
    }
    worker_pods = {pod.description for pod in pods_of(release, "worker")}
    assert callers == {"abada-engine pod", *worker_pods}


def test_the_broker_and_engine_egress_only_where_they_must(value_set: str) -> None:
    release = render_set(value_set)
    engine, broker = one_pod(release, "engine"), one_pod(release, "broker")
    assert allowed(release, broker, engine, 50051)  # VerifyLease
    assert allowed(release, engine, broker, 50061)  # a tool credential at deploy time
    assert not allowed(release, engine, broker, 8080)
    assert not allowed(release, broker, GEMINI, 443)
    assert not allowed(release, engine, GEMINI, 443)
    assert not allowed(release, broker, postgresql_of(value_set), 5432)
    assert not allowed(release, engine, vault_of(value_set), 8200)


def test_the_engine_checks_tool_servers_at_deploy_time() -> None:
    release = render_set("keda-on.yaml")
    assert allowed(release, one_pod(release, "engine"), CRM_TOOL_SERVER, 8000)


def test_nothing_is_isolated_when_policies_are_off() -> None:
    release = render({"networkPolicy": {"enabled": False}})
    assert release.of_kind("NetworkPolicy") == []


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_the_evaluator_sees_a_denial(value_set: str) -> None:
    # If the evaluator allowed everything the tests above would pass for nothing.
    release = render_set(value_set)
    assert not allowed(release, OTHER_APP, one_pod(release, "engine"), 50051)
    assert allowed(
        render({"networkPolicy": {"enabled": False}}), OTHER_APP, one_pod(release, "engine"), 50051
    )

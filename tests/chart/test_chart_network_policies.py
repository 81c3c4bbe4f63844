"""Who may talk to whom, judged the way Kubernetes judges NetworkPolicies.

A small evaluator applies the rendered policies: a pod selected by no policy of a direction is open in
that direction; a selected one allows only what some rule lists (peers and ports), and in-cluster
traffic needs both the sender's egress and the receiver's ingress.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any

import pytest
from chart_support import NAMESPACE, VALUE_SETS, Manifest, Release, render, render_set

NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


@dataclass(frozen=True)
class Endpoint:
    """A pod (labels set) or an address outside the cluster (labels None)."""

    description: str
    ip: str
    namespace: str = ""
    labels: dict[str, str] | None = None
    namespace_labels: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.namespace:
            self.namespace_labels.setdefault(NAMESPACE_NAME_LABEL, self.namespace)


def selector_matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        present = key in labels
        if operator == "In" and not (present and labels[key] in values):
            return False
        if operator == "NotIn" and present and labels[key] in values:
            return False
        if operator == "Exists" and not present:
            return False
        if operator == "DoesNotExist" and present:
            return False
    return True


def peer_matches(peer: dict[str, Any], endpoint: Endpoint, policy_namespace: str) -> bool:
    if "ipBlock" in peer:
        address = ipaddress.ip_address(endpoint.ip)
        block = peer["ipBlock"]
        if address not in ipaddress.ip_network(block["cidr"]):
            return False
        return not any(address in ipaddress.ip_network(cidr) for cidr in block.get("except", []))
    if endpoint.labels is None:
        return False
    if "namespaceSelector" in peer:
        if not selector_matches(peer["namespaceSelector"], endpoint.namespace_labels):
            return False
    elif endpoint.namespace != policy_namespace:
        return False
    return "podSelector" not in peer or selector_matches(peer["podSelector"], endpoint.labels)


def port_matches(ports: list[dict[str, Any]] | None, port: int, protocol: str) -> bool:
    if not ports:
        return True
    for entry in ports:
        assert not isinstance(entry.get("port"), str), "named ports are not judged by this evaluator"
        if entry.get("protocol", "TCP") != protocol:
            continue
        low = entry.get("port")
        if low is None or low == port or (entry.get("endPort") and low <= port <= entry["endPort"]):
            return True
    return False


def policy_types(policy: Manifest) -> list[str]:
    spec = policy["spec"]
    return list(spec.get("policyTypes") or (["Ingress"] + (["Egress"] if "egress" in spec else [])))


def direction_allows(
    policies: list[Manifest], direction: str, subject: Endpoint, other: Endpoint, port: int, protocol: str
) -> bool:
    selecting = [
        p
        for p in policies
        if p["metadata"]["namespace"] == subject.namespace
        and direction in policy_types(p)
        and selector_matches(p["spec"]["podSelector"], subject.labels or {})
    ]
    if not selecting:
        return True
    rules_key, peers_key = ("egress", "to") if direction == "Egress" else ("ingress", "from")
    return any(
        (
            not rule.get(peers_key)
            or any(peer_matches(peer, other, p["metadata"]["namespace"]) for peer in rule[peers_key])
        )
        and port_matches(rule.get("ports"), port, protocol)
        for p in selecting
        for rule in p["spec"].get(rules_key) or []
    )


def allowed(
    release: Release, source: Endpoint, destination: Endpoint, port: int, protocol: str = "TCP"
) -> bool:
    policies = release.of_kind("NetworkPolicy")
    if source.labels is not None and not direction_allows(
        policies, "Egress", source, destination, port, protocol
    ):
        return False
    if destination.labels is not None:
        return direction_allows(policies, "Ingress", destination, source, port, protocol)
    return True


def release_pods(release: Release) -> dict[str, Endpoint]:
    """One pod per workload, by component (worker pools share the component "worker")."""
    pods: dict[str, Endpoint] = {}
    for index, workload in enumerate(release.workloads()):
        labels = dict(workload["spec"]["template"]["metadata"]["labels"])
        name = workload["metadata"]["name"]
        pods[name] = Endpoint(f"{name} pod", f"10.244.0.{index + 10}", NAMESPACE, labels)
    return pods


def pods_of(release: Release, component: str) -> list[Endpoint]:
    return [
        pod
        for pod in release_pods(release).values()
        if (pod.labels or {})["app.kubernetes.io/component"] == component
    ]


def one_pod(release: Release, component: str) -> Endpoint:
    (pod,) = pods_of(release, component)
    return pod


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
    for pod in release_pods(release).values():
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
    for worker in pods_of(release, "worker"):
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

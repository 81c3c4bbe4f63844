"""Judging rendered NetworkPolicies the way Kubernetes does; shared by the chart tests.

A pod selected by no policy of a direction is open in that direction; a selected one allows only what
some rule lists (peers and ports), and in-cluster traffic needs both the sender's egress and the
receiver's ingress.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any

from chart_support import NAMESPACE, Manifest, Release

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

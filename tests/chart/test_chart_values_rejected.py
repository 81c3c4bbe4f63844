"""Bad values stop the install with a message naming what to fix.

Types, enums and ranges live in values.schema.json (Helm checks it before rendering, and lint too);
rules that span several keys live in templates/validations.yaml.
"""

from __future__ import annotations

from typing import Any

import pytest
from chart_support import render, render_set
from helm_python import HelmRenderError, HelmValuesError


def pool(**overrides: Any) -> dict[str, Any]:
    return {"topic": "abada:agent", **overrides}


SCHEMA_REJECTS: dict[str, tuple[dict[str, Any], str]] = {
    "unknown vault auth method": ({"vault": {"auth": {"method": "ldap"}}}, "/vault/auth/method"),
    "empty topic": ({"workers": [pool(topic="")]}, "/workers/0/topic"),
    "topic with a slash": ({"workers": [pool(topic="abada/agent")]}, "/workers/0/topic"),
    "missing topic": ({"workers": [{"name": "agent"}]}, "/workers/0"),
    "zero concurrency": ({"workers": [pool(concurrency=0)]}, "/workers/0/concurrency"),
    "concurrency as text": ({"workers": [pool(concurrency="four")]}, "/workers/0/concurrency"),
    "pool name not a DNS label": ({"workers": [pool(name="Agent_1")]}, "/workers/0/name"),
    "typo in a pool key": ({"workers": [pool(concurency=4)]}, "concurency"),
    "typo at the top level": ({"replicaCont": 3}, "replicaCont"),
    "no engine replicas": ({"engine": {"replicaCount": 0}}, "/engine/replicaCount"),
    "unknown KEDA trigger": ({"autoscaling": {"keda": {"trigger": "cpu"}}}, "/autoscaling/keda/trigger"),
    "database Secret unnamed": ({"postgresql": {"existingSecret": ""}}, "/postgresql/existingSecret"),
    "unknown log level": ({"logLevel": "verbose"}, "/logLevel"),
    "path template without the credential": (
        {"vault": {"pathTemplate": "abada/tool-credentials"}},
        "/vault/pathTemplate",
    ),
    "port out of range": ({"engine": {"grpcPort": 70000}}, "/engine/grpcPort"),
    "HPA policy of unknown type": (
        {
            "autoscaling": {
                "keda": {
                    "behavior": {
                        "scaleDown": {"policies": [{"type": "Nodes", "value": 1, "periodSeconds": 60}]}
                    }
                }
            }
        },
        "/autoscaling/keda/behavior/scaleDown/policies/0/type",
    ),
    "worker identity with a slash": ({"workers": [pool(identity="agents/eu")]}, "/workers/0/identity"),
    "empty worker identity": ({"workerDefaults": {"identity": ""}}, "/workerDefaults/identity"),
    "lease shorter than the worker accepts": ({"workers": [pool(leaseSeconds=0)]}, "/workers/0/leaseSeconds"),
    "model endpoint without a scheme": (
        {"workers": [pool(model={"baseUrl": "model-gateway:8080"})]},
        "/workers/0/model/baseUrl",
    ),
    "secret cache longer than the broker allows": (
        {"broker": {"secretCacheSeconds": 60}},
        "/broker/secretCacheSeconds",
    ),
    "egress rule with a misspelt peer": (
        {"toolServers": {"egress": [{"to": [{"ipblock": {"cidr": "10.0.0.0/8"}}]}]}},
        "ipblock",
    ),
}


@pytest.mark.parametrize("case", SCHEMA_REJECTS, ids=str)
def test_schema_rejects(case: str) -> None:
    values, where = SCHEMA_REJECTS[case]
    with pytest.raises(HelmValuesError) as raised:
        render(values)
    assert where in str(raised.value)


VALIDATION_REJECTS: dict[str, tuple[dict[str, Any], str]] = {
    "min above max": (
        {"workers": [pool(minReplicas=5, maxReplicas=2)]},
        "minReplicas (5) is greater than maxReplicas (2)",
    ),
    "grace period not longer than the drain": (
        {"workers": [pool(drainSeconds=60, terminationGracePeriodSeconds=60)]},
        "terminationGracePeriodSeconds (60) must be greater than drainSeconds (60)",
    ),
    "KEDA and the HPA together": (
        {"autoscaling": {"keda": {"enabled": True}, "hpa": {"enabled": True}}},
        "two autoscalers would fight",
    ),
    "prometheus trigger without a server": (
        {"autoscaling": {"keda": {"trigger": "prometheus"}}},
        "autoscaling.keda.prometheus.serverAddress is empty",
    ),
    "mTLS without the engine's certificate": (
        {
            "tls": {
                "enabled": True,
                "certManager": {"enabled": False},
                "clients": {"broker": {"existingSecret": "b"}, "worker": {"existingSecret": "w"}},
            }
        },
        "tls.existingSecret is empty",
    ),
    "mTLS without a worker certificate": (
        {
            "tls": {
                "enabled": True,
                "certManager": {"enabled": False},
                "existingSecret": "e",
                "clients": {"broker": {"existingSecret": "b"}},
            }
        },
        "tls.clients.worker.existingSecret is empty",
    ),
    "TLS without the broker's certificate": (
        {
            "tls": {
                "enabled": True,
                "certManager": {"enabled": False},
                "existingSecret": "e",
                "clients": {"broker": {"existingSecret": "b"}, "worker": {"existingSecret": "w"}},
            }
        },
        "tls.broker.existingSecret is empty",
    ),
    "broker mTLS without the engine's client certificate": (
        {
            "tls": {
                "enabled": True,
                "certManager": {"enabled": False},
                "existingSecret": "e",
                "clients": {"broker": {"existingSecret": "b"}, "worker": {"existingSecret": "w"}},
                "broker": {"existingSecret": "t", "requireClientCertificates": True},
            }
        },
        "tls.clients.engine.existingSecret is empty",
    ),
    "TLS off without saying plaintext is accepted": (
        {"tls": {"enabled": False}},
        "tls.enabled is false: bearer tokens, lease tokens, journal payloads and tool secrets would cross",
    ),
    "Vault token auth without a token": ({"vault": {"auth": {"method": "token"}}}, "vault.auth.tokenSecret"),
    "Vault Kubernetes auth without a role": ({"vault": {"auth": {"role": ""}}}, "vault.auth.role is empty"),
    "broker on the default ServiceAccount": (
        {"broker": {"serviceAccount": {"create": False}}},
        "default ServiceAccount",
    ),
    "NetworkPolicy without Vault's peers": (
        {"vault": {"networkPolicy": {"to": []}}},
        "vault.networkPolicy.to",
    ),
    "NetworkPolicy without PostgreSQL's peers": (
        {"postgresql": {"networkPolicy": {"to": []}}},
        "postgresql.networkPolicy.to",
    ),
    "two pools with one name": (
        {"workers": [pool(name="agent"), pool(name="agent", topic="other")]},
        'resource name "abada-worker-agent"',
    ),
    "two pools on one topic": (
        {"workers": [pool(name="a"), pool(name="b")]},
        "another pool already serves this topic",
    ),
    "HPA down to zero": (
        {
            "autoscaling": {"keda": {"enabled": False}, "hpa": {"enabled": True}},
            "workers": [pool(minReplicas=0)],
        },
        "cannot scale to zero",
    ),
    "HPA without a CPU request": (
        {
            "autoscaling": {"keda": {"enabled": False}, "hpa": {"enabled": True}},
            "workers": [pool(resources={"requests": {"memory": "256Mi"}})],
        },
        "resources.requests.cpu",
    ),
    "fixed replicas outside min..max": (
        {"autoscaling": {"keda": {"enabled": False}}, "workers": [pool(replicas=12, maxReplicas=10)]},
        "replicas (12) is outside",
    ),
    "budget with both bounds": (
        {"engine": {"podDisruptionBudget": {"enabled": True, "minAvailable": 1, "maxUnavailable": 1}}},
        "engine.podDisruptionBudget sets both",
    ),
}


@pytest.mark.parametrize("case", VALIDATION_REJECTS, ids=str)
def test_validation_rejects(case: str) -> None:
    values, message = VALIDATION_REJECTS[case]
    with pytest.raises(HelmRenderError) as raised:
        render(values)
    assert message in str(raised.value)
    assert "validations.yaml" in str(raised.value)


def test_a_pool_names_the_topic_in_its_error() -> None:
    with pytest.raises(HelmRenderError) as raised:
        render({"workers": [pool(), pool(topic="billing:reconcile", minReplicas=3, maxReplicas=1)]})
    assert 'workers[1] (topic "billing:reconcile")' in str(raised.value)


ACCEPTED: dict[str, dict[str, Any]] = {
    "KEDA scales a pool to zero": {"workers": [pool(minReplicas=0)]},
    "a budget switched to minAvailable": {"engine": {"podDisruptionBudget": {"minAvailable": 1}}},
    "no worker pools": {"workers": []},
    "NetworkPolicies off, peers empty": {
        "networkPolicy": {"enabled": False},
        "vault": {"networkPolicy": {"to": []}},
    },
}


@pytest.mark.parametrize("case", ACCEPTED, ids=str)
def test_accepts(case: str) -> None:
    assert render(ACCEPTED[case]).manifests


def test_plaintext_on_purpose_renders_with_a_loud_warning() -> None:
    release = render_set("plaintext.yaml")
    assert "WARNING: TLS IS OFF" in release.notes
    assert release.of_kind("Certificate") == []
    assert "TLS IS OFF" not in render_set("default").notes

"""Every manifest the chart renders is one Kubernetes (or KEDA) would accept.

Built-in kinds are checked with kubernetes-validate's strict schemas (unknown fields are errors) at
the oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and the newest the package knows.
KEDA's CRDs are not in those schemas, so the fields KEDA documents for ScaledObject (keda.sh
reference/scaledobject-spec), the metrics-api and prometheus scalers and TriggerAuthentication are
written out below; the HPA behavior a ScaledObject carries is checked as the HPA KEDA creates.
cert-manager's Issuer and Certificate (cert-manager.io/v1) are written out the same way. The
Prometheus Operator's ServiceMonitor is checked against servicemonitor.schema.json, written from its
CRD's openAPIV3Schema (the file names the source).
"""

from __future__ import annotations

import copy
import json
import pathlib
import re
from collections.abc import Callable

import jsonschema
import kubernetes_validate
import pytest
from chart_support import Manifest, Release, each, env_of, only_container, pod_spec, render, render_set

KUBERNETES_VERSIONS = ("1.27", "1.37")
SERVICE_MONITOR = json.loads((pathlib.Path(__file__).parent / "servicemonitor.schema.json").read_text())
KEDA_KINDS = {"ScaledObject", "TriggerAuthentication"}
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")

STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
KEDA_METADATA = {
    "type": "object",
    "required": ["name"],
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "maxLength": 253},
        "namespace": {"type": "string"},
        "labels": STRING_MAP,
        "annotations": STRING_MAP,
    },
}

SCALED_OBJECT = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": KEDA_METADATA,
        "spec": {
            "type": "object",
            "required": ["scaleTargetRef", "triggers"],
            "additionalProperties": False,
            "properties": {
                "scaleTargetRef": {
                    "type": "object",
                    "required": ["name"],
                    "additionalProperties": False,
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "name": {"type": "string", "minLength": 1},
                        "envSourceContainerName": {"type": "string"},
                    },
                },
                "pollingInterval": {"type": "integer", "minimum": 1},
                "cooldownPeriod": {"type": "integer", "minimum": 0},
                "initialCooldownPeriod": {"type": "integer", "minimum": 0},
                "idleReplicaCount": {"type": "integer", "minimum": 0},
                "minReplicaCount": {"type": "integer", "minimum": 0},
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "fallback": {
                    "type": "object",
                    "required": ["failureThreshold", "replicas"],
                    "additionalProperties": False,
                    "properties": {
                        "failureThreshold": {"type": "integer"},
                        "replicas": {"type": "integer"},
                        "behavior": {"type": "string"},
                    },
                },
                "advanced": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "restoreToOriginalReplicaCount": {"type": "boolean"},
                        "horizontalPodAutoscalerConfig": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {"name": {"type": "string"}, "behavior": {"type": "object"}},
                        },
                        "scalingModifiers": {"type": "object"},
                    },
                },
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["type", "metadata"],
                        "additionalProperties": False,
                        "properties": {
                            "type": {"type": "string"},
                            "name": {"type": "string"},
                            "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                            "useCachedMetrics": {"type": "boolean"},
                            # KEDA's trigger metadata is map[string]string: a bare number is refused.
                            "metadata": STRING_MAP,
                            "authenticationRef": {
                                "type": "object",
                                "required": ["name"],
                                "additionalProperties": False,
                                "properties": {
                                    "name": {"type": "string", "minLength": 1},
                                    "kind": {
                                        "enum": ["TriggerAuthentication", "ClusterTriggerAuthentication"]
                                    },
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}

# The parameters each scaler documents (keda.sh/docs scalers/metrics-api, scalers/prometheus).
TRIGGER_METADATA: dict[str, tuple[set[str], set[str]]] = {
    "metrics-api": (
        {"url", "valueLocation", "targetValue"},
        {
            "format",
            "activationTargetValue",
            "unsafeSsl",
            "aggregateFromKubeServiceEndpoints",
            "aggregationType",
            "authMode",
            "method",
            "keyParamName",
        },
    ),
    "prometheus": (
        {"serverAddress", "query", "threshold"},
        {
            "activationThreshold",
            "namespace",
            "customHeaders",
            "ignoreNullValues",
            "queryParameters",
            "unsafeSsl",
            "authModes",
        },
    ),
}

TRIGGER_AUTHENTICATION = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "TriggerAuthentication"},
        "metadata": KEDA_METADATA,
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "minProperties": 1,
            "properties": {
                "secretTargetRef": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["parameter", "name", "key"],
                        "additionalProperties": False,
                        "properties": {
                            "parameter": {"type": "string", "minLength": 1},
                            "name": {"type": "string", "minLength": 1},
                            "key": {"type": "string", "minLength": 1},
                        },
                    },
                },
                "env": {"type": "array"},
                "hashiCorpVault": {"type": "object"},
                "podIdentity": {"type": "object"},
            },
        },
    },
}


def check_scaled_object(scaled_object: Manifest) -> None:
    jsonschema.validate(scaled_object, SCALED_OBJECT)
    for trigger in each(scaled_object["spec"]["triggers"], "trigger"):
        assert trigger["type"] in TRIGGER_METADATA, f"unexpected trigger type {trigger['type']}"
        required, optional = TRIGGER_METADATA[trigger["type"]]
        keys = set(trigger["metadata"])
        assert required <= keys, f"{trigger['type']} trigger misses {required - keys}"
        assert keys <= required | optional, (
            f"{trigger['type']} trigger has unknown {keys - required - optional}"
        )
    spec = scaled_object["spec"]
    behavior = spec.get("advanced", {}).get("horizontalPodAutoscalerConfig", {}).get("behavior")
    if behavior is not None:
        # KEDA copies this block into the autoscaling/v2 HPA it owns; check it as that HPA.
        hpa = {
            "apiVersion": "autoscaling/v2",
            "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": f"keda-hpa-{scaled_object['metadata']['name']}"},
            "spec": {
                "scaleTargetRef": {
                    "apiVersion": "apps/v1",
                    "kind": "Deployment",
                    "name": spec["scaleTargetRef"]["name"],
                },
                "minReplicas": max(1, spec.get("minReplicaCount", 1)),
                "maxReplicas": spec.get("maxReplicaCount", 100),
                "metrics": [
                    {
                        "type": "External",
                        "external": {
                            "metric": {"name": "s0-metric"},
                            "target": {"type": "AverageValue", "averageValue": "1"},
                        },
                    }
                ],
                "behavior": behavior,
            },
        }
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate(hpa, version, strict=True)


ISSUER_REF = {
    "type": "object",
    "required": ["name", "kind"],
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "minLength": 1},
        "kind": {"enum": ["Issuer", "ClusterIssuer"]},
        "group": {"const": "cert-manager.io"},
    },
}
CERT_MANAGER_METADATA = {
    "type": "object",
    "required": ["name", "namespace"],
    "properties": {"name": {"type": "string"}, "namespace": {"type": "string"}, "labels": STRING_MAP},
}
ISSUER = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "cert-manager.io/v1"},
        "kind": {"const": "Issuer"},
        "metadata": CERT_MANAGER_METADATA,
        "spec": {
            "type": "object",
            "minProperties": 1,
            "maxProperties": 1,
            "additionalProperties": False,
            "properties": {
                "selfSigned": {"type": "object"},
                "ca": {
                    "type": "object",
                    "required": ["secretName"],
                    "additionalProperties": False,
                    "properties": {"secretName": {"type": "string", "minLength": 1}},
                },
            },
        },
    },
}
_USAGES = ["digital signature", "key encipherment", "server auth", "client auth", "cert sign"]
CERTIFICATE = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "cert-manager.io/v1"},
        "kind": {"const": "Certificate"},
        "metadata": CERT_MANAGER_METADATA,
        "spec": {
            "type": "object",
            "required": ["secretName", "issuerRef"],
            "additionalProperties": False,
            "properties": {
                "secretName": {"type": "string", "minLength": 1},
                "commonName": {"type": "string", "minLength": 1, "maxLength": 64},
                "dnsNames": {"type": "array", "items": {"type": "string"}, "minItems": 1},
                "isCA": {"type": "boolean"},
                "usages": {"type": "array", "items": {"enum": _USAGES}},
                "duration": {"type": "string", "pattern": "^[0-9]+(h|m|s)$"},
                "renewBefore": {"type": "string", "pattern": "^[0-9]+(h|m|s)$"},
                "privateKey": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "algorithm": {"enum": ["RSA", "ECDSA", "Ed25519"]},
                        "size": {"type": "integer"},
                        "rotationPolicy": {"enum": ["Never", "Always"]},
                    },
                },
                "issuerRef": ISSUER_REF,
            },
        },
    },
}


def check(manifest: Manifest) -> None:
    name = manifest["metadata"]["name"]
    assert DNS_SUBDOMAIN.match(name) and len(name) <= 63, (
        f"{manifest['kind']} name {name!r} is not a DNS label"
    )
    if manifest["kind"] == "ScaledObject":
        check_scaled_object(manifest)
    elif manifest["kind"] == "TriggerAuthentication":
        jsonschema.validate(manifest, TRIGGER_AUTHENTICATION)
    elif manifest["kind"] == "Issuer":
        jsonschema.validate(manifest, ISSUER)
    elif manifest["kind"] == "Certificate":
        jsonschema.validate(manifest, CERTIFICATE)
    elif manifest["kind"] == "ServiceMonitor":
        jsonschema.validate(manifest, SERVICE_MONITOR)
    else:
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate(manifest, version, strict=True)


def test_every_manifest_is_valid(release: Release) -> None:
    assert release.manifests
    for manifest in each(release.manifests, "manifest"):
        check(manifest)


def test_every_manifest_lands_in_the_release_namespace(release: Release) -> None:
    assert {m["metadata"].get("namespace") for m in release.manifests} == {"abada"}


def test_no_two_manifests_share_kind_and_name(release: Release) -> None:
    keys = [(m["kind"], m["metadata"]["name"]) for m in release.manifests]
    assert len(keys) == len(set(keys))


@pytest.mark.parametrize(
    ("broken", "why"),
    [
        (lambda so: so["spec"]["triggers"][0]["metadata"].update(targetValue=4), "a number in metadata"),
        (lambda so: so["spec"]["triggers"][0]["metadata"].pop("valueLocation"), "no valueLocation"),
        (lambda so: so["spec"].update(minReplicas=1), "an HPA field name"),
        (
            lambda so: so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"][
                "scaleDown"
            ].update(policies=[{"type": "Percent", "value": 50}]),
            "a policy without periodSeconds",
        ),
    ],
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_the_keda_check_catches_mistakes(broken: Callable[[Manifest], object], why: str) -> None:
    # The hand-written KEDA check must refuse what KEDA would refuse, or passing it means nothing.
    scaled_object = copy.deepcopy(render_set("default").of_kind("ScaledObject")[0])
    broken(scaled_object)
    with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError, AssertionError)):
        check_scaled_object(scaled_object)


def test_tls_is_on_by_default_with_certificates_for_every_party() -> None:
    """Review finding: the chart shipped with TLS off, so tokens and tool secrets crossed the pod network
    in clear. By default cert-manager now issues every certificate, from a CA the chart makes."""
    release = render_set("default")
    certificates = {c["metadata"]["name"]: c["spec"] for c in release.of_kind("Certificate")}
    assert set(certificates) == {
        "abada-ca",
        "abada-engine-tls",
        "abada-broker-tls",
        "abada-broker-client-tls",
        "abada-worker-client-tls",
    }
    assert certificates["abada-ca"]["isCA"] is True
    assert "abada-engine" in certificates["abada-engine-tls"]["dnsNames"]
    assert "abada-broker" in certificates["abada-broker-tls"]["dnsNames"]
    assert certificates["abada-worker-client-tls"]["usages"][-1] == "client auth"
    for name, spec in certificates.items():
        if name != "abada-ca":
            assert spec["issuerRef"] == {"name": "abada-ca", "kind": "Issuer", "group": "cert-manager.io"}
    engine = only_container(release.deployment_of("engine"))
    assert {"ABADA_TLS_CERT_FILE", "ABADA_TLS_KEY_FILE", "ABADA_TLS_CLIENT_CA_FILE"} <= set(env_of(engine))
    volumes = {v["name"]: v for v in pod_spec(release.deployment_of("engine"))["volumes"] if "secret" in v}
    assert "abada-engine-tls" in {v["secret"]["secretName"] for v in volumes.values()}


def test_a_named_issuer_signs_every_certificate_and_the_chart_makes_no_ca() -> None:
    release = render({"tls": {"certManager": {"issuerRef": {"name": "corp-ca", "kind": "ClusterIssuer"}}}})
    assert release.of_kind("Issuer") == []
    refs = [c["spec"]["issuerRef"] for c in release.of_kind("Certificate")]
    assert len(refs) == 4
    assert all(r == {"name": "corp-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"} for r in refs)


def test_user_supplied_secrets_get_no_certificates() -> None:
    values = {
        "tls": {
            "certManager": {"enabled": False},
            "existingSecret": "e",
            "clients": {"broker": {"existingSecret": "b"}, "worker": {"existingSecret": "w"}},
            "broker": {"existingSecret": "t"},
        }
    }
    release = render(values)
    assert release.of_kind("Certificate") == [] and release.of_kind("Issuer") == []
    assert "e" in {
        v["secret"]["secretName"]
        for v in pod_spec(release.deployment_of("engine"))["volumes"]
        if "secret" in v
    }

"""The chart's pods as the services read them: their own settings code, and the addresses they dial.

Each container's env is resolved the way the kubelet resolves it (downward API, Secret references,
`$(VAR)` expansion) and handed to the service's own parser, so a variable the chart names wrongly or a
value the service refuses fails here, not in a cluster. Every address a pod dials is then followed to
a Service, a serving container port and the NetworkPolicies that must let the call through.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from abada_broker.auth import Caller as BrokerCaller
from abada_broker.config import BrokerSettings
from abada_broker.errors import BrokerError
from abada_broker.origins import CredentialOrigins
from abada_broker.secret_store import SecretStoreConfigError, VaultSettings
from abada_engine.auth import Caller as EngineCaller
from abada_engine.config import EngineSettings
from abada_engine.definitions.tool_contracts import BrokerCredentials, credentials_from_env
from abada_worker.settings import load_settings
from chart_support import (
    NAMESPACE,
    Manifest,
    Release,
    ci_values,
    each,
    only_container,
    pod_spec,
    render,
    render_set,
    tls_on,
)
from network_policy_evaluator import allowed, release_pods
from test_chart_workloads import mounted_file

# What the kubelet substitutes: $(NAME) of a variable listed earlier; $$ is a literal dollar.
_REFERENCE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)|\$\$")
_FIELDS = {"metadata.namespace": NAMESPACE}


def pod_name_of(workload: Manifest) -> str:
    """A name a ReplicaSet could give one of the workload's pods."""
    return f"{workload['metadata']['name']}-5d8f7c9b4-x2x7q"


def kubelet_env(container: dict[str, Any], pod_name: str) -> dict[str, str]:
    """The environment the process sees; a Secret's value stands in as "secret:<name>/<key>"."""
    resolved: dict[str, str] = {}

    def expand(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return resolved.get(match.group(1), match.group(0))

    for entry in container.get("env", []):
        if "value" in entry:
            resolved[entry["name"]] = _REFERENCE.sub(expand, str(entry["value"]))
            continue
        source = entry["valueFrom"]
        if "fieldRef" in source:
            resolved[entry["name"]] = {**_FIELDS, "metadata.name": pod_name}[source["fieldRef"]["fieldPath"]]
        else:
            ref = source["secretKeyRef"]
            resolved[entry["name"]] = f"secret:{ref['name']}/{ref['key']}"
    return resolved


def workers(release: Release) -> list[Manifest]:
    return [d for d in release.of_kind("Deployment") if release.component(d) == "worker"]


def expected_identity(value_set: str, topic: str) -> str:
    """The identity the values give the pool of `topic`: its own, else workerDefaults' (agent-pool)."""
    values = ci_values(value_set)
    default = values.get("workerDefaults", {}).get("identity", "agent-pool")
    pools = values.get("workers", [{"topic": "abada:agent"}])
    (pool,) = [p for p in pools if p["topic"] == topic]
    return str(pool.get("identity", default))


def container_port(container: dict[str, Any], name: str) -> int:
    (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == name]
    return int(port)


def test_workers_read_their_pool_and_own_worker_ids(value_set: str, release: Release) -> None:
    assert workers(release)
    for deployment in each(workers(release), "worker Deployment"):
        container = only_container(deployment)
        pod_name = pod_name_of(deployment)
        settings = load_settings([], kubelet_env(container, pod_name))
        topic = deployment["metadata"]["annotations"]["abada.dev/topic"]
        identity = expected_identity(value_set, topic)
        assert settings.topic == topic
        assert settings.worker_id == f"{identity}/{pod_name}"
        # The pool's token is listed under its identity; both servers must accept this pod's id for it.
        assert EngineCaller(identity, frozenset({"worker"}), frozenset({topic})).may_act_as(
            settings.worker_id
        )
        assert BrokerCaller(identity, frozenset({"worker"})).may_act_as(settings.worker_id)
        assert settings.token_file is not None and settings.token is None
        # The kubelet probes the pod's IP on the port the worker listens on.
        host, _, port = settings.health_address.rpartition(":")
        assert host == "0.0.0.0"
        assert int(port) == container_port(container, "health")
        assert container["livenessProbe"]["httpGet"]["port"] == "health"
        assert settings.drain_seconds < pod_spec(deployment)["terminationGracePeriodSeconds"]
        tls_files = (settings.tls_ca_file, settings.tls_cert_file, settings.tls_key_file)
        if tls_on(value_set):
            assert None not in tls_files
        else:
            assert tls_files == (None, None, None)


def test_two_pods_of_a_pool_are_two_workers() -> None:
    # A lease belongs to one pod: pods of one pool must never share a worker id.
    deployment = workers(render_set("default"))[0]
    container = only_container(deployment)
    ids = {
        load_settings([], kubelet_env(container, f"abada-worker-abada-agent-5d8f7c9b4-{suffix}")).worker_id
        for suffix in ("x2x7q", "k9p2m")
    }
    assert len(ids) == 2


def test_a_pool_can_use_a_gemini_compatible_endpoint() -> None:
    release = render(
        {
            "workers": [
                {
                    "topic": "abada:agent",
                    "identity": "support-agents",
                    "leaseSeconds": 90,
                    "model": {
                        "baseUrl": "http://model-gateway.platform.svc:8080",
                        "apiKeySecret": {"name": ""},
                    },
                }
            ]
        }
    )
    (deployment,) = workers(release)
    pod_name = pod_name_of(deployment)
    settings = load_settings([], kubelet_env(only_container(deployment), pod_name))
    assert settings.gemini_base_url == "http://model-gateway.platform.svc:8080"
    assert settings.gemini_api_key is None
    assert settings.lease_ms == 90_000
    assert settings.worker_id == f"support-agents/{pod_name}"


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_a_pool_is_given_the_key_and_endpoint_of_its_provider(provider: str) -> None:
    release = render(
        {
            "workers": [
                {
                    "topic": "abada:agent",
                    "model": {
                        "provider": provider,
                        "baseUrl": "http://model-gateway.platform.svc:8080/v1",
                        "apiKeySecret": {"name": f"abada-{provider}", "key": "api-key"},
                    },
                }
            ]
        }
    )
    (deployment,) = workers(release)
    settings = load_settings([], kubelet_env(only_container(deployment), pod_name_of(deployment)))
    assert getattr(settings, f"{provider}_api_key") == f"secret:abada-{provider}/api-key"
    assert getattr(settings, f"{provider}_base_url") == "http://model-gateway.platform.svc:8080/v1"
    assert (settings.gemini_api_key, settings.gemini_base_url) == (None, None)


def test_the_broker_reads_its_settings(value_set: str, release: Release) -> None:
    broker = release.deployment_of("broker")
    settings = BrokerSettings.from_env(kubelet_env(only_container(broker), pod_name_of(broker)))
    assert settings.auth_tokens_file is not None and not settings.insecure_dev
    assert settings.engine_token_file is not None
    # Without the origins file the broker would give credentials to loopback servers only.
    mounted_file(broker, only_container(broker), str(settings.credential_origins_file))
    # mTLS on the engine: the broker must dial it with its client certificate, or VerifyLease fails.
    assert settings.engine_tls_enabled is tls_on(value_set)
    if settings.engine_tls_enabled:
        assert None not in (
            settings.engine_tls_ca_file,
            settings.engine_tls_cert_file,
            settings.engine_tls_key_file,
        )
    vault = VaultSettings.from_env(settings.store_environ)
    assert vault.auth_method == ("token" if value_set == "mtls-on.yaml" else "kubernetes")


def test_the_broker_accepts_every_cache_time_the_schema_allows() -> None:
    broker = render({"broker": {"secretCacheSeconds": 30}}).deployment_of("broker")
    settings = BrokerSettings.from_env(kubelet_env(only_container(broker), pod_name_of(broker)))
    assert VaultSettings.from_env(settings.store_environ).cache_seconds == 30
    # ... and the check above is able to fail: one more second and the broker would not start.
    with pytest.raises(SecretStoreConfigError):
        VaultSettings.from_env({**settings.store_environ, "ABADA_SECRET_CACHE_SECONDS": "31"})


def test_the_broker_signs_in_with_the_projected_token_it_is_given() -> None:
    broker = render({"vault": {"auth": {"audience": "vault"}}}).deployment_of("broker")
    settings = BrokerSettings.from_env(kubelet_env(only_container(broker), pod_name_of(broker)))
    vault = VaultSettings.from_env(settings.store_environ)
    assert str(vault.kubernetes_jwt_file) == "/var/run/secrets/vault/token"


def test_the_engine_reads_its_settings(value_set: str, release: Release) -> None:
    engine = release.deployment_of("engine")
    container = only_container(engine)
    env = kubelet_env(container, pod_name_of(engine))
    settings = EngineSettings.from_env(env)
    assert settings.database_url == "secret:abada-database/url"
    assert int(settings.grpc_address.rpartition(":")[2]) == container_port(container, "grpc")
    assert int(settings.http_address.rpartition(":")[2]) == container_port(container, "http")
    # Unset or empty, each of these falls back to development values generated per process.
    for name in ("ABADA_AUTH_TOKENS_FILE", "ABADA_JOURNAL_KEYS", "ABADA_IDEMPOTENCY_SECRET"):
        assert env.get(name), name
    # Deploy-time tool credentials come through the broker, so only the broker touches Vault.
    assert isinstance(credentials_from_env(env), BrokerCredentials)
    assert env.get("ABADA_BROKER_TOKEN_FILE")
    tls = [env.get(f"ABADA_TLS_{part}_FILE") for part in ("CERT", "KEY", "CLIENT_CA")]
    # The engine refuses to start with only some of the three.
    assert all(tls) if tls_on(value_set) else not any(tls)


# (client component, variable naming the address it dials, server component)
DIALS = (
    ("engine", "ABADA_BROKER_ADDRESS", "broker"),
    ("broker", "ABADA_ENGINE_ADDRESS", "engine"),
    ("worker", "ABADA_ENGINE_ADDRESS", "engine"),
    ("worker", "ABADA_BROKER_ADDRESS", "broker"),
)


@pytest.mark.parametrize(("client", "variable", "server"), DIALS, ids=lambda v: str(v))
def test_every_address_a_pod_dials_reaches_a_serving_port(
    release: Release, client: str, variable: str, server: str
) -> None:
    pods = release_pods(release)
    server_deployment = release.deployment_of(server)
    server_pod = pods[server_deployment["metadata"]["name"]]
    clients = [w for w in release.workloads() if release.component(w) == client]
    assert clients
    for workload in each(clients, "client workload"):
        address = kubelet_env(only_container(workload), pod_name_of(workload))[variable]
        host, _, port = address.rpartition(":")
        service = release.get("Service", host)
        (service_port,) = [p for p in service["spec"]["ports"] if p["port"] == int(port)]
        selected = service["spec"]["selector"].items()
        assert selected <= server_deployment["spec"]["template"]["metadata"]["labels"].items()
        target = container_port(only_container(server_deployment), service_port["targetPort"])
        assert allowed(release, pods[workload["metadata"]["name"]], server_pod, target), (
            f"{workload['metadata']['name']} cannot reach {address}"
        )


def test_the_broker_accepts_the_credential_origins_the_chart_writes(tmp_path) -> None:
    release = render({"broker": {"credentialOrigins": {"crm-token": ["https://crm.crm.svc:8443"]}}})
    (config,) = [c for c in release.of_kind("ConfigMap") if c["metadata"]["name"].endswith("-origins")]
    written = tmp_path / "origins.yaml"
    written.write_text(config["data"]["origins.yaml"])
    origins = CredentialOrigins(written)
    origins.check("crm-token", "https://crm.crm.svc:8443/mcp")
    with pytest.raises(BrokerError):
        origins.check("crm-token", "https://elsewhere.example/mcp")
    # The default writes an empty map: no credential leaves the broker until origins are listed.
    (empty,) = [c for c in render().of_kind("ConfigMap") if c["metadata"]["name"].endswith("-origins")]
    written.write_text(empty["data"]["origins.yaml"])
    with pytest.raises(BrokerError):
        CredentialOrigins(written).check("crm-token", "https://crm.crm.svc:8443/mcp")

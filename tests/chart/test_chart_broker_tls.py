"""With tls.enabled the broker's port speaks TLS (ci/mtls-on.yaml: mTLS), its clients dial it with the
broker's CA, and the kubelet probes a plaintext health-only port. Each pod is read back with the
component's own settings code, so a variable the process does not understand fails here."""

from __future__ import annotations

from abada_broker.config import BrokerSettings
from abada_engine.definitions.tool_contracts import BrokerCredentials, credentials_from_env
from abada_worker.settings import load_settings
from chart_support import env_of, only_container, render, render_set
from test_chart_service_contract import kubelet_env, pod_name_of, workers
from test_chart_workloads import mounted_file

BROKER_SECRET = "abada-broker-tls"


def test_the_broker_listens_with_mtls_and_is_probed_on_its_plaintext_health_port() -> None:
    broker = render_set("mtls-on.yaml").deployment_of("broker")
    container = only_container(broker)
    env = kubelet_env(container, pod_name_of(broker))
    settings = BrokerSettings.from_env(env)
    assert settings.tls_enabled and settings.client_certificates_required
    files = [
        mounted_file(broker, container, str(path))
        for path in (settings.tls_cert_file, settings.tls_key_file, settings.tls_client_ca_file)
    ]
    assert [(secret, item["key"]) for secret, item in files] == [
        (BROKER_SECRET, "tls.crt"),
        (BROKER_SECRET, "tls.key"),
        (BROKER_SECRET, "ca.crt"),
    ]
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert settings.health_address == f"0.0.0.0:{ports['health']}"
    assert ports["health"] != ports["grpc"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == ports["health"], probe


def test_workers_and_the_engine_trust_the_broker_ca_and_present_their_certificates() -> None:
    release = render_set("mtls-on.yaml")
    (worker,) = workers(release)
    container = only_container(worker)
    settings = load_settings([], kubelet_env(container, pod_name_of(worker)))
    assert settings.broker_tls_ca_file is not None
    assert mounted_file(worker, container, str(settings.broker_tls_ca_file))[0] == BROKER_SECRET
    for path in (settings.broker_tls_cert_file, settings.broker_tls_key_file):
        assert mounted_file(worker, container, str(path))[0] == "abada-worker-client-tls"

    engine = release.deployment_of("engine")
    engine_container = only_container(engine)
    env = kubelet_env(engine_container, pod_name_of(engine))
    assert isinstance(credentials_from_env(env), BrokerCredentials)
    assert mounted_file(engine, engine_container, env["ABADA_BROKER_TLS_CA_FILE"])[0] == BROKER_SECRET
    for name in ("ABADA_BROKER_TLS_CERT_FILE", "ABADA_BROKER_TLS_KEY_FILE"):
        assert mounted_file(engine, engine_container, env[name])[0] == "abada-engine-client-tls"


def test_only_the_broker_ca_of_the_broker_secret_reaches_other_pods() -> None:
    release = render_set("mtls-on.yaml")
    mounted = 0
    for workload in (release.deployment_of("engine"), *workers(release)):
        for volume in workload["spec"]["template"]["spec"]["volumes"]:
            if volume.get("secret", {}).get("secretName") == BROKER_SECRET:
                assert [item["key"] for item in volume["secret"]["items"]] == ["ca.crt"]
                mounted += 1
    assert mounted >= 2  # the engine and at least one worker pool mount the broker's CA


def test_tls_without_client_certificates_leaves_the_broker_port_tls_only() -> None:
    values = {
        "tls": {
            "enabled": True,
            "existingSecret": "e",
            "clients": {"broker": {"existingSecret": "b"}, "worker": {"existingSecret": "w"}},
            "broker": {"existingSecret": "broker-tls"},
        }
    }
    release = render(values)
    broker = release.deployment_of("broker")
    settings = BrokerSettings.from_env(kubelet_env(only_container(broker), pod_name_of(broker)))
    assert settings.tls_enabled and not settings.client_certificates_required
    (worker,) = workers(release)
    worker_settings = load_settings([], kubelet_env(only_container(worker), pod_name_of(worker)))
    assert worker_settings.broker_tls_ca_file is not None
    assert worker_settings.broker_tls_cert_file is None
    engine_env = env_of(only_container(release.deployment_of("engine")))
    assert "ABADA_BROKER_TLS_CA_FILE" in engine_env and "ABADA_BROKER_TLS_CERT_FILE" not in engine_env


def test_without_tls_the_broker_has_no_health_port() -> None:
    container = only_container(render_set("plaintext.yaml").deployment_of("broker"))
    assert [port["name"] for port in container["ports"]] == ["grpc", "metrics"]
    assert "ABADA_BROKER_HEALTH_ADDRESS" not in env_of(container)

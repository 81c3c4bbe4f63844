"""The pods the chart runs: their contract with the services, probes, security and lifecycle."""

from __future__ import annotations

import posixpath
import re
from typing import Any

from chart_support import (
    Manifest,
    Release,
    ci_values,
    each,
    env_of,
    iter_containers,
    only_container,
    pod_spec,
    render,
    render_set,
    tls_on,
)

ENGINE_ENV = {
    "ABADA_DATABASE_URL",
    "ABADA_DB_POOL_SIZE",
    "ABADA_JOURNAL_KEYS",
    "ABADA_IDEMPOTENCY_SECRET",
    "ABADA_AUTH_TOKENS_FILE",
    "ABADA_GRPC_ADDRESS",
    "ABADA_HTTP_ADDRESS",
    "ABADA_BROKER_ADDRESS",
    "ABADA_BROKER_TOKEN_FILE",
    "ABADA_LOG_LEVEL",
}
BROKER_ENV = {
    "ABADA_BROKER_GRPC_ADDRESS",
    "ABADA_ENGINE_ADDRESS",
    "ABADA_ENGINE_TOKEN_FILE",
    "ABADA_BROKER_AUTH_TOKENS_FILE",
    "ABADA_SECRET_BACKEND",
    "VAULT_ADDR",
    "ABADA_VAULT_AUTH",
    "ABADA_VAULT_KV_MOUNT",
    "ABADA_VAULT_PATH_TEMPLATE",
    "ABADA_SECRET_CACHE_SECONDS",
    "ABADA_LOG_LEVEL",
}
WORKER_ENV = {
    "ABADA_ENGINE_ADDRESS",
    "ABADA_BROKER_ADDRESS",
    "ABADA_WORKER_TOPIC",
    "ABADA_WORKER_CONCURRENCY",
    "ABADA_LEASE_MS",
    "ABADA_POD_NAME",
    "ABADA_WORKER_ID",
    "ABADA_WORKER_TOKEN_FILE",
    "ABADA_DRAIN_SECONDS",
    "ABADA_WORKER_HEALTH_ADDRESS",
    "ABADA_LOG_LEVEL",
}
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def value(env: dict[str, dict[str, Any]], name: str) -> str:
    return str(env[name]["value"])


def secret_key(env: dict[str, dict[str, Any]], name: str) -> tuple[str, str]:
    ref = env[name]["valueFrom"]["secretKeyRef"]
    return ref["name"], ref["key"]


def mounted_file(workload: Manifest, container: dict[str, Any], path: str) -> tuple[str, dict[str, Any]]:
    """The Secret and item that put a file at `path` (or "projected" and its token source); fails if
    nothing does."""
    volumes = {v["name"]: v for v in pod_spec(workload).get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        relative = posixpath.relpath(path, mount["mountPath"])
        if relative.startswith(".."):
            continue
        volume = volumes[mount["name"]]
        if "projected" in volume:
            tokens = [
                s["serviceAccountToken"] for s in volume["projected"]["sources"] if "serviceAccountToken" in s
            ]
            (token,) = [t for t in tokens if t["path"] == relative]
            return "projected", token
        if "configMap" in volume:  # configuration that is not secret (the broker's credential origins)
            config = volume["configMap"]
            items = {item["path"]: item for item in config.get("items", [])}
            assert not items or relative in items, (
                f"{path}: ConfigMap {config['name']} projects only {sorted(items)}"
            )
            return config["name"], items.get(relative, {"key": relative, "path": relative})
        source = volume.get("secret")
        assert source is not None, f"{path} is on a {sorted(volume)} volume, not a Secret"
        items = {item["path"]: item for item in source.get("items", [])}
        if not items:
            return source["secretName"], {"key": relative, "path": relative}
        assert relative in items, f"{path}: Secret {source['secretName']} projects only {sorted(items)}"
        return source["secretName"], items[relative]
    raise AssertionError(f"nothing is mounted at {path}")


def test_engine_speaks_the_services_contract(release: Release) -> None:
    engine = release.deployment_of("engine")
    container = only_container(engine)
    env = env_of(container)
    assert env.keys() >= ENGINE_ENV
    assert container["command"] == ["abada-engine"] and container["args"] == ["serve"]
    assert value(env, "ABADA_GRPC_ADDRESS") == "0.0.0.0:50051"
    assert value(env, "ABADA_HTTP_ADDRESS") == "0.0.0.0:8080"
    assert value(env, "ABADA_BROKER_ADDRESS") == "abada-broker:50061"
    assert secret_key(env, "ABADA_DATABASE_URL") == ("abada-database", "url")
    assert secret_key(env, "ABADA_JOURNAL_KEYS") == ("abada-engine-keys", "journal-keys")
    assert secret_key(env, "ABADA_IDEMPOTENCY_SECRET") == ("abada-engine-keys", "idempotency-secret")
    assert mounted_file(engine, container, value(env, "ABADA_AUTH_TOKENS_FILE")) == (
        "abada-engine-auth",
        {"key": "callers", "path": "callers"},
    )
    assert mounted_file(engine, container, value(env, "ABADA_BROKER_TOKEN_FILE"))[1]["key"] == "broker-token"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": 50051, "http": 8080}
    # Stateless replicas over one PostgreSQL: more than one by default, for rolling updates.
    assert engine["spec"]["replicas"] == 2


def test_broker_speaks_the_services_contract(release: Release) -> None:
    broker = release.deployment_of("broker")
    container = only_container(broker)
    env = env_of(container)
    assert env.keys() >= BROKER_ENV
    assert container["command"] == ["abada-broker"]
    assert value(env, "ABADA_BROKER_GRPC_ADDRESS") == "0.0.0.0:50061"
    assert value(env, "ABADA_ENGINE_ADDRESS") == "abada-engine:50051"
    assert value(env, "ABADA_SECRET_BACKEND") == "vault"
    assert mounted_file(broker, container, value(env, "ABADA_BROKER_AUTH_TOKENS_FILE"))[1]["key"] == "callers"
    assert mounted_file(broker, container, value(env, "ABADA_ENGINE_TOKEN_FILE"))[1]["key"] == "engine-token"


def test_broker_signs_in_to_vault_with_its_service_account_by_default() -> None:
    release = render_set("default")
    broker = release.deployment_of("broker")
    env = env_of(only_container(broker))
    assert value(env, "VAULT_ADDR") == "https://vault.vault.svc:8200"
    assert value(env, "ABADA_VAULT_AUTH") == "kubernetes"
    assert value(env, "ABADA_VAULT_K8S_ROLE") == "abada-broker"
    assert value(env, "ABADA_VAULT_K8S_MOUNT") == "kubernetes"
    assert value(env, "ABADA_VAULT_KV_MOUNT") == "secret"
    assert value(env, "ABADA_VAULT_PATH_TEMPLATE") == "abada/tool-credentials/{credential}"
    assert value(env, "ABADA_SECRET_CACHE_SECONDS") == "5"
    assert "ABADA_VAULT_TOKEN_FILE" not in env and "VAULT_CACERT" not in env
    # Vault's role binds this ServiceAccount, and its token is in the pod for the login.
    assert pod_spec(broker)["serviceAccountName"] == "abada-broker"
    assert pod_spec(broker)["automountServiceAccountToken"] is True


def test_broker_can_sign_in_with_a_token_only_vault_accepts() -> None:
    release = render({"vault": {"auth": {"audience": "vault"}}})
    broker = release.deployment_of("broker")
    container = only_container(broker)
    env = env_of(container)
    source, token = mounted_file(broker, container, value(env, "ABADA_VAULT_K8S_JWT_FILE"))
    assert source == "projected" and token["audience"] == "vault" and token["expirationSeconds"] == 3600
    # The projected token replaces the API token: nothing in the pod can call the Kubernetes API.
    assert pod_spec(broker)["automountServiceAccountToken"] is False


def test_broker_with_a_vault_token_and_a_private_ca() -> None:
    broker = render_set("mtls-on.yaml").deployment_of("broker")
    container = only_container(broker)
    env = env_of(container)
    assert value(env, "ABADA_VAULT_AUTH") == "token"
    assert "ABADA_VAULT_K8S_ROLE" not in env
    assert mounted_file(broker, container, value(env, "ABADA_VAULT_TOKEN_FILE")) == (
        "abada-broker-vault-token",
        {"key": "token", "path": "token"},
    )
    assert mounted_file(broker, container, value(env, "VAULT_CACERT")) == (
        "abada-vault-ca",
        {"key": "ca.crt", "path": "ca.crt"},
    )
    # No Kubernetes login, so no API token in the pod.
    assert pod_spec(broker)["automountServiceAccountToken"] is False


def test_only_the_broker_pod_carries_a_kubernetes_api_token(release: Release) -> None:
    for workload in each(release.workloads(), "workload"):
        if release.component(workload) != "broker":
            assert pod_spec(workload)["automountServiceAccountToken"] is False, workload["metadata"]["name"]
    for account in each(release.of_kind("ServiceAccount"), "ServiceAccount"):
        assert account["automountServiceAccountToken"] is False


def test_each_component_runs_as_its_own_service_account(release: Release) -> None:
    accounts = {
        pod_spec(w)["serviceAccountName"] for w in release.workloads() if release.component(w) != "worker"
    }
    worker_accounts = {
        pod_spec(w)["serviceAccountName"] for w in release.workloads() if release.component(w) == "worker"
    }
    assert accounts == {"abada-engine", "abada-broker", "abada-migrate"}
    assert worker_accounts == {"abada-worker"}
    created = {a["metadata"]["name"] for a in release.of_kind("ServiceAccount")}
    assert created == accounts | worker_accounts


def test_workers_speak_the_services_contract() -> None:
    release = render_set("keda-on.yaml")
    workers = {
        d["metadata"]["name"]: d for d in release.of_kind("Deployment") if release.component(d) == "worker"
    }
    assert set(workers) == {"abada-worker-abada-agent", "abada-worker-billing"}
    agent, billing = (
        env_of(only_container(workers[name])) for name in ("abada-worker-abada-agent", "abada-worker-billing")
    )
    for env in (agent, billing):
        assert env.keys() >= WORKER_ENV
        assert value(env, "ABADA_ENGINE_ADDRESS") == "abada-engine:50051"
        assert value(env, "ABADA_BROKER_ADDRESS") == "abada-broker:50061"
        # Each pod is its own worker: the lease holder is the pod.
        assert env["ABADA_POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        # Kubernetes expands $(VAR) only from variables listed before it.
        names = list(env)
        assert names.index("ABADA_POD_NAME") < names.index("ABADA_WORKER_ID")
        assert value(env, "ABADA_WORKER_HEALTH_ADDRESS") == "0.0.0.0:8081"
    # The pool token's identity prefixes every worker id: the engine and the broker refuse other ids.
    assert value(agent, "ABADA_WORKER_ID") == "agent-pool/$(ABADA_POD_NAME)"
    assert value(billing, "ABADA_WORKER_ID") == "billing-pool/$(ABADA_POD_NAME)"
    assert (value(agent, "ABADA_WORKER_TOPIC"), value(agent, "ABADA_WORKER_CONCURRENCY")) == (
        "abada:agent",
        "8",
    )
    assert (value(billing, "ABADA_WORKER_TOPIC"), value(billing, "ABADA_WORKER_CONCURRENCY")) == (
        "billing:reconcile",
        "2",
    )
    assert (value(agent, "ABADA_LEASE_MS"), value(billing, "ABADA_LEASE_MS")) == ("30000", "120000")
    assert "ABADA_GEMINI_BASE_URL" not in agent and "ABADA_GEMINI_BASE_URL" not in billing
    assert secret_key(agent, "GEMINI_API_KEY") == ("abada-gemini", "api-key")
    assert "GEMINI_API_KEY" not in billing
    assert value(billing, "HTTPS_PROXY") == "http://proxy.internal:3128"
    agent_container, billing_container = (
        only_container(workers["abada-worker-abada-agent"]),
        only_container(workers["abada-worker-billing"]),
    )
    assert agent_container["command"] == ["abada-worker"]
    assert (
        mounted_file(
            workers["abada-worker-abada-agent"], agent_container, value(agent, "ABADA_WORKER_TOKEN_FILE")
        )[0]
        == "abada-worker-token"
    )
    assert (
        mounted_file(
            workers["abada-worker-billing"], billing_container, value(billing, "ABADA_WORKER_TOKEN_FILE")
        )[0]
        == "abada-billing-worker-token"
    )


def test_a_pool_keeps_the_defaults_it_does_not_override() -> None:
    release = render(
        {"workers": [{"topic": "abada:agent", "resources": {"requests": {"cpu": "1", "memory": "2Gi"}}}]}
    )
    container = only_container(release.deployment_of("worker"))
    # resources replace as a whole: the default 1Gi limit must not sit below a 2Gi request.
    assert container["resources"] == {"requests": {"cpu": "1", "memory": "2Gi"}}
    env = env_of(container)
    assert (value(env, "ABADA_WORKER_CONCURRENCY"), value(env, "ABADA_DRAIN_SECONDS")) == ("4", "60")


def test_worker_resource_names_are_dns_safe_forms_of_their_topics() -> None:
    release = render({"workers": [{"topic": "Billing.Reconcile:v2"}, {"topic": "abada:agent"}]})
    names = {d["metadata"]["name"] for d in release.of_kind("Deployment") if release.component(d) == "worker"}
    assert names == {"abada-worker-billing-reconcile-v2", "abada-worker-abada-agent"}
    for name in names:
        assert DNS_LABEL.match(name) and len(name) <= 63
    long_topic = "x" * 150 + ":agent"
    (long,) = [
        d
        for d in render({"workers": [{"topic": long_topic}]}).of_kind("Deployment")
        if d["metadata"]["name"].startswith("abada-worker")
    ]
    assert len(long["metadata"]["name"]) <= 63 and DNS_LABEL.match(long["metadata"]["name"])
    assert env_of(only_container(long))["ABADA_WORKER_TOPIC"]["value"] == long_topic


def test_grpc_services_are_probed_over_grpc_health(value_set: str) -> None:
    release = render_set(value_set)
    if not tls_on(value_set):
        container = only_container(release.deployment_of("engine"))
        assert {p["name"]: p["containerPort"] for p in container["ports"]}["grpc"] == 50051
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"] == {"port": 50051}, probe
    broker = only_container(release.deployment_of("broker"))
    ports = {p["name"]: p["containerPort"] for p in broker["ports"]}
    assert ports["grpc"] == 50061
    # With TLS on the broker's gRPC port the kubelet (plaintext only) asks its health-only port.
    probed = ports["health"] if tls_on(value_set) else 50061
    # The broker's overall health goes NOT_SERVING while Vault is down: that takes it out of the
    # Service. Its `liveness` service stays SERVING, so the outage never restarts it.
    assert broker["readinessProbe"]["grpc"] == {"port": probed}
    for probe in ("startupProbe", "livenessProbe"):
        assert broker[probe]["grpc"] == {"port": probed, "service": "liveness"}, probe


def test_with_mtls_the_engine_is_probed_over_http_and_reads_its_certificates() -> None:
    # kubelet's gRPC probe cannot present a client certificate.
    release = render_set("mtls-on.yaml")
    engine = release.deployment_of("engine")
    container = only_container(engine)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "http"}
    env = env_of(container)
    files = {
        name: mounted_file(engine, container, value(env, name))
        for name in ("ABADA_TLS_CERT_FILE", "ABADA_TLS_KEY_FILE", "ABADA_TLS_CLIENT_CA_FILE")
    }
    assert {secret for secret, _ in files.values()} == {"abada-engine-tls"}
    assert [item["key"] for _, item in files.values()] == ["tls.crt", "tls.key", "ca.crt"]
    # Each client reads its own variable names (the broker's README, the worker's settings.py).
    clients = (
        ("broker", "abada-broker-client-tls", "ABADA_ENGINE_TLS"),
        ("worker", "abada-worker-client-tls", "ABADA_TLS"),
    )
    for component, secret, prefix in clients:
        client = release.deployment_of(component)
        client_container = only_container(client)
        client_env = env_of(client_container)
        files = {
            part: mounted_file(client, client_container, value(client_env, f"{prefix}_{part}_FILE"))
            for part in ("CA", "CERT", "KEY")
        }
        assert {source for source, _ in files.values()} == {secret}, component
        assert {part: item["key"] for part, (_, item) in files.items()} == {
            "CA": "ca.crt",
            "CERT": "tls.crt",
            "KEY": "tls.key",
        }
    broker_env = env_of(only_container(release.deployment_of("broker")))
    assert not [name for name in broker_env if name.startswith("ABADA_TLS_")]


def test_without_mtls_no_certificate_is_mounted() -> None:
    release = render_set("plaintext.yaml")
    for workload in each(release.workloads(), "workload"):
        for container in iter_containers(workload):
            assert not any("TLS" in name for name in env_of(container)), workload["metadata"]["name"]


def test_workers_are_probed_on_their_health_port(release: Release) -> None:
    pools = [d for d in release.of_kind("Deployment") if release.component(d) == "worker"]
    for deployment in each(pools, "worker Deployment"):
        container = only_container(deployment)
        assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"health": 8081}
        for probe in ("readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}


def test_every_file_an_env_var_names_is_mounted(release: Release) -> None:
    files_checked = 0
    for workload in each(release.workloads(), "workload"):
        for container in iter_containers(workload):
            for name, entry in env_of(container).items():
                if name.endswith("_FILE") or name == "VAULT_CACERT":
                    mounted_file(workload, container, entry["value"])
                    files_checked += 1
    assert files_checked > 0


def test_every_pod_runs_unprivileged_on_a_read_only_root(release: Release) -> None:
    for workload in release.workloads():
        name = workload["metadata"]["name"]
        spec = pod_spec(workload)
        pod_security = spec["securityContext"]
        assert pod_security["runAsNonRoot"] is True and pod_security["runAsUser"] == 10001, name
        assert pod_security["seccompProfile"] == {"type": "RuntimeDefault"}, name
        volumes = {v["name"]: v for v in spec["volumes"]}
        for container in iter_containers(workload):
            security = container["securityContext"]
            assert security["runAsNonRoot"] is True and security["runAsUser"] == 10001, name
            assert security["allowPrivilegeEscalation"] is False, name
            assert security["readOnlyRootFilesystem"] is True, name
            assert security["capabilities"] == {"drop": ["ALL"]}, name
            assert security["seccompProfile"] == {"type": "RuntimeDefault"}, name
            (tmp,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
            assert volumes[tmp["name"]] == {"name": tmp["name"], "emptyDir": {}}, name
            assert all(m.get("readOnly") for m in container["volumeMounts"] if m["mountPath"] != "/tmp"), name


def test_workers_outlive_their_drain(release: Release) -> None:
    workers = [d for d in release.of_kind("Deployment") if release.component(d) == "worker"]
    assert workers
    for deployment in workers:
        drain = int(env_of(only_container(deployment))["ABADA_DRAIN_SECONDS"]["value"])
        assert pod_spec(deployment)["terminationGracePeriodSeconds"] > drain


def test_grace_period_defaults_to_drain_plus_margin() -> None:
    release = render_set("keda-on.yaml")
    assert (
        pod_spec(release.get("Deployment", "abada-worker-abada-agent"))["terminationGracePeriodSeconds"]
        == 150
    )
    assert pod_spec(release.get("Deployment", "abada-worker-billing"))["terminationGracePeriodSeconds"] == 45


def test_migrations_run_as_a_hook_before_install_and_upgrade(release: Release) -> None:
    job = release.get("Job", "abada-migrate")
    annotations = job["metadata"]["annotations"]
    assert set(annotations["helm.sh/hook"].split(",")) == {"pre-install", "pre-upgrade"}
    assert "before-hook-creation" in annotations["helm.sh/hook-delete-policy"].split(",")
    container = only_container(job)
    assert container["command"] == ["abada-engine"] and container["args"] == ["migrate"]
    assert secret_key(env_of(container), "ABADA_DATABASE_URL") == ("abada-database", "url")
    assert pod_spec(job)["restartPolicy"] == "Never"
    # Hooks run before the release's own resources exist: what the Job needs comes as earlier hooks.
    job_weight = int(annotations["helm.sh/hook-weight"])
    account = release.get("ServiceAccount", pod_spec(job)["serviceAccountName"])
    policy = release.get("NetworkPolicy", "abada-migrate")
    for prerequisite in (account, policy):
        assert "pre-install" in prerequisite["metadata"]["annotations"]["helm.sh/hook"]
        assert int(prerequisite["metadata"]["annotations"]["helm.sh/hook-weight"]) < job_weight


def test_no_migration_hook_when_disabled() -> None:
    release = render({"migrations": {"enabled": False}})
    hooks = [m for m in release.manifests if "helm.sh/hook" in m["metadata"].get("annotations", {})]
    assert hooks == []


def test_images_default_to_the_app_version_and_can_be_pinned() -> None:
    defaults = render_set("default")
    images = {c: only_container(defaults.deployment_of(c))["image"] for c in ("engine", "broker", "worker")}
    assert images == {
        "engine": "abada/engine:0.1.0",
        "broker": "abada/credential-broker:0.1.0",
        "worker": "abada/agent-worker:0.1.0",
    }
    digest = "sha256:" + "a" * 64
    release = render(
        {
            "image": {"registry": "registry.example/team/"},
            "engine": {"image": {"digest": digest}},
            "broker": {"image": {"tag": "0.2.0"}},
        }
    )
    assert (
        only_container(release.deployment_of("engine"))["image"]
        == f"registry.example/team/abada/engine@{digest}"
    )
    assert (
        only_container(release.get("Job", "abada-migrate"))["image"]
        == f"registry.example/team/abada/engine@{digest}"
    )
    assert (
        only_container(release.deployment_of("broker"))["image"]
        == "registry.example/team/abada/credential-broker:0.2.0"
    )


def test_engine_and_broker_have_disruption_budgets(release: Release) -> None:
    budgets = {b["metadata"]["name"]: b["spec"] for b in release.of_kind("PodDisruptionBudget")}
    for component in ("engine", "broker"):
        deployment = release.deployment_of(component)
        budget = budgets[deployment["metadata"]["name"]]
        assert budget["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
        assert budget["maxUnavailable"] == 1
    for deployment in release.of_kind("Deployment"):
        if release.component(deployment) == "worker":
            assert (
                budgets[deployment["metadata"]["name"]]["selector"]["matchLabels"]
                == deployment["spec"]["selector"]["matchLabels"]
            )


def test_selectors_pick_exactly_their_own_pods(release: Release) -> None:
    deployments = release.of_kind("Deployment")
    for deployment in deployments:
        selector = deployment["spec"]["selector"]["matchLabels"]
        chosen = [
            d["metadata"]["name"]
            for d in deployments
            if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert chosen == [deployment["metadata"]["name"]]
    for service in release.of_kind("Service"):
        selector = service["spec"]["selector"]
        chosen = [
            d["metadata"]["name"]
            for d in deployments
            if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert chosen == [service["metadata"]["name"]]


def test_every_resource_carries_the_standard_labels(release: Release) -> None:
    for manifest in release.manifests:
        labels = manifest["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "abada"
        assert labels["app.kubernetes.io/instance"] == "abada"
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert labels["app.kubernetes.io/version"] == "0.1.0"
        assert "app.kubernetes.io/component" in labels


def test_tls_without_client_certificates_leaves_the_engine_on_tokens() -> None:
    values = ci_values("mtls-on.yaml")
    values["tls"] = {**values.get("tls", {}), "requireClientCertificates": False}
    engine = render(values).deployment_of("engine")
    container = only_container(engine)
    env = env_of(container)
    assert {"ABADA_TLS_CERT_FILE", "ABADA_TLS_KEY_FILE"} <= env.keys()
    # No client CA: the engine asks for no client certificate and every caller presents its token.
    assert "ABADA_TLS_CLIENT_CA_FILE" not in env

"""Worker pools scale on queue depth through KEDA, or on CPU without it."""

from __future__ import annotations

from urllib.parse import unquote, urlsplit

from chart_support import Manifest, Release, ci_values, only_container, render, render_set


def pools_by_topic(release: Release) -> dict[str, Manifest]:
    return {
        d["metadata"]["annotations"]["abada.dev/topic"]: d
        for d in release.of_kind("Deployment")
        if release.component(d) == "worker"
    }


def scaled_objects_by_target(release: Release) -> dict[str, Manifest]:
    return {so["spec"]["scaleTargetRef"]["name"]: so for so in release.of_kind("ScaledObject")}


def test_one_scaled_object_per_pool_targets_its_deployment() -> None:
    release = render_set("keda-on.yaml")
    pools = pools_by_topic(release)
    assert set(pools) == {"abada:agent", "billing:reconcile"}
    scaled = scaled_objects_by_target(release)
    assert set(scaled) == {d["metadata"]["name"] for d in pools.values()}
    for scaled_object in scaled.values():
        target = scaled_object["spec"]["scaleTargetRef"]
        assert (target["apiVersion"], target["kind"]) == ("apps/v1", "Deployment")


def test_metrics_api_trigger_reads_ready_tasks_of_the_pools_topic() -> None:
    release = render_set("keda-on.yaml")
    engine_service = release.get("Service", "abada-engine")
    http_port = next(p["port"] for p in engine_service["spec"]["ports"] if p["name"] == "http")
    for topic, deployment in pools_by_topic(release).items():
        (trigger,) = scaled_objects_by_target(release)[deployment["metadata"]["name"]]["spec"]["triggers"]
        assert trigger["type"] == "metrics-api"
        url = urlsplit(trigger["metadata"]["url"])
        # The KEDA operator runs in its own namespace: it needs the Service's full DNS name.
        assert (url.scheme, url.hostname, url.port) == (
            "http",
            "abada-engine.abada.svc.cluster.local",
            http_port,
        )
        assert url.path.startswith("/v1/topics/") and url.path.endswith("/stats")
        encoded_topic = url.path.removeprefix("/v1/topics/").removesuffix("/stats")
        assert ":" not in encoded_topic and unquote(encoded_topic) == topic
        assert trigger["metadata"]["valueLocation"] == "ready"
        assert trigger["metadata"]["format"] == "json"


def test_target_value_and_replica_bounds_come_from_each_pool() -> None:
    scaled = scaled_objects_by_target(render_set("keda-on.yaml"))
    agent, billing = scaled["abada-worker-abada-agent"]["spec"], scaled["abada-worker-billing"]["spec"]
    assert agent["triggers"][0]["metadata"]["targetValue"] == "8"
    assert (agent["minReplicaCount"], agent["maxReplicaCount"]) == (0, 20)
    # No targetValue in ci/keda-on.yaml for billing: the workerDefaults value.
    assert billing["triggers"][0]["metadata"]["targetValue"] == "4"
    assert (billing["minReplicaCount"], billing["maxReplicaCount"]) == (1, 4)
    assert (agent["pollingInterval"], agent["cooldownPeriod"]) == (10, 120)


def test_scale_down_behavior_reaches_the_hpa_keda_creates() -> None:
    values = ci_values("keda-on.yaml")
    slow_down = {
        "stabilizationWindowSeconds": 600,
        "policies": [{"type": "Pods", "value": 1, "periodSeconds": 120}],
    }
    values["autoscaling"]["keda"]["behavior"] = {"scaleDown": slow_down}
    for scaled_object in render(values).of_kind("ScaledObject"):
        behavior = scaled_object["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        assert behavior["scaleDown"] == slow_down


def test_default_behavior_scales_down_gradually() -> None:
    (scaled_object,) = render_set("default").of_kind("ScaledObject")
    scale_down = scaled_object["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
    # A worker that loses its pod mid-task costs a lease expiry: never drop all of them at once.
    assert scale_down["stabilizationWindowSeconds"] >= 60
    assert all(p["type"] != "Percent" or p["value"] < 100 for p in scale_down["policies"])


def test_metrics_api_authenticates_with_a_bearer_token_from_a_secret() -> None:
    release = render_set("keda-on.yaml")
    for scaled_object in release.of_kind("ScaledObject"):
        (trigger,) = scaled_object["spec"]["triggers"]
        assert trigger["metadata"]["authMode"] == "bearer"
        auth = release.get("TriggerAuthentication", trigger["authenticationRef"]["name"])
        # The metrics-api scaler sends "Authorization: Bearer <token>" from the parameter `token`.
        assert auth["spec"]["secretTargetRef"] == [
            {"parameter": "token", "name": "abada-keda-stats", "key": "token"}
        ]


def test_prometheus_trigger_queries_the_ready_gauge_of_the_topic() -> None:
    release = render_set("prometheus-trigger.yaml")
    (scaled_object,) = release.of_kind("ScaledObject")
    (trigger,) = scaled_object["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    metadata = trigger["metadata"]
    assert metadata["serverAddress"] == "http://prometheus-operated.monitoring.svc:9090"
    # Every engine replica exports the same database-wide gauge, so max() and never sum().
    assert metadata["query"] == 'max(abada_tasks_ready{topic="abada:agent",namespace="abada"})'
    assert metadata["threshold"] == "6"
    assert metadata["authModes"] == "bearer"
    auth = release.get("TriggerAuthentication", trigger["authenticationRef"]["name"])
    assert auth["spec"]["secretTargetRef"] == [
        {"parameter": "bearerToken", "name": "abada-prometheus-token", "key": "token"}
    ]


def test_prometheus_trigger_without_a_token_sends_no_auth() -> None:
    values = ci_values("prometheus-trigger.yaml")
    values["autoscaling"]["keda"]["prometheus"]["bearerTokenSecret"] = {"existingSecret": ""}
    release = render(values)
    (scaled_object,) = release.of_kind("ScaledObject")
    (trigger,) = scaled_object["spec"]["triggers"]
    assert "authenticationRef" not in trigger and "authModes" not in trigger["metadata"]
    assert release.of_kind("TriggerAuthentication") == []


def test_without_keda_a_cpu_hpa_scales_each_pool() -> None:
    release = render_set("keda-off.yaml")
    assert release.of_kind("ScaledObject") == [] and release.of_kind("TriggerAuthentication") == []
    (deployment,) = pools_by_topic(release).values()
    (hpa,) = release.of_kind("HorizontalPodAutoscaler")
    spec = hpa["spec"]
    assert spec["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": deployment["metadata"]["name"],
    }
    assert (spec["minReplicas"], spec["maxReplicas"]) == (2, 6)
    assert spec["metrics"] == [
        {
            "type": "Resource",
            "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 60}},
        }
    ]
    assert spec["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 300
    assert "cpu" in only_container(deployment)["resources"]["requests"]


def test_an_autoscaled_deployment_leaves_replicas_to_the_autoscaler() -> None:
    # Writing spec.replicas would reset the autoscaler's choice on every `helm upgrade`.
    for value_set in ("keda-on.yaml", "keda-off.yaml", "prometheus-trigger.yaml"):
        for deployment in pools_by_topic(render_set(value_set)).values():
            assert "replicas" not in deployment["spec"], value_set


def test_without_any_autoscaler_the_pool_runs_its_fixed_replicas() -> None:
    release = render(
        {"autoscaling": {"keda": {"enabled": False}}, "workers": [{"topic": "abada:agent", "replicas": 3}]}
    )
    assert release.of_kind("ScaledObject") == [] and release.of_kind("HorizontalPodAutoscaler") == []
    (deployment,) = pools_by_topic(release).values()
    assert deployment["spec"]["replicas"] == 3

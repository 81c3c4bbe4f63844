"""Worker pools scale on demand (ready + leased) through KEDA, or on CPU without it."""

from __future__ import annotations

import math
import secrets
from typing import Any
from urllib.parse import quote, unquote, urlsplit

import httpx2
import yaml
from abada_engine.api.http import HttpServer, build_app
from abada_engine.auth import CallerRegistry, token_sha256
from abada_engine.runtime.queue_stats import QueueStats
from chart_support import Manifest, Release, ci_values, each, only_container, render, render_set
from engine_helpers import complete, deploy, fetch, start

AGENT_TOPIC = "abada:agent"


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
    for scaled_object in each(scaled.values(), "ScaledObject"):
        target = scaled_object["spec"]["scaleTargetRef"]
        assert (target["apiVersion"], target["kind"]) == ("apps/v1", "Deployment")


def test_metrics_api_trigger_reads_the_demand_of_the_pools_topic() -> None:
    release = render_set("keda-on.yaml")
    engine_service = release.get("Service", "abada-engine")
    http_port = next(p["port"] for p in engine_service["spec"]["ports"] if p["name"] == "http")
    for topic, deployment in each(pools_by_topic(release).items(), "worker pool"):
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
        assert trigger["metadata"]["valueLocation"] == "demand"
        assert trigger["metadata"]["format"] == "json"
        # Scale from zero: the first ready task wakes a pool that has no pod.
        assert trigger["metadata"]["activationTargetValue"] == "0"


def test_target_value_is_each_pools_concurrency_and_replica_bounds_are_its_own() -> None:
    scaled = scaled_objects_by_target(render_set("keda-on.yaml"))
    agent, billing = scaled["abada-worker-abada-agent"]["spec"], scaled["abada-worker-billing"]["spec"]
    # No targetValue in ci/keda-on.yaml: a pod is full at its concurrency (8 and 2).
    assert agent["triggers"][0]["metadata"]["targetValue"] == "8"
    assert (agent["minReplicaCount"], agent["maxReplicaCount"]) == (0, 20)
    assert billing["triggers"][0]["metadata"]["targetValue"] == "2"
    assert (billing["minReplicaCount"], billing["maxReplicaCount"]) == (1, 4)
    assert (agent["pollingInterval"], agent["cooldownPeriod"]) == (10, 120)


def test_scale_down_behavior_reaches_the_hpa_keda_creates() -> None:
    values = ci_values("keda-on.yaml")
    slow_down = {
        "stabilizationWindowSeconds": 600,
        "policies": [{"type": "Pods", "value": 1, "periodSeconds": 120}],
    }
    values["autoscaling"]["keda"]["behavior"] = {"scaleDown": slow_down}
    for scaled_object in each(render(values).of_kind("ScaledObject"), "ScaledObject"):
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
    for scaled_object in each(release.of_kind("ScaledObject"), "ScaledObject"):
        (trigger,) = scaled_object["spec"]["triggers"]
        assert trigger["metadata"]["authMode"] == "bearer"
        auth = release.get("TriggerAuthentication", trigger["authenticationRef"]["name"])
        # The metrics-api scaler sends "Authorization: Bearer <token>" from the parameter `token`.
        assert auth["spec"]["secretTargetRef"] == [
            {"parameter": "token", "name": "abada-keda-stats", "key": "token"}
        ]


def test_target_value_set_on_a_pool_wins_over_its_concurrency() -> None:
    values = ci_values("keda-on.yaml")
    values["workers"][0]["autoscaling"] = {"targetValue": 5}
    scaled = scaled_objects_by_target(render(values))
    assert scaled["abada-worker-abada-agent"]["spec"]["triggers"][0]["metadata"]["targetValue"] == "5"


def test_prometheus_trigger_queries_the_demand_gauge_of_the_topic() -> None:
    release = render_set("prometheus-trigger.yaml")
    (scaled_object,) = release.of_kind("ScaledObject")
    (trigger,) = scaled_object["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    metadata = trigger["metadata"]
    assert metadata["serverAddress"] == "http://prometheus-operated.monitoring.svc:9090"
    # Every engine replica exports the same database-wide gauge, so max() and never sum().
    assert metadata["query"] == 'max(abada_tasks_demand{topic="abada:agent",namespace="abada"})'
    assert metadata["threshold"] == "6"
    assert metadata["activationThreshold"] == "0"
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
        for deployment in each(pools_by_topic(render_set(value_set)).values(), "worker pool"):
            assert "replicas" not in deployment["spec"], value_set


def test_without_any_autoscaler_the_pool_runs_its_fixed_replicas() -> None:
    release = render(
        {"autoscaling": {"keda": {"enabled": False}}, "workers": [{"topic": "abada:agent", "replicas": 3}]}
    )
    assert release.of_kind("ScaledObject") == [] and release.of_kind("HorizontalPodAutoscaler") == []
    (deployment,) = pools_by_topic(release).values()
    assert deployment["spec"]["replicas"] == 3


def keda_desired_replicas(scaled_object: Manifest, stats: dict[str, Any]) -> int:
    """What KEDA makes of one poll of the stats endpoint for a metrics-api trigger.

    Inactive (value <= activationTargetValue): minReplicaCount, which may be 0. Active: the HPA
    KEDA drives with an AverageValue target, ceil(value / targetValue), within the bounds.
    """
    spec = scaled_object["spec"]
    (trigger,) = spec["triggers"]
    value = float(stats[trigger["metadata"]["valueLocation"]])
    lowest, highest = spec["minReplicaCount"], spec["maxReplicaCount"]
    if value <= float(trigger["metadata"]["activationTargetValue"]):
        return int(lowest)
    return int(min(highest, max(lowest, 1, math.ceil(value / float(trigger["metadata"]["targetValue"])))))


BURST_PROCESS = """
processes:
  - id: burst
    start: work
    nodes:
      - { id: work, type: agent, model: gemini-m, prompt: p, result_variable: r, next: done }
      - { id: done, type: end }
"""


async def test_a_burst_keeps_its_pods_while_it_is_worked_on_and_the_pool_scales_from_zero(
    engine, db, tmp_path
) -> None:
    """The rendered ScaledObject against the live endpoint: scaling follows demand, not the waiting line."""
    agent_pool = scaled_objects_by_target(render_set("keda-on.yaml"))["abada-worker-abada-agent"]
    scaler_token = secrets.token_urlsafe(16)
    callers = tmp_path / "callers.yaml"
    callers.write_text(
        yaml.safe_dump(
            {
                "callers": [
                    {"identity": "keda", "roles": ["metrics"], "token_sha256": token_sha256(scaler_token)}
                ]
            }
        )
    )
    server = HttpServer(build_app(QueueStats(db), CallerRegistry(callers)), "127.0.0.1:0")
    await server.start()

    async def poll() -> tuple[dict[str, Any], int]:
        url = f"http://127.0.0.1:{server.port}/v1/topics/{quote(AGENT_TOPIC, safe='')}/stats"
        async with httpx2.AsyncClient() as client:
            response = await client.get(url, headers={"Authorization": f"Bearer {scaler_token}"})
        assert response.status_code == 200, response.text
        document = response.json()
        return document, keda_desired_replicas(agent_pool, document)

    try:
        await deploy(engine, BURST_PROCESS)
        stats, replicas = await poll()
        assert (stats["demand"], replicas) == (0, 0)  # idle: the pool may sit at zero pods

        for _ in range(20):
            await start(engine, "burst")
        stats, replicas = await poll()
        assert (stats["ready"], stats["demand"], replicas) == (20, 20, 3)  # 20 tasks at 8 a pod

        # The pods take the whole burst: nothing waits any more, but all 20 are being worked on.
        taken = await fetch(engine, "pool/a", AGENT_TOPIC, max_tasks=20, lease_ms=60_000)
        assert len(taken) == 20
        stats, replicas = await poll()
        assert (stats["ready"], stats["leased"], stats["demand"]) == (0, 20, 20)
        assert replicas == 3  # scaling on `ready` alone would have stopped them all mid-task

        for task in taken[:12]:
            await complete(engine, task, "pool/a", {"r": {}})
        stats, replicas = await poll()
        assert (stats["demand"], replicas) == (8, 1)

        for task in taken[12:]:
            await complete(engine, task, "pool/a", {"r": {}})
        stats, replicas = await poll()
        assert (stats["demand"], replicas) == (0, 0)

        # Scale from zero: one new task is enough to wake the pool.
        await start(engine, "burst")
        stats, replicas = await poll()
        assert (stats["ready"], replicas) == (1, 1)
    finally:
        await server.stop()

"""Queue depth over HTTP for autoscalers, and Prometheus metrics, correct across engine replicas."""

from __future__ import annotations

import asyncio
import secrets

import httpx2
import pytest
import yaml
from abada.engine.v1 import dependency_pb2, external_task_pb2
from abada_engine.api.http import HttpServer, build_app
from abada_engine.auth import CallerRegistry, token_sha256
from abada_engine.db.database import create_engine
from abada_engine.runtime.queue_stats import QueueStats
from engine_helpers import complete, deploy, fetch, start, until_lease_ran_out

JOBS = """
processes:
  - id: job
    start: work
    nodes:
      - { id: work, type: agent, model: gemini-m, prompt: p, result_variable: r, next: done }
      - { id: done, type: end }
"""


@pytest.fixture
def metrics_max_age() -> float:
    return 0.0


@pytest.fixture
async def replicas(database_url, tmp_path, engine, metrics_max_age):
    """Two engine HTTP replicas, each with its own connection pool, over the one test database."""
    scaler_token, worker_token = secrets.token_urlsafe(16), secrets.token_urlsafe(16)
    callers = tmp_path / "callers.yaml"
    callers.write_text(
        yaml.safe_dump(
            {
                "callers": [
                    {"identity": "keda", "roles": ["metrics"], "token_sha256": token_sha256(scaler_token)},
                    {
                        "identity": "pool",
                        "roles": ["worker"],
                        "topics": ["*"],
                        "token_sha256": token_sha256(worker_token),
                    },
                ]
            }
        )
    )
    started = []
    pools = []
    for _ in range(2):
        db = create_engine(database_url, pool_size=2)
        pools.append(db)
        server = HttpServer(
            build_app(QueueStats(db), CallerRegistry(callers), metrics_max_age_seconds=metrics_max_age),
            "127.0.0.1:0",
        )
        await server.start()
        started.append(server)
    yield [f"http://127.0.0.1:{s.port}" for s in started], scaler_token, worker_token
    for server in started:
        await server.stop()
    for db in pools:
        await db.dispose()


async def stats(url: str, token: str, topic: str = "abada:agent") -> dict:
    async with httpx2.AsyncClient() as client:
        response = await client.get(
            f"{url}/v1/topics/{topic}/stats", headers={"Authorization": f"Bearer {token}"}
        )
    assert response.status_code == 200, response.text
    return response.json()


def keda_metrics_api_value(document: dict, value_location: str) -> float:
    """What KEDA's metrics-api scaler reads: a GJSON path; ours is a top-level key."""
    value = document
    for part in value_location.split("."):
        value = value[part]
    return float(value)


async def test_counts_follow_tasks_through_their_life_on_both_replicas(engine, replicas):
    urls, token, _ = replicas
    await deploy(engine, JOBS)
    for url in urls:
        assert (await stats(url, token))["ready"] == 0
    for _ in range(3):
        await start(engine, "job")
    for url in urls:
        first = await stats(url, token)
        assert (first["ready"], first["leased"]) == (3, 0)
        assert keda_metrics_api_value(first, "ready") == 3
    # 4 s: both replicas must be asked while the leases hold, even on a loaded machine.
    leased = await fetch(engine, "w", "abada:agent", max_tasks=2, lease_ms=4000)
    for url in urls:
        assert (lambda s: (s["ready"], s["leased"]))(await stats(url, token)) == (1, 2)
    await until_lease_ran_out(*leased)  # both leases expire: fetchable again, so counted ready
    assert (lambda s: (s["ready"], s["leased"]))(await stats(urls[1], token)) == (3, 0)
    [again] = await fetch(engine, "w", "abada:agent", max_tasks=1)
    await complete(engine, again, "w", {"r": {}})
    for url in urls:
        final = await stats(url, token)
        assert (final["ready"], final["leased"]) == (2, 0)
        assert final["oldestReadyAgeSeconds"] > 0  # ready since their leases ran out
        assert final["topic"] == "abada:agent"


async def test_the_stats_endpoint_needs_a_token_with_the_metrics_role(engine, replicas):
    urls, _, worker_token = replicas
    async with httpx2.AsyncClient() as client:
        anonymous = await client.get(f"{urls[0]}/v1/topics/abada:agent/stats")
        assert anonymous.status_code == 401
        wrong = await client.get(
            f"{urls[0]}/v1/topics/abada:agent/stats", headers={"Authorization": "Bearer nope"}
        )
        assert wrong.status_code == 401
        worker = await client.get(
            f"{urls[0]}/v1/topics/abada:agent/stats", headers={"Authorization": f"Bearer {worker_token}"}
        )
        assert worker.status_code == 403


async def test_prometheus_metrics_show_the_queue_incidents_and_rpc_latency(engine, replicas):
    urls, scaler_token, _ = replicas
    await deploy(engine, JOBS)
    await start(engine, "job")
    await start(engine, "job")
    [task] = await fetch(engine, "w", "abada:agent")
    await engine.tasks.Fail(
        external_task_pb2.FailRequest(
            task_id=task.id,
            worker_id="w",
            lease_token=task.lease_token,
            no_retry=True,
            error_message="broken",
        )
    )
    async with httpx2.AsyncClient() as client:
        text = (
            await client.get(f"{urls[1]}/metrics", headers={"Authorization": f"Bearer {scaler_token}"})
        ).text
    assert 'abada_tasks_ready{topic="abada:agent"} 1.0' in text
    assert 'abada_incidents_open{type="FAILED_TASK"} 1.0' in text
    assert "abada_rpc_duration_seconds_bucket" in text


async def test_metrics_need_a_token_with_the_metrics_role(engine, replicas):
    """Review finding: /metrics answered anyone, while the stats endpoint needed the metrics role."""
    urls, scaler_token, worker_token = replicas
    async with httpx2.AsyncClient() as client:
        anonymous = await client.get(f"{urls[0]}/metrics")
        assert anonymous.status_code == 401
        assert "abada_tasks" not in anonymous.text
        worker = await client.get(f"{urls[0]}/metrics", headers={"Authorization": f"Bearer {worker_token}"})
        assert worker.status_code == 403
        scaler = await client.get(f"{urls[0]}/metrics", headers={"Authorization": f"Bearer {scaler_token}"})
        assert scaler.status_code == 200 and "abada_rpc_duration_seconds" in scaler.text
        health = await client.get(f"{urls[0]}/healthz")
        assert health.status_code == 200  # probes still need no token


@pytest.mark.parametrize("metrics_max_age", [4.0])
async def test_scrapes_share_cached_figures_instead_of_counting_tables_each_time(engine, replicas):
    urls, scaler_token, _ = replicas
    headers = {"Authorization": f"Bearer {scaler_token}"}
    await deploy(engine, JOBS)
    await start(engine, "job")
    async with httpx2.AsyncClient() as client:
        first = (await client.get(f"{urls[0]}/metrics", headers=headers)).text
        assert 'abada_tasks_ready{topic="abada:agent"} 1.0' in first
        await start(engine, "job")
        # Within the cache's age the figures are the ones already counted...
        again = (await client.get(f"{urls[0]}/metrics", headers=headers)).text
        assert 'abada_tasks_ready{topic="abada:agent"} 1.0' in again
        # ...and a later scrape counts again.
        deadline = asyncio.get_running_loop().time() + 20
        while asyncio.get_running_loop().time() < deadline:
            later = (await client.get(f"{urls[0]}/metrics", headers=headers)).text
            if 'abada_tasks_ready{topic="abada:agent"} 2.0' in later:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the figures were never refreshed")


async def test_a_dependency_down_shows_in_the_metrics_and_its_parked_tasks_leave_the_demand(engine, replicas):
    urls, scaler_token, _ = replicas
    await deploy(engine, JOBS)
    for _ in range(3):
        await start(engine, "job")
    tasks = await fetch(engine, "w", "abada:agent", max_tasks=3)
    for task in tasks:
        await engine.tasks.ReportDependency(
            external_task_pb2.ReportDependencyRequest(
                task_id=task.id,
                worker_id="w",
                lease_token=task.lease_token,
                dependency=dependency_pb2.Dependency(
                    kind=dependency_pb2.DEPENDENCY_KIND_MODEL, name="gemini-m"
                ),
                error_message="overloaded",
                retry_after_ms=60_000,
            )
        )
    figures = await stats(urls[0], scaler_token)
    async with httpx2.AsyncClient() as client:
        text = (
            await client.get(f"{urls[1]}/metrics", headers={"Authorization": f"Bearer {scaler_token}"})
        ).text

    assert (figures["ready"], figures["leased"], figures["demand"], figures["parked"]) == (0, 0, 0, 3)
    assert 'abada_dependency_up{kind="model",name="gemini-m"} 0.0' in text
    assert 'abada_dependency_held_tasks{kind="model",name="gemini-m"} 3.0' in text
    assert 'abada_tasks_parked{topic="abada:agent"} 3.0' in text

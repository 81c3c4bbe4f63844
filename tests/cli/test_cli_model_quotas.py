"""`abada topics` with model quotas: calls admitted, waiting and refused per model."""

from __future__ import annotations

import grpc
import pytest
from cli_support import abada
from engine_helpers import append, deploy, fetch, start

ONE_A_MINUTE = """
models:
  - { name: slow-model, provider: gemini, requests_per_minute: 1 }
processes:
  - id: quoted
    start: think
    nodes:
      - { id: think, type: agent, model: slow-model, prompt: p, result_variable: r, next: done }
      - { id: done, type: end }
"""


async def test_topics_show_calls_admitted_waiting_and_refused_per_model(engine):
    await deploy(engine, ONE_A_MINUTE)
    for _ in range(2):
        await start(engine, "quoted")
    first, second = await fetch(engine, "w", "abada:agent", max_tasks=2)
    await append(engine, first, 1, "MODEL_CALL", "STARTED", request={"turn": 0})
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await append(engine, second, 1, "MODEL_CALL", "STARTED", request={"turn": 0})
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    ran = await abada(engine.address, "topics")
    assert ran.exit_code == 0, ran.stderr
    topics, models = ran.stdout.split("\n\n")
    (topic_row,) = topics.splitlines()[1:]
    # Both tasks are leased; the one waiting for quota is not demand for more pods.
    assert topic_row.split()[:8] == ["abada:agent", "0", "2", "0", "1", "(1", "waiting", "for"]
    header, model_row = models.splitlines()
    assert header.split()[:4] == ["MODEL", "ADMITTED", "(LAST", "MINUTE)"]
    cells = model_row.split()
    assert cells[0] == "slow-model" and cells[1] == "1" and cells[3] == "1"
    assert int(cells[4]) >= 1

    as_json = (await abada(engine.address, "topics", "-o", "json")).json()
    (model,) = as_json["models"]
    assert (model["name"], model["admitted"], model["waiting"]) == ("slow-model", 1, 1)

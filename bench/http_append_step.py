"""AppendStep over HTTP/JSON against AppendStep over gRPC, on one engine in one run.

8 concurrent tasks journal STARTED+COMPLETED model-call pairs over gRPC (as append_step.py does) and
over the engine's HTTP port (POST /v1/external-tasks/{task_id}/steps, camelCase JSON, the same
payloads, one keep-alive connection a task), in short rounds taking turns, so that a change of load
on the machine during the run falls on both sides; the ratio is HTTP's rate over gRPC's.
The engine's CPU time per call is measured on both sides too: on a small machine the load generator
shares the cores with the engine, and that figure is the server's cost alone.

The HTTP load comes from a lean HTTP/1.1 client (below, asyncio streams), as wrk or curl would send it:
a full-featured Python client spends about twice the gRPC client's CPU per call, which on two cores
is taken from the engine and would measure the client, not the HTTP side.

    python bench/http_append_step.py --tasks 8 --pairs 200
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import append_step
import httpx2
from abada.engine.v1 import definition_pb2, definition_pb2_grpc, process_pb2, process_pb2_grpc
from common import EngineProcess, engine_process, median, percentile, scratch_database

REQUEST = {"turn": 0, "model": "bench-model", "contents": "x" * 200}
RESPONSE = {"text": "y" * 300, "finishReason": "STOP"}


async def run_http(engine: EngineProcess, tasks: int, pairs: int) -> dict[str, object]:
    async with engine.channel() as channel:
        await definition_pb2_grpc.DefinitionServiceStub(channel).Deploy(
            definition_pb2.DeployRequest(source_name="bench.yaml", content=append_step.BUNDLE)
        )
        processes = process_pb2_grpc.ProcessServiceStub(channel)
        for _ in range(tasks):
            await processes.StartInstance(process_pb2.StartInstanceRequest(process_id="bench"))
    async with httpx2.AsyncClient(
        base_url=f"http://{engine.http_address}",
        headers={"Authorization": f"Bearer {engine.token}"},
        limits=httpx2.Limits(max_connections=tasks, max_keepalive_connections=tasks),
        timeout=30,
    ) as client:
        fetched = await client.post(
            "/v1/external-tasks:fetchAndLock",
            json={
                "workerId": "bench",
                "maxTasks": tasks,
                "topics": [{"name": "abada:agent", "leaseMs": 600_000}],
            },
        )
        locked = fetched.json()["tasks"]
    latencies: list[float] = []
    host, _, port = engine.http_address.rpartition(":")

    async def journal(task: dict[str, object]) -> None:
        path = f"/v1/external-tasks/{task['id']}/steps"
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            for sequence in range(1, pairs + 1):
                for state, extra in (
                    ("STARTED", {"request": REQUEST}),
                    ("COMPLETED", {"response": RESPONSE, "tokens": {"inputTokens": 50, "outputTokens": 20}}),
                ):
                    body = {
                        "workerId": "bench",
                        "leaseToken": task["leaseToken"],
                        "attempt": task["attempt"],
                        "sequence": sequence,
                        "kind": "MODEL_CALL",
                        "state": state,
                        **extra,
                    }
                    began = time.perf_counter()
                    status, answer = await _post(reader, writer, engine, path, json.dumps(body).encode())
                    latencies.append(time.perf_counter() - began)
                    if status != 200:
                        raise RuntimeError(f"AppendStep over HTTP: {status} {answer[:300]!r}")
        finally:
            writer.close()

    began = time.perf_counter()
    await asyncio.gather(*(journal(t) for t in locked))
    elapsed = time.perf_counter() - began
    return {"calls": len(latencies), "elapsed": elapsed, "latencies": latencies}


async def _post(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, engine: EngineProcess, path: str, body: bytes
) -> tuple[int, bytes]:
    """One POST on a kept-alive connection; the status and the body of the answer."""
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: {engine.http_address}\r\nAuthorization: Bearer {engine.token}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    length = next(int(line.split(":", 1)[1]) for line in lines if line.lower().startswith("content-length:"))
    return int(lines[0].split()[1]), await reader.readexactly(length)


def measure(tasks: int, pairs: int, rounds: int = 4) -> dict[str, float]:
    """`rounds` short rounds a side, gRPC and HTTP taking turns, so that other load on the machine
    (a shared VM's neighbours) falls on both sides alike; each side's rate is its calls over its time."""
    each = max(1, pairs // rounds)
    sides: dict[str, dict[str, list[float]]] = {
        side: {"calls": [], "elapsed": [], "latencies": [], "cpu": []} for side in ("grpc", "http")
    }
    with scratch_database() as url, engine_process(url) as engine:
        for _ in range(rounds):
            for side, run in (("grpc", append_step.run), ("http", run_http)):
                cpu = engine.cpu_seconds()
                result = asyncio.run(run(engine, tasks, each))  # type: ignore[operator]
                figures = sides[side]
                figures["cpu"].append(engine.cpu_seconds() - cpu)
                figures["calls"].append(result["calls"])
                figures["elapsed"].append(result["elapsed"])
                figures["latencies"] += result["latencies"]
    rate = {side: sum(f["calls"]) / sum(f["elapsed"]) for side, f in sides.items()}
    return {
        "http_rate": rate["http"],
        "grpc_rate": rate["grpc"],
        "ratio": rate["http"] / rate["grpc"],
        "http_p50": percentile(sides["http"]["latencies"], 0.5),
        "http_p99": percentile(sides["http"]["latencies"], 0.99),
        "grpc_p50": percentile(sides["grpc"]["latencies"], 0.5),
        "grpc_p99": percentile(sides["grpc"]["latencies"], 0.99),
        # Engine CPU per call (each round's set-up included, the same on both sides).
        "cpu_http": sum(sides["http"]["cpu"]) / sum(sides["http"]["calls"]),
        "cpu_grpc": sum(sides["grpc"]["cpu"]) / sum(sides["grpc"]["calls"]),
        "rounds": rounds,
    }


def report(figures: dict[str, float], tasks: int) -> None:
    print(
        f"AppendStep over HTTP/JSON: {figures['http_rate']:,.0f} calls/s (p50 {figures['http_p50'] * 1000:.2f} ms, "
        f"p99 {figures['http_p99'] * 1000:.2f} ms; {tasks} concurrent tasks)"
    )
    print(
        f"AppendStep over gRPC:      {figures['grpc_rate']:,.0f} calls/s (p50 {figures['grpc_p50'] * 1000:.2f} ms, "
        f"p99 {figures['grpc_p99'] * 1000:.2f} ms; {figures['rounds']:.0f} rounds a side, taking turns)"
    )
    print(
        f"engine CPU per call:       {figures['cpu_http'] * 1e6:,.0f} us over HTTP, "
        f"{figures['cpu_grpc'] * 1e6:,.0f} us over gRPC"
    )
    print(f"HTTP / gRPC:               {figures['ratio']:.2f}  (target >= 0.7)")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--pairs", type=int, default=200)
    parser.add_argument("--runs", type=int, default=1, help="repeat, and print the median ratio")
    args = parser.parse_args()
    ratios = []
    for _ in range(args.runs):
        figures = measure(args.tasks, args.pairs)
        report(figures, args.tasks)
        ratios.append(figures["ratio"])
    if args.runs > 1:
        print(f"median HTTP / gRPC over {args.runs} runs: {median(ratios):.2f}")


if __name__ == "__main__":
    main()

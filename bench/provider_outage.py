"""A 30 s provider outage with 1,000 instances in flight: what the engine spends and what the provider sees.

Two windows of the same length, each on a fresh stack of real processes (engine, broker, the demo
CRM, the scripted Gemini endpoint, 2 agent workers at concurrency 50) with 1,000 instances of Alice's
triage started and the workers busy: one with the provider answering, one with it answering 503 to
everything. For each: the engine's CPU seconds in the window and the requests the provider received.
Target: during the outage, at most 1 request a second in total (probes, not 1,000 tasks' retries).

    python bench/provider_outage.py --instances 1000 --seconds 30
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The fault drills' stack, and the shared test helpers it builds on (tests/engine_helpers.py).
sys.path[:0] = [str(ROOT / "tests" / "faults"), str(ROOT / "tests")]

import psutil  # noqa: E402
from common import scratch_database  # noqa: E402
from crm_mcp.testing import running_crm_server  # noqa: E402
from fault_stack import alice_script, running_stack, start_instances, wait_for  # noqa: E402
from scripted_gemini.testing import fetch_calls, running_scripted_gemini, set_outage  # noqa: E402

WORKERS = 2
CONCURRENCY = 50
# Each turn takes this long: 100 tasks at work keep the rest of the 1,000 waiting through the window.
TURN_DELAY_MS = 2_000
RAMP_SECONDS = 5.0


@dataclass(frozen=True)
class Window:
    engine_cpu_seconds: float
    provider_requests: int
    finished_instances: int


async def window(url: str, instances: int, seconds: float, outage: bool) -> Window:
    with (
        tempfile.TemporaryDirectory(prefix="abada-outage-") as state,
        running_crm_server() as crm,
        running_scripted_gemini(alice_script()) as gemini_url,
    ):
        async with running_stack(
            pathlib.Path(state), url, crm, gemini_url, script=alice_script(TURN_DELAY_MS)
        ) as stack:
            async with stack.engine.channel() as channel:
                await start_instances(channel, "outage-bench", instances)
            for index in range(WORKERS):
                stack.add_worker(f"w{index}", concurrency=CONCURRENCY)
            await wait_for(
                lambda: len(fetch_calls(gemini_url)["calls"]) >= CONCURRENCY, "the workers busy", 120
            )
            await asyncio.sleep(RAMP_SECONDS)
            assert stack.engine.service.process is not None
            engine = psutil.Process(stack.engine.service.process.pid)
            tickets_before = len(crm.tickets())
            if outage:
                set_outage(gemini_url, 503)
            began_cpu, began = _cpu(engine), time.time()
            await asyncio.sleep(seconds)
            spent, ended = _cpu(engine) - began_cpu, time.time()
            if outage:
                set_outage(gemini_url, 0)
            requests = sum(1 for call in fetch_calls(gemini_url)["calls"] if began <= call["time"] <= ended)
            return Window(spent, requests, len(crm.tickets()) - tickets_before)


def _cpu(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


def measure(instances: int = 1000, seconds: float = 30.0) -> dict[str, float]:
    with scratch_database() as url:
        calm = asyncio.run(window(url, instances, seconds, outage=False))
    with scratch_database() as url:
        down = asyncio.run(window(url, instances, seconds, outage=True))
    return {
        "seconds": seconds,
        "outage_requests": down.provider_requests,
        "outage_rate": down.provider_requests / seconds,
        "outage_engine_cpu": down.engine_cpu_seconds,
        "calm_requests": calm.provider_requests,
        "calm_engine_cpu": calm.engine_cpu_seconds,
        "calm_tickets": calm.finished_instances,
    }


def report(figures: dict[str, float], instances: int) -> None:
    seconds = figures["seconds"]
    print(
        f"provider outage, {instances:,} instances in flight, {seconds:.0f} s window: "
        f"provider requests {figures['outage_requests']:.0f} ({figures['outage_rate']:.2f}/s) vs "
        f"{figures['calm_requests']:.0f} answering; engine CPU {figures['outage_engine_cpu']:.1f} s vs "
        f"{figures['calm_engine_cpu']:.1f} s answering ({figures['calm_tickets']:.0f} tickets made then)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--instances", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args()
    report(measure(args.instances, args.seconds), args.instances)


if __name__ == "__main__":
    main()

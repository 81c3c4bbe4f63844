"""`make bench`: every benchmark against its target, with the peer measured in the same run, as one table.

Each benchmark runs --runs times (default 3) and the table shows the median; a few minutes in all,
then once the timers rows (timers.py: 100,000 timers due within a minute on 2 replicas, about four
minutes), once the retention rows (retention.py: ABADA_BENCH_RETENTION_ROWS journal rows, default
10 million, deleted beside task cycles), and then once the volume row (volume.py): filling
ABADA_BENCH_VOLUME finished instances (default 1,000,000; half an hour or so on a small machine) and
every figure beside them.

    python bench/summary.py --runs 3
"""

from __future__ import annotations

import argparse
import os
import sys

import append_step
import fan_out
import http_append_step
import many_in_flight
import provider_outage
import quota_admission
import retention
import schema_stall
import start_instance
import task_cycle
import timers
import volume
from common import median


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--instances", type=int, default=5000, help="task cycles: N")
    parser.add_argument("--in-flight", type=int, default=10_000, help="many in flight: the high level")
    parser.add_argument(
        "--fan-out-items", type=int, default=10_000, help="fan-out: items, and separate instances"
    )
    args = parser.parse_args()
    cycles, appends, flights, quotas, starts, stalls, fans = [], [], [], [], [], [], []
    over_http: list[dict[str, float]] = []
    for run in range(1, args.runs + 1):
        print(f"== run {run} of {args.runs}")
        cycles.append(task_cycle.measure(args.instances, 8, 16))
        task_cycle.report(cycles[-1], args.instances, 8, 16)
        appends.append(append_step.measure(8, 200))
        append_step.report(appends[-1], 8)
        over_http.append(http_append_step.measure(8, 200))
        http_append_step.report(over_http[-1], 8)
        levels = [100, args.in_flight]
        flights.append(many_in_flight.measure(levels, 1000))
        many_in_flight.report(flights[-1], levels)
        starts.append(start_instance.measure(3000))
        start_instance.report(starts[-1])
        quotas.append(quota_admission.measure(32, 60))
        quota_admission.report(quotas[-1], 32)
        stalls.append(schema_stall.measure(6, 300))
        schema_stall.report(stalls[-1], 6)
        fans.append(fan_out.measure(args.fan_out_items, 8, 8, 64))
        fan_out.report(fans[-1], args.fan_out_items, 8, 8, 64)
        sys.stdout.flush()

    # Once, not per run: two stacks of real processes and two 30 s windows.
    print("== a 30 s provider outage with 1,000 instances in flight (provider_outage.py)")
    outage = provider_outage.measure(1000, 30.0)
    provider_outage.report(outage, 1000)

    # Once: 100,000 timers take a minute to come due, after the minute or so it takes to set them.
    print("== 100,000 timers due within one minute on 2 replicas (timers.py)")
    fired = timers.measure(100_000, 60.0)
    timers.report(fired, 100_000, 60.0)

    # Once: filling ABADA_BENCH_RETENTION_ROWS journal rows (default 10 million) takes a few minutes.
    journal_rows = int(os.environ.get("ABADA_BENCH_RETENTION_ROWS", "10000000"))
    print(f"== the retention job beside {journal_rows:,} journal rows and live task cycles (retention.py)")
    deleting = retention.measure(journal_rows)
    retention.report(deleting, journal_rows)

    # Once: filling ABADA_BENCH_VOLUME finished instances (default 1,000,000) takes a while.
    size = volume.volume_from_env()
    print(f"== every figure on an empty database and beside {size:,} finished instances (volume.py)")
    at_volume = volume.measure(size, volume.cycles_from_env())
    volume.report(at_volume, size)

    def m(rows: list[dict[str, float]], key: str) -> float:
        return median([row[key] for row in rows])

    low, high = 100, args.in_flight
    fetch_p50 = median([f[f"fetch_p50@{high}"] / f[f"fetch_p50@{low}"] for f in flights])
    fetch_p99 = median([f[f"fetch_p99@{high}"] / f[f"fetch_p99@{low}"] for f in flights])
    complete_p50 = median([f[f"complete_p50@{high}"] / f[f"complete_p50@{low}"] for f in flights])
    rows = [
        (
            "task cycles / pgqueuer 1.6 (N=5000, K=8; peer 8 consumers, batch 4)",
            f"{m(cycles, 'rate'):,.0f}/s vs {m(cycles, 'peer'):,.0f}/s = {m(cycles, 'ratio'):.2f}x",
            ">= 1.0x",
            m(cycles, "ratio") >= 1.0,
        ),
        (
            "  the same, each batch back in one CompleteTasks (N=5000 more)",
            f"{m(cycles, 'batched_rate'):,.0f}/s vs {m(cycles, 'peer'):,.0f}/s = {m(cycles, 'batched_ratio'):.2f}x",
            ">= 1.0x",
            m(cycles, "batched_ratio") >= 1.0,
        ),
        (
            "AppendStep / bare gRPC (8 tasks)",
            f"{m(appends, 'rate'):,.0f}/s vs {m(appends, 'bare_grpc'):,.0f}/s = {m(appends, 'ratio'):.2f}x",
            ">= 0.5x",
            m(appends, "ratio") >= 0.5,
        ),
        (
            "  the same steps through the agent worker's client (AppendSteps)",
            f"{m(appends, 'batched_rate'):,.0f}/s vs {m(appends, 'bare_grpc'):,.0f}/s = "
            f"{m(appends, 'batched_ratio'):.2f}x",
            ">= 0.5x",
            m(appends, "batched_ratio") >= 0.5,
        ),
        (
            "AppendStep over HTTP/JSON / over gRPC, same engine and run (8 tasks)",
            f"{m(over_http, 'http_rate'):,.0f}/s vs {m(over_http, 'grpc_rate'):,.0f}/s = {m(over_http, 'ratio'):.2f}x "
            f"(engine CPU {m(over_http, 'cpu_http') * 1e6:,.0f} vs {m(over_http, 'cpu_grpc') * 1e6:,.0f} us a call)",
            ">= 0.7x",
            m(over_http, "ratio") >= 0.7,
        ),
        (
            f"FetchAndLock p50 at {high:,} / at {low} in flight",
            f"{m(flights, f'fetch_p50@{high}') * 1000:.2f} / {m(flights, f'fetch_p50@{low}') * 1000:.2f} ms"
            f" = {fetch_p50:.2f}x",
            "<= 1.5x",
            fetch_p50 <= 1.5,
        ),
        (
            f"FetchAndLock p99 at {high:,} / at {low} in flight",
            f"{m(flights, f'fetch_p99@{high}') * 1000:.2f} / {m(flights, f'fetch_p99@{low}') * 1000:.2f} ms"
            f" = {fetch_p99:.2f}x",
            "<= 1.5x",
            fetch_p99 <= 1.5,
        ),
        (
            f"Complete p50 at {high:,} / at {low} in flight",
            f"{m(flights, f'complete_p50@{high}') * 1000:.2f} / {m(flights, f'complete_p50@{low}') * 1000:.2f} ms"
            f" = {complete_p50:.2f}x (p99 at {high:,}: {m(flights, f'complete_p99@{high}') * 1000:.2f} ms)",
            "<= 1.5x",
            complete_p50 <= 1.5,
        ),
        (
            "StartInstance at 8 callers (start_instance.py; vs bare gRPC)",
            f"{m(starts, 'rate'):,.0f}/s vs {m(starts, 'bare_grpc'):,.0f}/s = {m(starts, 'ratio'):.2f}x",
            ">= 1,500/s",
            m(starts, "rate") >= 1500,
        ),
        (
            f"StartInstance at 8 callers, filling to {high:,} in flight",
            f"{m(flights, 'start_rate'):,.0f}/s",
            ">= 1,500/s",
            m(flights, "start_rate") >= 1500,
        ),
        (
            "model calls admitted under a quota, 2 engine replicas (32 tasks)",
            f"{m(quotas, 'rate'):,.0f}/s; without quota {m(quotas, 'peer'):,.0f}/s = {m(quotas, 'ratio'):.2f}x; "
            f"admission alone {m(quotas, 'ceiling'):,.0f}/s",
            ">= 1,000/s",
            m(quotas, "rate") >= 1000,
        ),
        (
            "  the same through 2 agent workers' clients (AppendSteps)",
            f"{m(quotas, 'worker_rate'):,.0f}/s",
            ">= 1,000/s",
            m(quotas, "worker_rate") >= 1000,
        ),
        (
            "provider requests in a 30 s outage, 1,000 instances in flight (engine CPU, answering)",
            f"{outage['outage_rate']:.2f}/s ({outage['outage_requests']:.0f}; engine {outage['outage_engine_cpu']:.1f} s) "
            f"vs {outage['calm_requests']:.0f} (engine {outage['calm_engine_cpu']:.1f} s)",
            "<= 1/s",
            outage["outage_rate"] <= 1.0,
        ),
        *(
            (f"at {size:,} finished / empty: {name}", f"{full} vs {empty} = {ratio}", target, met)
            for name, empty, full, ratio, target, met in volume.verdicts(at_volume)
            if met is not None
        ),
        (
            "another tenant's Complete p99, 6 x 4,000-item uniqueItems outputs in flight (schema_stall.py)",
            f"{m(stalls, 'p99') * 1000:.2f} ms (p50 {m(stalls, 'p50') * 1000:.2f}); "
            f"alone {m(stalls, 'alone_p99') * 1000:.2f} ms (p50 {m(stalls, 'alone_p50') * 1000:.2f})",
            "< 100 ms",
            m(stalls, "p99") < 0.100,
        ),
        (
            f"one instance fanning out to {args.fan_out_items:,} service items / {args.fan_out_items:,} "
            "separate instances, 8 SDK workers (fan_out.py)",
            f"{m(fans, 'fan_out_rate'):,.0f}/s vs {m(fans, 'single_rate'):,.0f}/s = {m(fans, 'ratio'):.2f}x",
            ">= 0.8x",
            m(fans, "ratio") >= 0.8,
        ),
        (
            "  the last item's completion (the join) / single completions' p99",
            f"{m(fans, 'last') * 1000:.2f} / {m(fans, 'single_p99') * 1000:.2f} ms = {m(fans, 'join_ratio'):.2f}x",
            "<= 1.5x",
            m(fans, "join_ratio") <= 1.5,
        ),
        (
            "100,000 timers due within 1 min, 2 replicas: p99 lateness (timers.py)",
            f"{fired['late_p99'] * 1000:.0f} ms (p50 {fired['late_p50'] * 1000:.0f}; "
            f"{fired['fired']:,.0f} fired, {fired['fired_twice']:.0f} twice)",
            "<= 1 s",
            fired["late_p99"] <= 1.0 and fired["fired"] == fired["timers"] and fired["fired_twice"] == 0,
        ),
        (
            "  FetchAndLock p99 while they fire / without them",
            f"{fired['fetch_p99'] * 1000:.2f} / {fired['peer_fetch_p99'] * 1000:.2f} ms = {fired['fetch_ratio']:.2f}x",
            "<= 1.5x",
            fired["fetch_ratio"] <= 1.5,
        ),
        (
            f"retention beside {journal_rows:,} journal rows: rows deleted (retention.py)",
            f"{deleting['rows_per_second']:,.0f}/s ({deleting['journal_rows_per_second']:,.0f} journal rows/s)",
            ">= 20,000/s",
            deleting["rows_per_second"] >= 20_000,
        ),
        (
            "  task cycles alone / beside the job",
            f"{deleting['cycles_alone']:,.0f} / {deleting['cycles_beside']:,.0f}/s = {deleting['slowdown']:.2f}x",
            "<= 1.2x",
            deleting["slowdown"] <= 1.2,
        ),
        (
            "context: raw single-row commits, 8 connections",
            f"{m(cycles, 'raw'):,.0f}/s",
            "",
            None,
        ),
    ]
    width = max(len(r[0]) for r in rows)
    value_width = max(len(r[1]) for r in rows)
    print(f"\n== summary, medians of {args.runs} runs (peers measured in the same runs)")
    print(f"{'benchmark':<{width}}  {'figure':<{value_width}}  {'target':<10}  met")
    for name, value, target, met in rows:
        verdict = "" if met is None else ("yes" if met else "NO")
        print(f"{name:<{width}}  {value:<{value_width}}  {target:<10}  {verdict}")


if __name__ == "__main__":
    main()

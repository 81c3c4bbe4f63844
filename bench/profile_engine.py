"""Where the engine's time goes under load: py-spy samples the engine process while a benchmark runs.

    python bench/profile_engine.py task_cycle --seconds 20
    python bench/profile_engine.py task_cycle_batched --seconds 20
    python bench/profile_engine.py append_step --seconds 20
    python bench/profile_engine.py start_instance --seconds 20

Prints the engine's CPU use, the share of samples spent in each layer (inclusive) and the top
functions by own time. Needs py-spy (bench/requirements.txt).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import append_step
import psutil
import start_instance
import task_cycle
from common import engine_process, scratch_database

# (label, substring of a frame) — a sample counts once per label if any frame matches.
LAYERS = [
    ("gRPC server machinery (grpc/_cython, aio)", "grpc/"),
    ("protobuf <-> JSON (api/convert, struct)", "convert.py"),
    ("asyncpg", "asyncpg/"),
    ("SQLAlchemy", "sqlalchemy/"),
    ("store (typed rows, statements)", "abada_engine/store/"),
    ("journal sealing (AES-GCM, HMAC)", "sealing.py"),
    ("json.dumps / loads", "json/"),
    ("authentication (guard, callers)", "guard.py"),
    ("definitions catalog", "catalog.py"),
    ("model quotas (admission lines, settlement)", "model_quota"),
    ("event loop (asyncio base_events / uvloop)", "base_events.py"),
]


def _workload(kind: str, engine, stop: threading.Event) -> None:  # type: ignore[no-untyped-def]
    while not stop.is_set():
        if kind in ("task_cycle", "task_cycle_batched"):
            asyncio.run(task_cycle.create_instances(engine, 1500))
            asyncio.run(task_cycle.run_workers(engine, 1500, 8, 16, batched=kind == "task_cycle_batched"))
        elif kind == "start_instance":
            asyncio.run(start_instance.run(engine, 1000))
        else:
            asyncio.run(append_step.run(engine, 8, 100))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "workload", choices=["task_cycle", "task_cycle_batched", "append_step", "start_instance"]
    )
    parser.add_argument("--seconds", type=int, default=20)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    spy = shutil.which("py-spy") or str(pathlib.Path(sys.executable).parent / "py-spy")
    with scratch_database() as url, engine_process(url) as engine, tempfile.TemporaryDirectory() as out:
        stop = threading.Event()
        load = threading.Thread(target=_workload, args=(args.workload, engine, stop), daemon=True)
        load.start()
        time.sleep(3)  # past start-up and the first statements' preparation
        raw = pathlib.Path(out) / "engine.txt"
        process = psutil.Process(engine.process.pid)
        process.cpu_percent()
        subprocess.run(
            [
                spy,
                "record",
                "-p",
                str(engine.process.pid),
                "-f",
                "raw",
                "-o",
                str(raw),
                "-d",
                str(args.seconds),
                "-r",
                "200",
            ],
            check=True,
            capture_output=True,
        )
        cpu = process.cpu_percent()
        stop.set()
        load.join(timeout=120)
        raw_text = raw.read_text()
    print(f"engine CPU while sampled: {cpu:.0f}% of one core")
    print(summarize(raw_text, args.top))


def summarize(raw: str, top: int = 25) -> str:
    """py-spy's raw output (one `frame;frame;... count` line a stack) as the share of samples in each
    layer (inclusive) and the top functions by own time."""
    samples = collections.Counter[str]()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack:
            samples[stack] += int(count)
    total = max(1, sum(samples.values()))
    lines = [f"{total} samples"]
    for label, marker in LAYERS:
        hit = sum(n for stack, n in samples.items() if marker in stack)
        lines.append(f"  {label:<45} {100 * hit / total:5.1f}%")
    own = collections.Counter[str]()
    for stack, n in samples.items():
        own[stack.split(";")[-1]] += n
    inclusive = collections.Counter[str]()
    for stack, n in samples.items():
        for frame in set(stack.split(";")):
            if "abada_engine/" in frame:
                inclusive[frame] += n
    lines.append(f"top {top} engine functions, inclusive:")
    for frame, n in inclusive.most_common(top):
        lines.append(f"  {100 * n / total:5.1f}%  {frame[:150]}")
    lines.append(f"top {top} functions by own time:")
    for frame, n in own.most_common(top):
        lines.append(f"  {100 * n / total:5.1f}%  {frame[:150]}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

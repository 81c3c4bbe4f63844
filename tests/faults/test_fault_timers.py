"""Due times survive the engine: a timer set before a SIGKILL fires once, on time, after the restart;
two engine replicas on one database fire 10,000 timers due within the same 10 s each exactly once and
none early; the due-time process, killed, is replaced and its timers fire once, on time, and it never
outlives its engine.

How long a restart takes depends on the machine (on a loaded 2-core one, with the suite beside it, a
fresh engine and its niced due-time process have taken more than ten seconds to come back). So the
restart drills set timers a few seconds apart over half a minute, read from the engine's log when its
due-time process was ready again, and hold every timer due after that moment to its time; a timer due
while nothing could fire it is held to firing once, not early."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
import signal
import time
from datetime import UTC, datetime, timedelta

import asyncpg
from abada.engine.v1 import process_pb2, process_pb2_grpc
from fault_stack import Engine, deploy, engine_service, wait_for
from google.protobuf import struct_pb2

TIMERS = """
processes:
  - id: pause_until
    start: wait
    nodes:
      - { id: wait, type: timer, until: "${at}", next: done }
      - { id: done, type: end }
"""


async def _fired(database_url: str) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(database_url)
    try:
        return await conn.fetch(
            "SELECT i.id, i.state, t.due_at, t.fired_at, "
            "(SELECT count(*) FROM history h WHERE h.instance_id = i.id AND h.type = 'TIMER_FIRED') AS fired "
            "FROM instances i JOIN timers t ON t.instance_id = i.id"
        )
    finally:
        await conn.close()


async def _started_engine(state: pathlib.Path, database_url: str) -> Engine:
    credentials = state / "credentials.yaml"
    credentials.write_text("{}\n")
    engine = engine_service(state, database_url, credentials)
    engine.service.env["ABADA_LOG_LEVEL"] = "INFO"  # for the due-time process's "ready"
    await engine.start()
    return engine


async def _due_time_process(serving: int) -> int:
    """The pid of the due-time process of the engine `serving`, once started."""
    [child] = await wait_for(lambda: _due_time_processes(serving), "the due-time process", timeout=10)
    return int(child)


# Seconds from the start of a drill to each of its timers.
STAGGERED_SECONDS = (8, 13, 18, 24, 30)
READY = "due-time process ready"


async def _paused_at_staggered_times(engine: Engine) -> list[str]:
    """One instance of `pause_until` for each of `STAGGERED_SECONDS`."""
    now = datetime.now(UTC)
    async with engine.channel() as channel:
        await deploy(channel, TIMERS)
        stub = process_pb2_grpc.ProcessServiceStub(channel)
        ids = []
        for seconds in STAGGERED_SECONDS:
            variables = struct_pb2.Struct()
            variables.update({"at": (now + timedelta(seconds=seconds)).isoformat()})
            request = process_pb2.StartInstanceRequest(process_id="pause_until", variables=variables)
            ids.append((await stub.StartInstance(request, timeout=10)).instance.id)
        return ids


def _ready_times(engine: Engine) -> list[datetime]:
    """When each due-time process of `engine` said it was ready, from the engine's log."""
    if not engine.service.log.exists():
        return []
    times = []
    for line in engine.service.log.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            entry = json.loads(line)
            if isinstance(entry, dict) and entry.get("message") == READY:
                times.append(datetime.fromisoformat(entry["time"]))
    return times


async def _ready_again(engine: Engine, before: int) -> datetime:
    """When a due-time process came up after the `before` that the log told of already."""
    times = await wait_for(
        lambda: _ready_times(engine)[before:],
        "a due-time process ready again",
        timeout=max(STAGGERED_SECONDS),
    )
    return times[0]


async def _each_fired_once_on_time(database_url: str, ids: list[str], back: datetime) -> None:
    """Each timer fired once and never early; each one due after the due-time process was `back`, on time."""
    await wait_for(
        lambda: _all_completed(database_url, len(ids)),
        "every timer fired",
        timeout=max(STAGGERED_SECONDS) + 20,
        interval=0.2,
    )
    rows = await _fired(database_url)
    assert sorted(str(r["id"]) for r in rows) == sorted(ids)
    assert all(r["fired"] == 1 for r in rows)
    assert all(r["fired_at"] >= r["due_at"] for r in rows)
    due_after_the_return = [r for r in rows if r["due_at"] > back]
    assert due_after_the_return, f"the due-time process was back only at {back}, after every timer was due"
    for row in due_after_the_return:
        assert row["fired_at"] - row["due_at"] < timedelta(seconds=1)


async def test_a_timer_set_before_a_sigkill_fires_once_on_time_after_the_restart(tmp_path, shared_database):
    engine = await _started_engine(tmp_path, shared_database)
    try:
        await _ready_again(engine, before=0)
        ids = await _paused_at_staggered_times(engine)
        engine.kill()
        await engine.start()
        back = await _ready_again(engine, before=1)
        await _each_fired_once_on_time(shared_database, ids, back)
    finally:
        engine.service.stop()


async def _all_completed(database_url: str, count: int) -> bool:
    rows = await _fired(database_url)
    return len(rows) == count and all(r["state"] == "COMPLETED" for r in rows)


TWO_REPLICAS = 10_000
WINDOW_SECONDS = 10.0
# Setting 10,000 timers has taken 23 s on a loaded 2-core machine; the window opens after that.
WINDOW_OPENS_SECONDS = 35.0


async def test_two_replicas_fire_ten_thousand_timers_each_exactly_once(tmp_path, shared_database):
    credentials = tmp_path / "credentials.yaml"
    credentials.write_text("{}\n")
    for path in (tmp_path / "a", tmp_path / "b"):
        path.mkdir()
    first = engine_service(tmp_path / "a", shared_database, credentials)
    second = engine_service(tmp_path / "b", shared_database, credentials)
    await first.start()
    await second.start()  # after the first, which migrated the database
    try:
        async with first.channel() as one, second.channel() as two:
            await deploy(one, TIMERS)
            stubs = [process_pb2_grpc.ProcessServiceStub(one), process_pb2_grpc.ProcessServiceStub(two)]
            window_opens = datetime.now(UTC) + timedelta(seconds=WINDOW_OPENS_SECONDS)

            async def start(number: int) -> None:
                at = window_opens + timedelta(seconds=WINDOW_SECONDS * number / TWO_REPLICAS)
                variables = struct_pb2.Struct()
                variables.update({"at": at.isoformat()})
                await stubs[number % 2].StartInstance(
                    process_pb2.StartInstanceRequest(process_id="pause_until", variables=variables),
                    timeout=30,
                )

            started = time.monotonic()
            for batch in range(0, TWO_REPLICAS, 200):
                await asyncio.gather(*(start(n) for n in range(batch, min(batch + 200, TWO_REPLICAS))))
            print(f"\n{TWO_REPLICAS} timers set in {time.monotonic() - started:.1f}s")
            assert datetime.now(UTC) < window_opens, "the timers were not all set before the window opened"
        await wait_for(
            lambda: _all_completed(shared_database, TWO_REPLICAS),
            "every timer fired",
            timeout=WINDOW_OPENS_SECONDS + WINDOW_SECONDS + 20,
            interval=0.5,
        )
        rows = await _fired(shared_database)
        assert len(rows) == TWO_REPLICAS
        assert {r["fired"] for r in rows} == {1}
        lateness = sorted((r["fired_at"] - r["due_at"]).total_seconds() for r in rows)
        # How late is the benchmark's question (bench/timers.py, on a quiet machine); never early is this one's.
        p99 = lateness[int(len(lateness) * 0.99)]
        print(f"lateness p50 {lateness[len(lateness) // 2]:.3f}s p99 {p99:.3f}s max {lateness[-1]:.3f}s")
        assert lateness[0] >= 0
    finally:
        first.service.stop()
        second.service.stop()


def _due_time_processes(parent: int | None = None) -> list[int]:
    """The pids of running due-time processes (`abada-engine fire-due-times`), of `parent` if given."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = pathlib.Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            stat = pathlib.Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # The parent pid is the 2nd field after the command name, which is in parentheses.
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if b"fire-due-times" in argv and (parent is None or ppid == parent):
            found.append(int(entry))
    return found


async def test_a_killed_due_time_process_is_replaced_and_its_timers_fire_once_on_time(
    tmp_path, shared_database
):
    engine = await _started_engine(tmp_path, shared_database)
    assert engine.service.process is not None
    serving = engine.service.process.pid
    try:
        child = await _due_time_process(serving)
        # Below the serving process in CPU priority (once started): the calls come first when the CPU is short.
        await wait_for(
            lambda: os.getpriority(os.PRIO_PROCESS, child) - os.getpriority(os.PRIO_PROCESS, serving) == 10,
            "the due-time process niced 10 below its engine",
            timeout=10,
        )
        await _ready_again(engine, before=0)
        ids = await _paused_at_staggered_times(engine)
        os.kill(child, signal.SIGKILL)
        back = await _ready_again(engine, before=1)
        await _each_fired_once_on_time(shared_database, ids, back)
    finally:
        engine.service.stop()
    assert _due_time_processes(serving) == [], "a stopped engine left its due-time process running"


async def test_an_engine_killed_outright_leaves_no_due_time_process_behind(tmp_path, shared_database):
    engine = await _started_engine(tmp_path, shared_database)
    assert engine.service.process is not None
    try:
        child = await _due_time_process(engine.service.process.pid)
        engine.kill()
        await wait_for(lambda: child not in _due_time_processes(), "the orphan leaving", timeout=10)
    finally:
        engine.service.stop()

"""Alice's triage end to end with the scripted model, and what the engine's journal adds per agent step.

Starts PostgreSQL, the engine, the credential broker (file backend), the demo CRM MCP server, the
scripted Gemini endpoint and agent worker processes, then in one run:

1. load: N instances of examples/support-triage.yaml on W workers at --concurrency C, every one to
   notify_customer; tasks/s (first start to last arrival), task latency, each worker's peak RSS;
2. journal: the worker's own Journal and EngineClient appending the steps of a real Alice journal
   (taken from phase 1) to leased tasks, timed per AppendStep and per step; next to it a direct
   MCP get_customer loop against the same CRM through the worker's own MCP client stack;
3. memory: ONE worker at --concurrency 50 with more tasks than slots, every model turn slowed down
   so the slots stay full; its peak RSS.

It prints figures and asserts nothing about them: a benchmark, not a test.

    python bench/agent_overhead.py --instances 200 --workers 2 --concurrency 50
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import psutil
import yaml
from abada.engine.v1 import (
    common_pb2,
    definition_pb2,
    definition_pb2_grpc,
    external_task_pb2,
    external_task_pb2_grpc,
    process_pb2,
    process_pb2_grpc,
)
from abada_common.struct_codec import from_struct, to_struct
from abada_sdk.connection import BearerToken
from abada_worker.broker_client import Secret
from abada_worker.conversation import FunctionCall, ModelReply
from abada_worker.engine_client import EngineClient, LeaseRef
from abada_worker.journal import Journal
from abada_worker.step_payloads import model_turn_of
from abada_worker.tool_session import ToolServer
from common import (
    EngineProcess,
    bare_grpc_rate,
    engine_process,
    free_port,
    percentile,
    raw_commit_rate,
    scratch_database,
)
from crm_mcp.testing import RunningCrmServer, running_crm_server
from grpc_health.v1 import health_pb2, health_pb2_grpc
from scripted_gemini.testing import fetch_calls, load_script, reset_calls, running_scripted_gemini

ROOT = pathlib.Path(__file__).resolve().parent.parent
TRIAGE_BUNDLE = ROOT / "examples" / "support-triage.yaml"
TRIAGE_BUNDLE_URL = "http://127.0.0.1:8765/mcp"
TRIAGE_PROCESS = "support_triage"
AGENT_TOPIC = "abada:agent"
NOTIFY_TOPIC = "notify"
# engine_process() gives one caller, "bench", every role; worker ids are "bench/<name>" under it.
POOL = "bench"
MIB = 2**20
LONG_LEASE_MS = 600_000
STARTERS = 8

T = TypeVar("T")

# The probe's own agent node: the CRM bindings of the triage node, limits out of the way of many rounds.
PROBE_BUNDLE = """
tool_servers:
  - name: crm
    transport: streamable-http
    url: {crm_url}
    credential: crm-token
    tools:
      get_customer:  {{ policy: read }}
      create_ticket: {{ policy: write, idempotency: key }}
processes:
  - id: journal_probe
    start: agent
    nodes:
      - id: agent
        type: agent
        model: gemini-3.6-flash
        prompt: Journal probe.
        tools: [crm/get_customer, crm/create_ticket]
        result_variable: answer
        limits: {{ max_model_calls: 100000, max_tool_calls: 100000, max_tokens: 1000000000 }}
        next: done
      - {{ id: done, type: end }}
"""


def slow_triage_script(delay_ms: int) -> dict[str, Any]:
    """Alice's happy path with every model turn held back, so a worker's slots stay full."""
    customer = "{{input.customerId}}"
    return {
        "scripts": [
            {
                "name": "slow_triage",
                "turns": [
                    {
                        "call": {"name": "crm__get_customer", "args": {"customerId": customer}},
                        "delay_ms": delay_ms,
                    },
                    {
                        "call": {
                            "name": "crm__create_ticket",
                            "args": {
                                "customerId": customer,
                                "subject": "Parcel not received",
                                "priority": "high",
                            },
                        },
                        "delay_ms": delay_ms,
                    },
                    {
                        "json": {
                            "ticketId": "{{tool.crm__create_ticket.ticketId}}",
                            "priority": "high",
                            "_confidence": 95,
                        },
                        "delay_ms": delay_ms,
                    },
                ],
            }
        ]
    }


# --- the processes --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stack:
    database_url: str
    engine: EngineProcess
    broker_address: str
    crm: RunningCrmServer
    gemini_url: str
    logs: pathlib.Path


def inherited_environment() -> dict[str, str]:
    # A developer's own ABADA_* or GEMINI_* settings must not leak into the bench's services.
    return {key: value for key, value in os.environ.items() if not key.startswith(("ABADA_", "GEMINI_"))}


@contextlib.contextmanager
def logged_process(
    name: str, argv: list[str], env: dict[str, str], logs: pathlib.Path
) -> Iterator[subprocess.Popen[bytes]]:
    """A child in its own session (a Ctrl-C reaches only the bench, which stops it), logging to a file."""
    with (logs / f"{name}.log").open("ab") as log:
        process = subprocess.Popen(
            argv,
            env={**inherited_environment(), **env},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
        try:
            yield process
        finally:
            stop_process(process)


def stop_process(process: subprocess.Popen[bytes], grace_seconds: float = 15) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(grace_seconds)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def wait_until(
    ready: Callable[[], bool], process: subprocess.Popen[bytes], what: str, log: pathlib.Path
) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited during start-up; see {log}")
        with contextlib.suppress(OSError, grpc.RpcError):
            if ready():
                return
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not become ready; see {log}")


def grpc_serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
        return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)


def http_health(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as response:
        return dict(json.loads(response.read()))


def write_private(path: pathlib.Path, text: str) -> pathlib.Path:
    path.write_text(text)
    path.chmod(0o600)
    return path


@contextlib.contextmanager
def bench_stack(state: pathlib.Path) -> Iterator[Stack]:
    """Everything but the workers, stopped again in reverse order whatever happens."""
    logs = state / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    broker_address = f"127.0.0.1:{free_port()}"
    # The engine fetches deploy-time credentials from the broker with this token, written once known.
    engine_to_broker = state / "engine-to-broker.token"
    with contextlib.ExitStack() as stack:
        database_url = stack.enter_context(scratch_database())
        engine = stack.enter_context(
            engine_process(
                database_url,
                {"ABADA_BROKER_ADDRESS": broker_address, "ABADA_BROKER_TOKEN_FILE": str(engine_to_broker)},
            )
        )
        write_private(engine_to_broker, engine.token)
        crm = stack.enter_context(running_crm_server())
        broker_callers = {
            "callers": [
                {"identity": POOL, "roles": ["worker", "engine"], "token_sha256": sha256_hex(engine.token)}
            ]
        }
        broker_log = logs / "broker.log"
        broker = stack.enter_context(
            logged_process(
                "broker",
                [sys.executable, "-m", "abada_broker"],
                {
                    "ABADA_BROKER_GRPC_ADDRESS": broker_address,
                    "ABADA_ENGINE_ADDRESS": engine.address,
                    "ABADA_ENGINE_TOKEN_FILE": str(write_private(state / "broker.token", engine.token)),
                    "ABADA_BROKER_AUTH_TOKENS_FILE": str(
                        write_private(state / "broker-callers.yaml", yaml.safe_dump(broker_callers))
                    ),
                    "ABADA_SECRET_BACKEND": "file",
                    "ABADA_SECRETS_FILE": str(
                        write_private(state / "secrets.yaml", yaml.safe_dump({"crm-token": crm.token}))
                    ),
                },
                logs,
            )
        )
        wait_until(lambda: grpc_serving(broker_address), broker, "the broker", broker_log)
        gemini_url = stack.enter_context(running_scripted_gemini())
        yield Stack(database_url, engine, broker_address, crm, gemini_url, logs)


def sha256_hex(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class RunningWorker:
    name: str
    process: subprocess.Popen[bytes]
    health_port: int
    log: pathlib.Path


@contextlib.contextmanager
def running_workers(stack: Stack, count: int, concurrency: int, label: str) -> Iterator[list[RunningWorker]]:
    with contextlib.ExitStack() as exits:
        workers: list[RunningWorker] = []
        for index in range(1, count + 1):
            name = f"{POOL}/{label}-{index}"
            port = free_port()
            log_name = f"worker-{label}-{index}"
            process = exits.enter_context(
                logged_process(
                    log_name,
                    [sys.executable, "-m", "abada_worker.main"],
                    {
                        "ABADA_ENGINE_ADDRESS": stack.engine.address,
                        "ABADA_BROKER_ADDRESS": stack.broker_address,
                        "ABADA_WORKER_ID": name,
                        "ABADA_WORKER_TOKEN": stack.engine.token,
                        "ABADA_WORKER_CONCURRENCY": str(concurrency),
                        "ABADA_WORKER_HEALTH_ADDRESS": f"127.0.0.1:{port}",
                        "ABADA_GEMINI_BASE_URL": stack.gemini_url,
                        "GEMINI_API_KEY": "offline-bench",
                        # Nothing is left running when a phase ends; a short drain keeps the stop quick.
                        "ABADA_DRAIN_SECONDS": "2",
                    },
                    stack.logs,
                )
            )
            workers.append(RunningWorker(name, process, port, stack.logs / f"{log_name}.log"))
        # Started all at once, then awaited: their start-ups overlap.
        for worker in workers:
            wait_until(
                lambda w=worker: http_health(w.health_port)["status"] == "ok",
                worker.process,
                worker.name,
                worker.log,
            )
        yield workers


class PeakRss:
    """The highest resident set of each process, sampled in a thread so a busy event loop skips no sample."""

    def __init__(self, processes: dict[str, int], interval_seconds: float = 0.1) -> None:
        self._processes = {name: psutil.Process(pid) for name, pid in processes.items()}
        self._interval = interval_seconds
        self.peaks: dict[str, int] = dict.fromkeys(processes, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while True:
            for name, process in self._processes.items():
                with contextlib.suppress(psutil.Error):
                    self.peaks[name] = max(self.peaks[name], process.memory_info().rss)
            if self._stop.wait(self._interval):
                return


# --- driving instances ------------------------------------------------------------------------------


@dataclass
class Drive:
    """Instances started and when each reached notify_customer (time.perf_counter())."""

    expected: int
    started: dict[str, float] = field(default_factory=dict)
    arrived: dict[str, float] = field(default_factory=dict)
    stuck: Counter[str] = field(default_factory=Counter)
    all_arrived: asyncio.Event = field(default_factory=asyncio.Event)

    def check_progress(self) -> None:
        if len(self.finished) >= self.expected:
            self.all_arrived.set()

    @property
    def finished(self) -> list[str]:
        return [instance for instance in self.started if instance in self.arrived]

    @property
    def elapsed(self) -> float:
        finished = self.finished
        if not finished:
            return float("nan")
        return max(self.arrived[i] for i in finished) - min(self.started.values())

    @property
    def latencies(self) -> list[float]:
        return [self.arrived[i] - self.started[i] for i in self.finished]


async def deploy(channel: grpc.aio.Channel, source_name: str, content: str) -> definition_pb2.Definition:
    reply = await definition_pb2_grpc.DefinitionServiceStub(channel).Deploy(
        definition_pb2.DeployRequest(source_name=source_name, content=content)
    )
    return reply.definitions[0]


async def collect_arrivals(channel: grpc.aio.Channel, drive: Drive) -> None:
    """Takes the notify tasks as the bench's own notify worker: a task there is an instance that arrived."""
    stub = external_task_pb2_grpc.ExternalTaskServiceStub(channel)
    request = external_task_pb2.FetchAndLockRequest(
        worker_id=f"{POOL}/notify",
        max_tasks=500,
        wait_ms=1_000,
        topics=[external_task_pb2.TopicSubscription(name=NOTIFY_TOPIC, lease_ms=LONG_LEASE_MS)],
    )
    while True:
        tasks = (await stub.FetchAndLock(request)).tasks
        now = time.perf_counter()
        for task in tasks:
            drive.arrived.setdefault(task.instance_id, now)
        drive.check_progress()


async def start_instances(channel: grpc.aio.Channel, count: int, drive: Drive) -> None:
    processes = process_pb2_grpc.ProcessServiceStub(channel)
    numbers = iter(range(count))

    async def starter() -> None:
        for number in numbers:
            variables = {"customerId": "C-42", "message": f"My parcel never arrived (case {number})"}
            began = time.perf_counter()
            reply = await processes.StartInstance(
                process_pb2.StartInstanceRequest(process_id=TRIAGE_PROCESS, variables=to_struct(variables))
            )
            drive.started[reply.instance.id] = began

    await asyncio.gather(*(starter() for _ in range(STARTERS)))


async def drive_triage(channel: grpc.aio.Channel, count: int, timeout_seconds: float) -> Drive:
    """Starts `count` triage instances and waits until every one is at notify_customer, or the timeout."""
    drive = Drive(expected=count)
    collector = asyncio.create_task(collect_arrivals(channel, drive))
    try:
        await start_instances(channel, count, drive)
        drive.check_progress()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(drive.all_arrived.wait(), timeout_seconds)
    finally:
        collector.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await collector
    await explain_stuck(channel, drive)
    return drive


async def explain_stuck(channel: grpc.aio.Channel, drive: Drive) -> None:
    processes = process_pb2_grpc.ProcessServiceStub(channel)
    for instance_id in drive.started:
        if instance_id not in drive.arrived:
            found = (
                await processes.GetInstance(process_pb2.GetInstanceRequest(instance_id=instance_id))
            ).instance
            where = found.current_node_id + (" with an incident" if found.open_incidents else "")
            drive.stuck[where] += 1


# --- phase 1: load ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadResult:
    drive: Drive
    peak_rss: dict[str, int]
    tickets: int
    repeated_model_turns: int
    sample_journal: list[external_task_pb2.JournalStep]


async def load_phase(
    stack: Stack, instances: int, workers: int, concurrency: int, timeout: float
) -> LoadResult:
    bundle = TRIAGE_BUNDLE.read_text().replace(TRIAGE_BUNDLE_URL, stack.crm.url)
    tickets_before = len(stack.crm.tickets())
    reset_calls(stack.gemini_url)
    async with stack.engine.channel() as channel:
        await deploy(channel, TRIAGE_BUNDLE.name, bundle)
        with running_workers(stack, workers, concurrency, "load") as running:
            with PeakRss({w.name: w.process.pid for w in running}) as rss:
                drive = await drive_triage(channel, instances, timeout)
        finished = drive.finished
        sample = await journal_of_instance(channel, finished[0]) if finished else []
    return LoadResult(
        drive=drive,
        peak_rss=rss.peaks,
        tickets=len(stack.crm.tickets()) - tickets_before,
        repeated_model_turns=len(fetch_calls(stack.gemini_url)["repeated"]),
        sample_journal=sample,
    )


async def journal_of_instance(
    channel: grpc.aio.Channel, instance_id: str
) -> list[external_task_pb2.JournalStep]:
    history = await process_pb2_grpc.ProcessServiceStub(channel).GetHistory(
        process_pb2.GetHistoryRequest(instance_id=instance_id)
    )
    task_id = next(e.task_id for e in history.events if e.type == "TASK_CREATED" and e.node_id == "triage")
    reply = await external_task_pb2_grpc.ExternalTaskServiceStub(channel).GetJournal(
        external_task_pb2.GetJournalRequest(task_id=task_id)
    )
    return list(reply.steps)


# --- phase 2: the journal next to a direct MCP loop ------------------------------------------------


@dataclass(frozen=True)
class RecordedStep:
    """One step of a real journal, as the worker's Journal takes it again."""

    tool_ref: str  # "" for a model call
    call: FunctionCall | None = None
    reply: ModelReply | None = None
    result: dict[str, Any] | None = None


def recorded_steps(journal: list[external_task_pb2.JournalStep]) -> list[RecordedStep]:
    steps: list[RecordedStep] = []
    for step in journal:
        request, response = from_struct(step.request), from_struct(step.response)
        if step.kind == external_task_pb2.STEP_KIND_MODEL_CALL:
            turn = model_turn_of(response)
            extra = {k: v for k, v in response.items() if k not in ("text", "functionCalls", "finishReason")}
            reply = ModelReply(
                turn.text,
                turn.function_calls,
                str(response.get("finishReason", "")),
                step.tokens.input_tokens,
                step.tokens.output_tokens,
                extra,
            )
            steps.append(RecordedStep("", reply=reply))
        else:
            call = FunctionCall(str(request["callId"]), str(request["name"]), dict(request["arguments"]))
            steps.append(RecordedStep(step.tool_ref, call=call, result=response))
    return steps


@dataclass
class JournalTimings:
    calls: list[float] = field(default_factory=list)  # one AppendStep round trip each
    steps: dict[str, list[float]] = field(default_factory=dict)  # "model" / "read" / "write" -> step totals
    elapsed: float = 0.0

    def step(self, kind: str, seconds: float) -> None:
        self.steps.setdefault(kind, []).append(seconds)

    @property
    def all_steps(self) -> list[float]:
        return [seconds for per_kind in self.steps.values() for seconds in per_kind]


async def lock_probe_tasks(client: EngineClient, count: int) -> list[external_task_pb2.ExternalTask]:
    locked: list[external_task_pb2.ExternalTask] = []
    deadline = time.monotonic() + 30
    while len(locked) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(locked)} of {count} probe tasks could be locked")
        fetched = await client.fetch_and_lock(AGENT_TOPIC, LONG_LEASE_MS, count - len(locked), 1_000)
        # A triage task left over from a timed-out load phase may come along; it is simply left locked.
        locked += [task for task in fetched if task.process_id == "journal_probe"]
    return locked


class StepReplayer:
    """Appends recorded steps through the worker's Journal, timing every AppendStep and every step."""

    def __init__(self, journal: Journal, writes: frozenset[str], model: str, timings: JournalTimings) -> None:
        self._journal = journal
        self._writes = writes
        self._model = model
        self._timings = timings
        self._turn = 0

    async def _clocked(self, operation: Awaitable[T]) -> T:
        began = time.perf_counter()
        result = await operation
        self._timings.calls.append(time.perf_counter() - began)
        return result

    async def append(self, step: RecordedStep) -> None:
        journal, began = self._journal, time.perf_counter()
        if step.reply is not None:
            sequence = await self._clocked(journal.start_model_call(self._turn, self._model, "gemini"))
            await self._clocked(journal.finish_model_call(sequence, step.reply))
            self._turn += 1
            kind = "model"
        elif step.tool_ref in self._writes:
            assert step.call is not None and step.result is not None
            sequence, _ = await self._clocked(journal.start_write(step.call, step.tool_ref))
            await self._clocked(journal.finish_write(sequence, step.tool_ref, step.result))
            kind = "write"
        else:
            assert step.call is not None and step.result is not None
            await self._clocked(journal.record_read(step.call, step.tool_ref, step.result))
            kind = "read"
        self._timings.step(kind, time.perf_counter() - began)


async def journal_probe(
    stack: Stack, recorded: list[RecordedStep], tasks: int, rounds: int
) -> JournalTimings:
    async with stack.engine.channel() as channel:
        definition = await deploy(channel, "journal-probe.yaml", PROBE_BUNDLE.format(crm_url=stack.crm.url))
        writes = frozenset(
            f"{b.server}/{b.tool}"
            for b in definition.tool_bindings
            if b.policy == common_pb2.TOOL_POLICY_WRITE
        )
        processes = process_pb2_grpc.ProcessServiceStub(channel)
        for _ in range(tasks):
            await processes.StartInstance(process_pb2.StartInstanceRequest(process_id="journal_probe"))
    timings = JournalTimings()
    # The worker's own client stack: a plain channel, the bearer token as call metadata, its retries.
    async with grpc.aio.insecure_channel(stack.engine.address) as plain:
        client = EngineClient(plain, f"{POOL}/journal-probe", BearerToken(stack.engine.token))
        locked = await lock_probe_tasks(client, tasks)

        async def replay(task: external_task_pb2.ExternalTask) -> None:
            journal = Journal(client, LeaseRef(task.id, task.lease_token, task.attempt), next_sequence=1)
            replayer = StepReplayer(journal, writes, "gemini-3.6-flash", timings)
            for _ in range(rounds):
                for step in recorded:
                    await replayer.append(step)

        began = time.perf_counter()
        await asyncio.gather(*(replay(task) for task in locked))
        timings.elapsed = time.perf_counter() - began
    return timings


async def mcp_probe(crm: RunningCrmServer, sessions: int, calls: int) -> list[float]:
    """Direct get_customer calls through the worker's ToolServer (streamable-http, httpx2, bearer)."""
    latencies: list[float] = []

    async def session_loop() -> None:
        async with ToolServer.connect("crm", crm.url, Secret(crm.token), timeout_seconds=30) as server:
            for _ in range(calls // sessions):
                began = time.perf_counter()
                result = await server.call("get_customer", {"customerId": "C-42"}, None, 30)
                latencies.append(time.perf_counter() - began)
                if result["isError"]:
                    raise RuntimeError(f"get_customer failed: {result['content']}")

    await asyncio.gather(*(session_loop() for _ in range(sessions)))
    return latencies


# --- phase 3: one worker's memory -------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryResult:
    drive: Drive
    peak_rss: int
    peak_running: int


async def memory_phase(
    stack: Stack, instances: int, concurrency: int, delay_ms: int, timeout: float
) -> MemoryResult:
    load_script(stack.gemini_url, slow_triage_script(delay_ms))
    peak_running = 0
    async with stack.engine.channel() as channel:
        with running_workers(stack, 1, concurrency, "memory") as (worker,):

            async def watch_running() -> None:
                nonlocal peak_running
                while True:
                    health = await asyncio.to_thread(http_health, worker.health_port)
                    peak_running = max(peak_running, int(health["running"]))
                    await asyncio.sleep(0.1)

            with PeakRss({worker.name: worker.process.pid}) as rss:
                watcher = asyncio.create_task(watch_running())
                try:
                    drive = await drive_triage(channel, instances, timeout)
                finally:
                    watcher.cancel()
                    with contextlib.suppress(asyncio.CancelledError, OSError):
                        await watcher
    return MemoryResult(drive, rss.peaks[worker.name], peak_running)


# --- the report ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MachineFloors:
    """What this machine gave in the same run, the floors under the journal's figures."""

    commits_per_second: float
    grpc_calls_per_second: float


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"


def p50_p99(samples: list[float]) -> str:
    return f"{ms(percentile(samples, 0.5))} / {ms(percentile(samples, 0.99))}"


def verdict(met: bool) -> str:
    return "met" if met else "NOT met"


def drive_lines(drive: Drive, wanted: int) -> list[str]:
    lines = [f"reached notify_customer:    {len(drive.finished)} of {wanted} in {drive.elapsed:.2f} s"]
    if drive.stuck:
        lines.append(
            "still waiting:              " + ", ".join(f"{n} at {w}" for w, n in drive.stuck.items())
        )
    return lines


def report(
    args: argparse.Namespace,
    load: LoadResult,
    timings: JournalTimings,
    mcp: list[float],
    memory: MemoryResult,
    floors: MachineFloors,
    steps_per_task: int,
) -> str:
    drive = load.drive
    rate = len(drive.finished) / drive.elapsed if drive.finished else 0.0
    latencies = drive.latencies
    per_step_p50 = percentile(timings.all_steps, 0.5)
    calls_per_task = len(timings.calls) / max(1, args.journal_tasks * args.journal_rounds)
    read_p50 = percentile(timings.steps.get("read", []), 0.5)
    mcp_p50 = percentile(mcp, 0.5)
    rss_lines = ", ".join(f"{name} {peak / MIB:.0f} MB" for name, peak in load.peak_rss.items())
    kinds = {"model": "model call (2 AppendSteps)", "read": "read (1)", "write": "write (2)"}
    lines = [
        "",
        "=" * 100,
        "agent overhead: Alice's triage end to end, scripted Gemini, demo CRM over MCP",
        "=" * 100,
        f"load: {args.instances} instances, {args.workers} workers x --concurrency {args.concurrency}",
        *drive_lines(drive, args.instances),
        f"tasks/s:                    {rate:.1f} (first start to last arrival)",
        f"task latency p50 / p99:     {percentile(latencies, 0.5):.2f} / {percentile(latencies, 0.99):.2f} s"
        " (start to notify_customer)",
        f"worker peak RSS:            {rss_lines}",
        f"CRM tickets opened:         {load.tickets} for {len(drive.finished)} tasks; "
        f"model turns played twice: {load.repeated_model_turns}",
        "",
        f"journal: the worker's Journal + EngineClient, {args.journal_tasks} concurrent leased tasks x "
        f"{args.journal_rounds} rounds of a real Alice journal ({steps_per_task} steps, "
        f"{calls_per_task:.0f} AppendSteps), workers stopped",
        f"AppendStep p50 / p99:       {p50_p99(timings.calls)} ({len(timings.calls)} calls, "
        f"{len(timings.calls) / timings.elapsed:,.0f}/s)",
        *(
            f"  per {kinds[kind] + ' step':<31} p50 / p99 {p50_p99(samples)}"
            for kind, samples in sorted(timings.steps.items())
        ),
        f"direct MCP get_customer:    p50 / p99 {p50_p99(mcp)} ({len(mcp)} calls, {args.mcp_sessions} "
        "sessions, the worker's MCP client stack, same CRM)",
        f"a read step:                journal {ms(read_p50)} next to the MCP call's {ms(mcp_p50)} "
        f"({read_p50 / mcp_p50:.0%} on top)",
        f"journal per Alice task:     {calls_per_task:.0f} x AppendStep p50 = "
        f"{ms(calls_per_task * percentile(timings.calls, 0.5))}",
        f"journaling adds {ms(per_step_p50)} p50 per step (over Alice's steps) "
        f"-- target <= 2 ms: {verdict(per_step_p50 <= 0.002)}",
        "",
        f"same run, same machine:     {floors.commits_per_second:,.0f} single-row commits/s at 8 connections, "
        f"{floors.grpc_calls_per_second:,.0f} bare gRPC calls/s at 8 callers",
        # Eight callers back to back: each call's mean round trip is 8 / rate, the floor under AppendStep.
        f"bare gRPC round trip:       {ms(8 / floors.grpc_calls_per_second)} mean at 8 callers, "
        f"the floor under AppendStep's {ms(percentile(timings.calls, 0.5))} p50",
        "",
        f"memory: ONE worker at --concurrency {args.memory_concurrency}, {args.memory_instances} instances, "
        f"{args.memory_delay_ms} ms per model turn",
        *drive_lines(memory.drive, args.memory_instances),
        f"peak tasks in flight:       {memory.peak_running}",
        f"peak RSS:                   {memory.peak_rss / MIB:.0f} MB -- target < 200 MB: "
        f"{verdict(memory.peak_rss < 200 * MIB)}",
        "=" * 100,
    ]
    return "\n".join(lines)


# --- main ------------------------------------------------------------------------------------------


async def run_phases(args: argparse.Namespace, stack: Stack) -> str:
    say(f"load: {args.instances} instances on {args.workers} workers x {args.concurrency} ...")
    load = await load_phase(stack, args.instances, args.workers, args.concurrency, args.timeout)
    if not load.sample_journal:
        raise RuntimeError(
            f"no triage task finished, nothing to measure the journal with; logs: {stack.logs}"
        )
    recorded = recorded_steps(load.sample_journal)
    say(
        f"journal: {args.journal_tasks} tasks x {args.journal_rounds} rounds; MCP: {args.mcp_calls} calls ..."
    )
    mcp = await mcp_probe(stack.crm, args.mcp_sessions, args.mcp_calls)
    timings = await journal_probe(stack, recorded, args.journal_tasks, args.journal_rounds)
    floors = MachineFloors(
        await raw_commit_rate(stack.database_url), await bare_grpc_rate(stack.engine.address)
    )
    say(f"memory: {args.memory_instances} slow instances on one worker x {args.memory_concurrency} ...")
    memory = await memory_phase(
        stack, args.memory_instances, args.memory_concurrency, args.memory_delay_ms, args.timeout
    )
    return report(args, load, timings, mcp, memory, floors, len(recorded))


def run(args: argparse.Namespace, state: pathlib.Path) -> str:
    # The stack is entered outside the event loop: scratch_database() runs its own asyncio.run().
    with bench_stack(state) as stack:
        say(f"stack up: engine {stack.engine.address}, broker {stack.broker_address}, CRM {stack.crm.url}")
        summary = asyncio.run(run_phases(args, stack))
        say("stopping everything ...")
    return summary


def say(text: str) -> None:
    print(text, flush=True)


def interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--instances", type=int, default=200, help="triage instances in the load phase")
    parser.add_argument("--workers", type=int, default=2, help="worker processes in the load phase")
    parser.add_argument("--concurrency", type=int, default=50, help="tasks at once per worker (load phase)")
    parser.add_argument("--journal-tasks", type=int, default=8, help="concurrent leased tasks in the probe")
    parser.add_argument("--journal-rounds", type=int, default=8, help="Alice journals appended per task")
    parser.add_argument("--mcp-calls", type=int, default=400, help="direct get_customer calls")
    parser.add_argument("--mcp-sessions", type=int, default=8, help="concurrent MCP sessions for them")
    parser.add_argument("--memory-instances", type=int, default=60, help="instances for the one-worker phase")
    parser.add_argument("--memory-concurrency", type=int, default=50)
    parser.add_argument("--memory-delay-ms", type=int, default=700, help="delay of every model turn")
    parser.add_argument("--timeout", type=float, default=180, help="seconds a phase may take at most")
    parser.add_argument("--logs", type=pathlib.Path, help="keep the services' logs here (default: discarded)")
    args = parser.parse_args()
    # SIGTERM unwinds like Ctrl-C, through every `with` that stops a process the bench started.
    signal.signal(signal.SIGTERM, interrupt)
    try:
        if args.logs:
            args.logs.mkdir(parents=True, exist_ok=True)
            summary = run(args, args.logs)
        else:
            with tempfile.TemporaryDirectory(prefix="abada-agent-bench-") as scratch:
                summary = run(args, pathlib.Path(scratch))
    except KeyboardInterrupt:
        print("interrupted; everything the bench started was stopped", file=sys.stderr)
        return 130
    print(summary, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`abada-worker`: serve topic `abada:agent` until SIGTERM, then drain within the grace period."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Sequence

import grpc
from abada.engine.v1 import external_task_pb2
from abada_common.telemetry import configure_tracing
from abada_sdk.connection import BearerToken, ClientTls, Connection
from abada_sdk.worker import Backoff, Executor, Poller

from .agent_task import AgentServices, AgentTask
from .broker_client import BrokerClient, broker_channel_for
from .engine_client import EagerDispatch, EngineClient
from .health import HealthServer
from .interruption import TaskInterruption
from .logs import configure_logging, redactor
from .providers.base import ModelProvider
from .providers.registry import ProviderSet
from .settings import WorkerSettings, load_settings
from .task_runs import AgentRuns, TaskHandler

log = logging.getLogger("abada_worker")


def agent_handler(services: AgentServices) -> TaskHandler:
    async def handle(task: external_task_pb2.ExternalTask, interruption: TaskInterruption) -> None:
        await AgentTask(services, task, interruption).run()

    return handle


# Each SDK is imported only when its provider is configured: together they take seconds to load.
def _gemini(api_key: str | None, base_url: str | None, timeout_seconds: float) -> ModelProvider:
    from .providers.gemini import GeminiProvider

    return GeminiProvider(api_key=api_key, base_url=base_url, timeout_seconds=timeout_seconds)


def _openai(api_key: str | None, base_url: str | None, timeout_seconds: float) -> ModelProvider:
    from .providers.openai_chat import OpenAIChatProvider

    return OpenAIChatProvider(api_key=api_key, base_url=base_url, timeout_seconds=timeout_seconds)


def _anthropic(api_key: str | None, base_url: str | None, timeout_seconds: float) -> ModelProvider:
    from .providers.anthropic_messages import AnthropicMessagesProvider

    return AnthropicMessagesProvider(api_key=api_key, base_url=base_url, timeout_seconds=timeout_seconds)


def providers_for(settings: WorkerSettings) -> ProviderSet:
    """Every provider this worker has a key or an endpoint for; the rest are named with what is missing."""
    configured: dict[str, ModelProvider] = {}
    missing: dict[str, str] = {}
    for name, key, base_url, build, hint in (
        (
            "gemini",
            settings.gemini_api_key,
            settings.gemini_base_url,
            _gemini,
            "set GEMINI_API_KEY (or --gemini-api-key-file), or --gemini-base-url",
        ),
        (
            "openai",
            settings.openai_api_key,
            settings.openai_base_url,
            _openai,
            "set OPENAI_API_KEY (or --openai-api-key-file), or OPENAI_BASE_URL / --openai-base-url",
        ),
        (
            "anthropic",
            settings.anthropic_api_key,
            settings.anthropic_base_url,
            _anthropic,
            "set ANTHROPIC_API_KEY (or --anthropic-api-key-file), or ANTHROPIC_BASE_URL / --anthropic-base-url",
        ),
    ):
        if key:
            # Held for the worker's life: a key quoted by an SDK exception never reaches a log line.
            redactor.hold(key)
        if key or base_url:
            configured[name] = build(key, base_url, settings.model_timeout_seconds)
        else:
            missing[name] = hint
    return ProviderSet(configured, missing)


def engine_channel_for(settings: WorkerSettings) -> grpc.aio.Channel:
    """Plaintext unless a CA or a client certificate is configured; then TLS (mTLS with a certificate)."""
    tls = ClientTls(settings.tls_ca_file, settings.tls_cert_file, settings.tls_key_file)
    return Connection(settings.engine_address, tls=tls).open_aio_channel()


async def serve(settings: WorkerSettings) -> None:
    # A token file, when set, wins over a token in the environment.
    token = BearerToken(
        None if settings.token_file else settings.token, settings.token_file, what="the worker token"
    )
    engine_channel = engine_channel_for(settings)
    broker_channel = broker_channel_for(settings)
    providers = providers_for(settings)
    # Retrying one journal write for longer than a third of the lease would outlive the lease itself.
    engine = EngineClient(
        engine_channel, settings.worker_id, token, retry_seconds=min(10.0, settings.lease_ms / 3000)
    )
    services = AgentServices(
        engine=engine,
        broker=BrokerClient(broker_channel, settings.worker_id, token),
        providers=providers,
        tool_timeout_seconds=settings.tool_timeout_seconds,
        tool_call_concurrency=settings.tool_call_concurrency,
        lease_ms=settings.lease_ms,
        fault=settings.fault,
    )
    runs = AgentRuns(engine, {settings.topic: agent_handler(services)}, lease_ms=settings.lease_ms)
    executor = Executor(runs.start, runs.release, concurrency=settings.concurrency)
    engine.eager = EagerDispatch(settings.topic, settings.lease_ms, executor.hand_over)
    poller = Poller(
        lambda max_tasks: engine.fetch_and_lock(
            settings.topic, settings.lease_ms, max_tasks, settings.poll_wait_ms
        ),
        executor,
        wait_ms=settings.poll_wait_ms,
        backoff=Backoff(most=settings.max_backoff_seconds),
    )
    stopping = asyncio.Event()
    stop_requested_at: list[float] = []

    def request_stop(signal_name: str) -> None:
        if not stopping.is_set():
            stop_requested_at.append(time.monotonic())
            engine.eager.enabled = False  # type: ignore[union-attr]
            log.info(
                "stop requested; no new work",
                extra={"signal": signal_name, "drain_seconds": settings.drain_seconds},
            )
            stopping.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, request_stop, sig.name)
    health = HealthServer(
        lambda: {
            "status": "draining" if stopping.is_set() else "ok",
            "worker_id": settings.worker_id,
            "running": executor.running,
        }
    )
    await health.start(settings.health_address)
    log.info(
        "worker ready",
        extra={
            "worker_id": settings.worker_id,
            "topic": settings.topic,
            "concurrency": settings.concurrency,
            "engine": settings.engine_address,
            "health_port": health.port,
            "providers": providers.names,
        },
    )
    try:
        await poller.run(stopping)
        await executor.drain(stop_requested_at[0] + settings.drain_seconds)
    finally:
        await health.stop()
        await providers.aclose()
        await engine_channel.close()
        await broker_channel.close()
        log.info("worker stopped")


def main(argv: Sequence[str] | None = None) -> None:
    settings = load_settings(argv)
    configure_logging(settings.log_level)
    configure_tracing("abada-worker")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(settings))


if __name__ == "__main__":
    main()

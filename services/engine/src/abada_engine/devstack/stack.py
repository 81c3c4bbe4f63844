"""A local Abada: PostgreSQL, the engine, the broker, an agent worker, the notify worker and the demo CRM.

`running_stack` starts them in that order as child processes (logs in STATE/logs), each waited for
until it answers, and stops them in the reverse order. Its state directory keeps the database,
the callers and tokens, the engine's generated keys and the CRM's tickets, so the next start finds
what the last one left; `abada dev --fresh` removes it first. `abada dev` runs it until Ctrl-C;
`make demo` (examples/demo.py) runs it in a temporary directory and narrates one scenario.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import pathlib
import shlex
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator

from ..db.embedded import start_embedded_postgres
from ..db.reachability import mask_password
from .identities import WORKER_IDENTITY, DevIdentities, dev_identities
from .processes import StartupFailed, launch, port_taken, stop_all, wait_for_grpc, wait_for_http

ENV_FILE = "env"
AGENT_WORKER_ID = f"{WORKER_IDENTITY}/agent-1"
NOTIFY_WORKER_ID = f"{WORKER_IDENTITY}/notify-1"
# examples/support-triage.yaml names the CRM at this address: the default port keeps it deployable as is.
CRM_DEFAULT_PORT = 8765


@dataclasses.dataclass(frozen=True)
class DevPorts:
    engine: int
    engine_http: int
    broker: int
    crm: int
    model: int
    worker_health: int

    @classmethod
    def defaults(cls) -> DevPorts:
        """The services' own defaults, so `abada`, `abada-worker` and the bundles find them unconfigured."""
        return cls(
            engine=50051, engine_http=8080, broker=50061, crm=CRM_DEFAULT_PORT, model=8766, worker_health=8081
        )

    @classmethod
    def any_free(cls) -> DevPorts:
        """Free ports, all different: each is held until the last is chosen, so the kernel cannot hand
        the same one out twice."""
        with contextlib.ExitStack() as held:
            ports = []
            for _ in dataclasses.fields(cls):
                sock = held.enter_context(socket.socket())
                sock.bind(("127.0.0.1", 0))
                ports.append(int(sock.getsockname()[1]))
        return cls(*ports)

    def taken(self) -> list[str]:
        return [
            f"{field.name} {getattr(self, field.name)}"
            for field in dataclasses.fields(self)
            if port_taken(getattr(self, field.name))
        ]


@dataclasses.dataclass(frozen=True)
class ModelProvider:
    name: str
    model: str
    key_variable: str
    scripted_module: str
    # The base URL the worker is given for the scripted endpoint at `url`.
    scripted_base: str

    def worker_env(self, scripted_url: str | None) -> dict[str, str]:
        if scripted_url is None:
            return {}  # the real service: its key is already in the environment
        base = self.scripted_base.format(url=scripted_url)
        return {f"ABADA_{self.name.upper()}_BASE_URL": base, self.key_variable: "offline-dev"}


PROVIDERS = {
    "gemini": ModelProvider(
        "gemini", "gemini-3.6-flash", "GEMINI_API_KEY", "scripted_gemini.server", "{url}"
    ),
    "openai": ModelProvider("openai", "gpt-5-mini", "OPENAI_API_KEY", "scripted_openai.server", "{url}/v1"),
    "anthropic": ModelProvider(
        "anthropic", "claude-sonnet-4-5", "ANTHROPIC_API_KEY", "scripted_anthropic.server", "{url}"
    ),
}


def provider_from_environment() -> ModelProvider:
    """The first provider whose API key is set; the scripted Gemini endpoint when none is."""
    for provider in PROVIDERS.values():
        if os.environ.get(provider.key_variable):
            return provider
    return PROVIDERS["gemini"]


@dataclasses.dataclass(frozen=True)
class RunningStack:
    state: pathlib.Path
    logs: pathlib.Path
    identities: DevIdentities
    database: str  # where PostgreSQL is, password masked
    database_url: str
    engine_address: str
    engine_http: str
    broker_address: str
    crm_url: str
    provider: ModelProvider
    model_url: str | None  # the scripted endpoint; None when the provider itself answers
    console_url: str | None
    processes: dict[str, subprocess.Popen[bytes]]

    @property
    def env_file(self) -> pathlib.Path:
        return self.state / ENV_FILE

    def environment(self) -> dict[str, str]:
        """What `source STATE/env` sets: the CLI, the SDK and `abada-worker` then find this stack."""
        return {
            "ABADA_ENGINE_ADDRESS": self.engine_address,
            "ABADA_TOKEN_FILE": str(self.identities.operator_token_file),
            "ABADA_APPROVER_TOKEN_FILE": str(self.identities.approver_token_file),
            "ABADA_BROKER_ADDRESS": self.broker_address,
            "ABADA_WORKER_TOKEN_FILE": str(self.identities.worker_token_file),
            "ABADA_DEV_WORKER_IDENTITY": WORKER_IDENTITY,
            "ABADA_DEV_CRM_URL": self.crm_url,
            "ABADA_DEV_DATABASE_URL": self.database_url,
            "ABADA_DEV_LOGS": str(self.logs),
        }

    def write_env_file(self) -> None:
        lines = [
            "# Written by `abada dev` for the stack it runs; `source` it in another terminal.",
            "# ABADA_TOKEN_FILE is the operator's (dev-operator); workers use ABADA_WORKER_TOKEN_FILE",
            f"# with a worker id {WORKER_IDENTITY}/NAME (any topic), e.g. ABADA_WORKER_ID={WORKER_IDENTITY}/mine.",
        ]
        lines += [f"export {name}={shlex.quote(value)}" for name, value in self.environment().items()]
        self.env_file.write_text("\n".join(lines) + "\n")

    def exited(self) -> tuple[str, int] | None:
        """The first service that stopped on its own, with its exit status."""
        for name, process in self.processes.items():
            status = process.poll()
            if status is not None:
                return name, status
        return None


def _require_modules() -> None:
    needed = {
        "abada_broker": "abada-credential-broker",
        "abada_worker": "abada-agent-worker",
        "crm_mcp": "abada-examples",
        "notify_worker": "abada-examples",
        "abada_sdk": "abada-sdk",
    }
    missing = sorted(
        {package for module, package in needed.items() if importlib.util.find_spec(module) is None}
    )
    if missing:
        raise StartupFailed(
            f"a local stack needs {', '.join(missing)} installed beside the engine (`make venv` in the repository)"
        )


@contextlib.contextmanager
def _database(state: pathlib.Path) -> Iterator[tuple[str, str]]:
    """ABADA_DATABASE_URL when set, else an embedded PostgreSQL in STATE/pgdata; (url, description)."""
    configured = os.environ.get("ABADA_DATABASE_URL")
    if configured:
        yield configured, f"ABADA_DATABASE_URL ({mask_password(configured)})"
        return
    url, server = start_embedded_postgres(state / "pgdata", announce=False)
    try:
        yield url, f"embedded (pgserver) in {state / 'pgdata'}"
    finally:
        with contextlib.suppress(Exception):  # a Ctrl-C in the terminal may have stopped it already
            server.cleanup()


def _start_console(stack: contextlib.ExitStack, engine_address: str) -> str | None:
    """The web console's place in the stack: start it here, as the CRM is, and return its URL.

    None while Abada has no console; the summary and the env file show it once this returns one."""
    del stack, engine_address
    return None


@contextlib.contextmanager
def running_stack(
    state: pathlib.Path,
    ports: DevPorts,
    provider: ModelProvider,
    say: Callable[[str], None] = lambda _line: None,
) -> Iterator[RunningStack]:
    _require_modules()
    state = state.resolve()
    logs = state / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    identities = dev_identities(state / "tokens")
    python = sys.executable
    engine_address = f"127.0.0.1:{ports.engine}"
    broker_address = f"127.0.0.1:{ports.broker}"
    engine_http = f"127.0.0.1:{ports.engine_http}"
    processes: dict[str, subprocess.Popen[bytes]] = {}

    with contextlib.ExitStack() as stack:
        database_url, database = stack.enter_context(_database(state))
        say(f"PostgreSQL  {database}")
        stack.callback(lambda: stop_all(list(processes.values())[::-1]))

        def start(name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
            process = launch(name, argv, env, logs)
            processes[name] = process
            return process

        engine = start(
            "engine",
            [python, "-m", "abada_engine.main", "serve"],
            {
                "ABADA_DATABASE_URL": database_url,
                "ABADA_DEVELOPMENT": "1",
                "ABADA_STATE_DIR": str(state / "engine"),
                "ABADA_GRPC_ADDRESS": engine_address,
                "ABADA_HTTP_ADDRESS": engine_http,
                "ABADA_AUTH_TOKENS_FILE": str(identities.engine_callers),
                "ABADA_BROKER_ADDRESS": broker_address,
                "ABADA_BROKER_TOKEN_FILE": str(identities.engine_token_file),
            },
        )
        wait_for_grpc(engine_address, engine, "engine", logs)
        say(f"engine      {engine_address} (gRPC), http://{engine_http} (/metrics, /healthz)")
        say(
            f"console     http://{engine_http}/console/ (sign in with the token in "
            f"{identities.operator_token_file}, or {identities.approver_token_file.name} as an approver)"
        )

        broker = start(
            "broker",
            [python, "-m", "abada_broker"],
            {
                "ABADA_BROKER_GRPC_ADDRESS": broker_address,
                "ABADA_ENGINE_ADDRESS": engine_address,
                "ABADA_ENGINE_TOKEN_FILE": str(identities.broker_token_file),
                "ABADA_BROKER_AUTH_TOKENS_FILE": str(identities.broker_callers),
                "ABADA_SECRET_BACKEND": "file",
                "ABADA_SECRETS_FILE": str(identities.secrets_file),
            },
        )
        wait_for_grpc(broker_address, broker, "broker", logs)
        say(f"broker      {broker_address} (file backend: {identities.secrets_file.name})")

        crm_base = f"http://127.0.0.1:{ports.crm}"
        crm = start(
            "crm",
            [python, "-m", "crm_mcp.server", "--port", str(ports.crm), "--db", str(state / "crm.sqlite3")],
            {"CRM_MCP_TOKEN": identities.crm_token()},
        )
        wait_for_http(f"{crm_base}/healthz", crm, "crm", logs)
        crm_url = f"{crm_base}/mcp"
        say(f"CRM (MCP)   {crm_url} (the demo CRM: find_customer, create_ticket)")

        model_url: str | None = None
        if os.environ.get(provider.key_variable):
            say(f"model       {provider.name} itself ({provider.key_variable} is set)")
        else:
            model_url = f"http://127.0.0.1:{ports.model}"
            model = start("model", [python, "-m", provider.scripted_module, "--port", str(ports.model)], {})
            wait_for_http(f"{model_url}/_script/health", model, "model", logs)
            say(
                f"model       the scripted {provider.name} endpoint at {model_url} ({provider.model} plays Alice's triage)"
            )

        agent = start(
            "worker",
            [python, "-m", "abada_worker.main"],
            {
                "ABADA_ENGINE_ADDRESS": engine_address,
                "ABADA_BROKER_ADDRESS": broker_address,
                "ABADA_WORKER_ID": AGENT_WORKER_ID,
                "ABADA_WORKER_TOKEN_FILE": str(identities.worker_token_file),
                "ABADA_WORKER_HEALTH_ADDRESS": f"127.0.0.1:{ports.worker_health}",
                **provider.worker_env(model_url),
            },
        )
        wait_for_http(f"http://127.0.0.1:{ports.worker_health}/healthz", agent, "worker", logs)
        say(f"worker      {AGENT_WORKER_ID}, topic abada:agent (abada-worker)")

        start(
            "notify-worker",
            [python, "-m", "notify_worker"],
            {
                "ABADA_ENGINE_ADDRESS": engine_address,
                "ABADA_WORKER_ID": NOTIFY_WORKER_ID,
                "ABADA_TOKEN_FILE": str(identities.worker_token_file),
            },
        )
        say(f"worker      {NOTIFY_WORKER_ID}, topic notify (examples/notify_worker.py, the Python SDK)")

        console_url = _start_console(stack, engine_address)
        if console_url is not None:
            say(f"console     {console_url}")

        running = RunningStack(
            state=state,
            logs=logs,
            identities=identities,
            database=database,
            database_url=database_url,
            engine_address=engine_address,
            engine_http=engine_http,
            broker_address=broker_address,
            crm_url=crm_url,
            provider=provider,
            model_url=model_url,
            console_url=console_url,
            processes=processes,
        )
        running.write_env_file()
        yield running

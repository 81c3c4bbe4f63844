"""`abada dev`: a whole Abada on this machine in one command, until Ctrl-C."""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path
from types import FrameType
from typing import Annotated

import typer

from ..devstack.processes import StartupFailed
from ..devstack.stack import DevPorts, RunningStack, provider_from_environment, running_stack
from .errors import FAILURE, CliError, invalid_input

DEFAULT_STATE = Path(".abada/dev")
_PID_FILE = "dev.pid"
_WATCH_SECONDS = 0.5


def _running_pid(state: Path) -> int | None:
    """The pid of an `abada dev` still running from `state`, if any."""
    try:
        pid = int((state / _PID_FILE).read_text().strip())
    except (OSError, ValueError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        return pid
    return pid if pid != os.getpid() else None


def _stop_once_on_interrupt() -> None:
    """Ctrl-C or SIGTERM stops the stack; a second one while it stops cannot cut the stopping short."""

    def interrupt(_signum: int, _frame: FrameType | None) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)


def _what_next(stack: RunningStack, state: Path) -> list[str]:
    bundle = "examples/support-triage.yaml"
    lines = [
        "",
        f"Abada is running (state in {state}, logs in {stack.logs}). In another terminal:",
        "",
        f"  source {stack.env_file}",
        f"  abada deploy {bundle}",
        '  abada start support_triage --var customerId=C-42 --var message="My parcel never arrived" --wait',
        "  abada instances                # then: abada show INSTANCE, abada journal TASK",
        "",
        "Your own worker for a service task: the Python SDK (docs/sdk.md) with",
        "  ABADA_TOKEN_FILE=$ABADA_WORKER_TOKEN_FILE ABADA_WORKER_ID=$ABADA_DEV_WORKER_IDENTITY/mine",
    ]
    if stack.crm_url != "http://127.0.0.1:8765/mcp":
        lines.append(f"The CRM is not on its usual port: point {bundle}'s tool server at {stack.crm_url}.")
    lines += ["", "Ctrl-C stops everything; the next `abada dev` finds the same data (--fresh starts empty)."]
    return lines


def dev(
    state: Annotated[
        Path,
        typer.Option("--state-dir", help="Where the database, tokens, keys and logs are kept between runs."),
    ] = DEFAULT_STATE,
    fresh: Annotated[
        bool, typer.Option("--fresh", help="Remove the state first: an empty database.")
    ] = False,
    any_ports: Annotated[
        bool,
        typer.Option(
            "--any-ports",
            help="Free ports chosen at start instead of the usual ones (engine 50051, CRM 8765, …); "
            "the env file says which.",
        ),
    ] = False,
) -> None:
    """Run a whole Abada here until Ctrl-C: PostgreSQL, engine, broker, agent worker, notify worker, demo CRM.

    PostgreSQL is embedded (pgserver, in the state directory) unless ABADA_DATABASE_URL is set. The
    agent worker talks to a scripted Gemini endpoint unless GEMINI_API_KEY, OPENAI_API_KEY or
    ANTHROPIC_API_KEY is set. Writes STATE/env for `source`: the CLI, the SDK and abada-worker then
    find this stack: in another terminal, `source .abada/dev/env && abada deploy examples/support-triage.yaml`.
    """
    running = _running_pid(state)
    if running is not None:
        raise invalid_input(f"`abada dev` is already running from {state} (pid {running}); Ctrl-C it first")
    if fresh and state.exists():
        shutil.rmtree(state)
    ports = DevPorts.any_free() if any_ports else DevPorts.defaults()
    taken = ports.taken()
    if taken:
        raise CliError(
            f"ports in use: {', '.join(taken)}; stop what holds them, or run `abada dev --any-ports`",
        )
    state.mkdir(parents=True, exist_ok=True)
    pid_file = state / _PID_FILE
    pid_file.write_text(f"{os.getpid()}\n")
    _stop_once_on_interrupt()
    typer.echo(f"Starting Abada in {state} …")
    try:
        with running_stack(state, ports, provider_from_environment(), typer.echo) as stack:
            for line in _what_next(stack, state):
                typer.echo(line)
            while (stopped := stack.exited()) is None:
                time.sleep(_WATCH_SECONDS)
            name, status = stopped
            typer.echo(
                f"\n{name} stopped on its own (status {status}); see {stack.logs / name}.log", err=True
            )
            typer.echo("stopping the others …", err=True)
        raise typer.Exit(FAILURE)
    except StartupFailed as error:
        raise CliError(str(error)) from None
    except KeyboardInterrupt:
        typer.echo("\nstopped; the data stays for the next `abada dev`")
    finally:
        pid_file.unlink(missing_ok=True)

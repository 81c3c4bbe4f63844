"""Waiting out the outages of what the agent loop depends on, as the engine directs.

A call to a dependency (the model provider, a tool server, the broker and its secret store) that
failed for a reason that passes raises `DependencyDown`; which failures pass is decided once per kind
of dependency, where its client reads the failure (`providers.base.is_outage`, `tool_session`,
`broker_client`). `DependencyWatch.call` reports each one to the engine, which keeps one circuit per
dependency for every worker, and does as it answers: wait with the lease kept and call again (this
task is the dependency's probe and the next try is near), or stop (`TaskParked`: the engine parked
the task, or its outage budget ran out). A failure costs time, never an attempt; the parked task is
offered again when the dependency answers, and its replay pays for no model turn twice.

A task that probes a dependency (`ExternalTask.probes`), or that reported it down, reports it up once
a call to it gets through, so the tasks parked for it are offered again at once.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import NoReturn, Protocol, TypeVar

from abada.engine.v1 import dependency_pb2

from .errors import AttemptEnded
from .interruption import TaskInterruption
from .logs import TaskLog

log = logging.getLogger(__name__)

Result = TypeVar("Result")

_KINDS = {
    "model": dependency_pb2.DEPENDENCY_KIND_MODEL,
    "tool_server": dependency_pb2.DEPENDENCY_KIND_TOOL_SERVER,
    "broker": dependency_pb2.DEPENDENCY_KIND_BROKER,
    "secret_store": dependency_pb2.DEPENDENCY_KIND_SECRET_STORE,
}
_KIND_NAMES = {value: name for name, value in _KINDS.items()}


@dataclass(frozen=True)
class Dependency:
    kind: str  # model, tool_server, broker or secret_store: the engine's names
    name: str

    def __str__(self) -> str:
        return f"{self.kind}:{self.name}"

    def to_proto(self) -> dependency_pb2.Dependency:
        return dependency_pb2.Dependency(kind=_KINDS[self.kind], name=self.name)

    @staticmethod
    def from_proto(message: dependency_pb2.Dependency) -> Dependency | None:
        kind = _KIND_NAMES.get(message.kind)
        return Dependency(kind, message.name) if kind else None

    @staticmethod
    def from_key(key: str) -> Dependency | None:
        kind, _, name = key.partition(":")
        return Dependency(kind, name) if kind in _KINDS and name else None


def model(name: str) -> Dependency:
    return Dependency("model", name)


def tool_server(name: str) -> Dependency:
    return Dependency("tool_server", name)


BROKER = Dependency("broker", "broker")
SECRET_STORE = Dependency("secret_store", "secret-store")


class DependencyDown(Exception):
    """A call to `dependency` failed for a reason that passes (or was never made because the
    dependency is known to be down: `not_called`, held back by the engine or by this worker)."""

    def __init__(
        self,
        dependency: Dependency,
        message: str,
        *,
        retry_after_seconds: float = 0.0,
        not_called: bool = False,
    ) -> None:
        super().__init__(message)
        self.dependency = dependency
        self.message = message
        self.retry_after_seconds = retry_after_seconds
        self.not_called = not_called


class TaskParked(AttemptEnded):
    """The engine took the task back while a dependency is down (parked, or held by a
    DEPENDENCY_UNAVAILABLE incident once its outage budget ran out): stop and report nothing."""


@dataclass(frozen=True)
class Verdict:
    """The engine's answer to a report."""

    action: str  # CONTINUE, WAIT, PARKED or INCIDENT_RAISED
    retry_at: datetime.datetime | None
    probe: bool
    incident_id: str = ""


class Reporter(Protocol):
    """How the watch reaches the engine: `EngineClient.report_dependency` for one lease."""

    async def __call__(
        self, dependency: Dependency, *, up: bool, failure: DependencyDown | None, wait_in_place: bool
    ) -> Verdict: ...


class _ProcessView:
    """What this worker process believes is down (and since when, on its monotonic clock), so its
    tasks hold back from a dependency another of them just found down, and it logs an outage once,
    not once a retry."""

    def __init__(self) -> None:
        self._down_since: dict[Dependency, float] = {}
        self._back_since: dict[Dependency, float] = {}
        # Down for this worker, and the engine has answered a report of a failure since: its word
        # that the dependency is up is newer than this worker's outage, not a report overtaken.
        self._heard: set[Dependency] = set()

    def failed(self, dependency: Dependency, message: str, sent_at: float) -> None:
        """A call sent at `sent_at` failed; one sent before the dependency was last seen back is the
        outage already over answering late, not a new one."""
        if dependency in self._down_since or sent_at < self._back_since.get(dependency, -1.0):
            return
        self._down_since[dependency] = time.monotonic()
        self._heard.discard(dependency)
        log.warning("dependency down", extra={"dependency": str(dependency), "error": message})

    def engine_heard(self, dependency: Dependency) -> None:
        """The engine answered a report of a failure of `dependency` (sent once it was down here)."""
        if dependency in self._down_since:
            self._heard.add(dependency)

    def answered(self, dependency: Dependency, sent_at: float) -> None:
        """A call sent at `sent_at` got through; one sent before the outage was seen proves nothing."""
        down_since = self._down_since.get(dependency)
        if down_since is not None and sent_at >= down_since:
            del self._down_since[dependency]
            self._heard.discard(dependency)
            self._back_since[dependency] = time.monotonic()
            log.warning("dependency back", extra={"dependency": str(dependency)})

    def is_down(self, dependency: Dependency) -> bool:
        return dependency in self._down_since

    def forget(self, dependency: Dependency) -> bool:
        """The engine says the dependency is up (another worker's call got through). Taken only once
        the engine has heard of this worker's outage: at an outage's start, a task held back here may
        ask the engine before the report of the failure that holds it back has reached it. False:
        not taken, the dependency stays down here."""
        if dependency not in self._heard:
            return dependency not in self._down_since
        self._heard.discard(dependency)
        del self._down_since[dependency]
        self._back_since[dependency] = time.monotonic()
        log.warning("dependency back", extra={"dependency": str(dependency), "by": "engine"})
        return True


PROCESS_VIEW = _ProcessView()


class DependencyWatch:
    """One attempt's calls to its dependencies, each ridden through outages as the engine directs."""

    def __init__(
        self,
        report: Reporter,
        interruption: TaskInterruption,
        task_log: TaskLog,
        probes: Iterable[Dependency] = (),
    ) -> None:
        self._report = report
        self._interruption = interruption
        self._log = task_log
        # Dependencies to report up once a call to them gets through: the ones this task probes, and
        # the ones it reported down itself.
        self._unconfirmed: set[Dependency] = set(probes)

    async def call(
        self, attempt: Callable[[], Awaitable[Result]], *, needs: Iterable[Dependency] = ()
    ) -> Result:
        """`attempt()`, again after every temporary failure the engine says to wait out in place;
        TaskParked once the engine parks the task. `needs`: what a success shows to be answering."""
        needs = tuple(needs)
        while True:
            try:
                sent_at = time.monotonic()
                self._hold_if_known_down(needs)
                result = await attempt()
            except DependencyDown as down:
                verdict = await self._reported(down, wait_in_place=True, sent_at=sent_at)
                if down.not_called and not verdict.probe and not PROCESS_VIEW.forget(down.dependency):
                    # Told to ask again though not the probe, by an engine that has not yet heard of
                    # the failure that held this task back: this task calls, and its outcome tells.
                    self._unconfirmed.add(down.dependency)
                await self._wait(verdict)
                continue
            for dependency in needs:
                await self.answered(dependency, sent_at)
            return result

    def _hold_if_known_down(self, needs: Iterable[Dependency]) -> None:
        """Another task of this worker just met one of `needs` down: do not call it too (the engine
        decides, as if it had refused the call), unless this task is the one to probe it."""
        for dependency in needs:
            if PROCESS_VIEW.is_down(dependency) and dependency not in self._unconfirmed:
                raise DependencyDown(dependency, f"{dependency} is down for this worker", not_called=True)

    async def stop_for(self, down: DependencyDown) -> NoReturn:
        """A failure the attempt cannot wait out in place (a tool session broke in the middle of a
        turn): reported, and the task parked until the dependency answers. Always raises."""
        verdict = await self._reported(down, wait_in_place=False, sent_at=time.monotonic())
        # (A call that was never made is asked again in place by `call`; should one reach here, the
        # engine may answer WAIT: the attempt still ends, and its lease lapses for the next worker.)
        self._stop(down, verdict)

    async def answered(self, dependency: Dependency, sent_at: float) -> None:
        """A call to `dependency` sent at `sent_at` got through: report it up if the engine waits to
        hear it."""
        PROCESS_VIEW.answered(dependency, sent_at)
        if dependency not in self._unconfirmed:
            return
        await self._report(dependency, up=True, failure=None, wait_in_place=True)
        self._unconfirmed.discard(dependency)
        self._log.info("reported the dependency up", extra={"dependency": str(dependency)})

    async def _reported(self, down: DependencyDown, *, wait_in_place: bool, sent_at: float) -> Verdict:
        if not down.not_called:
            PROCESS_VIEW.failed(down.dependency, down.message, sent_at)
        verdict = await self._report(down.dependency, up=False, failure=down, wait_in_place=wait_in_place)
        if not down.not_called:
            PROCESS_VIEW.engine_heard(down.dependency)
        if verdict.probe or not down.not_called:
            self._unconfirmed.add(down.dependency)
        if verdict.action not in ("WAIT", "CONTINUE"):
            self._stop(down, verdict)
        return verdict

    def _stop(self, down: DependencyDown, verdict: Verdict) -> NoReturn:
        self._log.info(
            "task handed back: a dependency is down",
            extra={
                "dependency": str(down.dependency),
                "action": verdict.action,
                "next_probe": verdict.retry_at.isoformat() if verdict.retry_at else None,
                "incident_id": verdict.incident_id or None,
            },
        )
        raise TaskParked(f"{down.dependency} is down: {verdict.action.lower()}")

    async def _wait(self, verdict: Verdict) -> None:
        seconds = 0.0
        if verdict.retry_at is not None:
            now = datetime.datetime.now(datetime.UTC)
            seconds = max(0.0, (verdict.retry_at - now).total_seconds())
        await self._interruption.pause(seconds)

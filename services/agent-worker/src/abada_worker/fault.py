"""TEST-ONLY fault injection, switched on by the environment; never set it in a real deployment.

`ABADA_WORKER_FAULT=kill-after-send:<server>/<tool>` makes the worker SIGKILL itself once the
request for that tool has been sent and the server's answer has arrived, before the worker reads
or journals it: the crash in the middle of a write that the scenario's takeover rests on.
`ABADA_WORKER_FAULT=kill-after-propose:<server>/<tool>` makes it SIGKILL itself right after the
engine journaled a call of that tool AWAITING_APPROVAL, before the task is handed back.

`ABADA_WORKER_FAULT=kill-at:<boundary>` kills it at a step boundary of the agent loop instead, once
what came before is journaled: `model-returned` (a model turn journaled COMPLETED), `read-returned`
(a read journaled), `write-returned` (a write journaled COMPLETED), `before-complete` (the answer
is known, Complete not yet sent).
"""

from __future__ import annotations

import json
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx2

log = logging.getLogger(__name__)

ENV = "ABADA_WORKER_FAULT"
_KILL_AFTER_SEND = "kill-after-send:"
_KILL_AFTER_PROPOSE = "kill-after-propose:"
_KILL_AT = "kill-at:"
BOUNDARIES = frozenset({"model-returned", "read-returned", "write-returned", "before-complete"})

ResponseHook = Callable[[httpx2.Response], Awaitable[None]]


@dataclass(frozen=True)
class FaultPlan:
    kill_after_send: tuple[str, str] | None = None
    kill_after_propose: str | None = None  # server/tool
    kill_at: str | None = None

    @classmethod
    def parse(cls, value: str | None) -> FaultPlan:
        if not value:
            return cls()
        if value.startswith(_KILL_AFTER_PROPOSE) and "/" in value:
            return cls(kill_after_propose=value.removeprefix(_KILL_AFTER_PROPOSE))
        if value.startswith(_KILL_AT) and value.removeprefix(_KILL_AT) in BOUNDARIES:
            return cls(kill_at=value.removeprefix(_KILL_AT))
        if not value.startswith(_KILL_AFTER_SEND) or "/" not in value:
            raise ValueError(
                f"{ENV} must look like 'kill-after-send:<server>/<tool>', "
                f"'kill-after-propose:<server>/<tool>' or 'kill-at:<boundary>' "
                f"({', '.join(sorted(BOUNDARIES))}), not {value!r}"
            )
        server, _, tool = value.removeprefix(_KILL_AFTER_SEND).partition("/")
        return cls(kill_after_send=(server, tool))

    def after_proposed(self, tool_ref: str) -> None:
        if self.kill_after_propose == tool_ref:
            log.warning("test fault: killing the worker after proposing %s", tool_ref)
            os.kill(os.getpid(), signal.SIGKILL)

    def boundary(self, name: str) -> None:
        """Called by the agent loop at each step boundary; kills the worker at the planned one."""
        if self.kill_at == name:
            log.warning("test fault: killing the worker at %s", name)
            os.kill(os.getpid(), signal.SIGKILL)

    def response_hook(self, server: str) -> ResponseHook | None:
        if self.kill_after_send is None or self.kill_after_send[0] != server:
            return None
        tool = self.kill_after_send[1]

        async def kill_after_answer(response: httpx2.Response) -> None:
            if not _is_call_of(response.request, tool):
                return
            # The headers of a streamed answer arrive before the server has run the tool; reading the
            # body first makes sure the write has happened and only the worker's bookkeeping is lost.
            await response.aread()
            log.warning("test fault: killing the worker after sending %s/%s", server, tool)
            os.kill(os.getpid(), signal.SIGKILL)

        return kill_after_answer


def _is_call_of(request: httpx2.Request, tool: str) -> bool:
    if request.method != "POST":
        return False
    try:
        message = json.loads(request.content)
    except (ValueError, httpx2.RequestNotRead):
        return False
    return (
        isinstance(message, dict)
        and message.get("method") == "tools/call"
        and (message.get("params") or {}).get("name") == tool
    )

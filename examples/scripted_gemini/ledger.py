"""The record of every generateContent call, so tests can prove no model turn was played twice."""

from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class CallRecord:
    sequence: int
    conversation: str
    turn: int
    model: str
    script: str | None
    time: float
    # HTTP status returned: 200 for a played turn, 429 for a scripted rate limit, 400 for a
    # script or request error.
    status: int
    function_calls: tuple[str, ...]
    error: str | None = None
    # The functionResponse names the request carried, in its order (the results the model reads).
    function_responses: tuple[str, ...] = ()


class CallLedger:
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._records: list[CallRecord] = []

    def record(
        self,
        *,
        conversation: str,
        turn: int,
        model: str,
        script: str | None,
        status: int,
        function_calls: tuple[str, ...] = (),
        error: str | None = None,
        function_responses: tuple[str, ...] = (),
    ) -> CallRecord:
        entry = CallRecord(
            sequence=len(self._records) + 1,
            conversation=conversation,
            turn=turn,
            model=model,
            script=script,
            time=self._clock(),
            status=status,
            function_calls=function_calls,
            error=error,
            function_responses=function_responses,
        )
        self._records.append(entry)
        return entry

    def count(self, conversation: str, turn: int, *, status: int) -> int:
        """How many calls for this (conversation, turn) were answered with `status`."""
        return sum(
            1
            for entry in self._records
            if entry.conversation == conversation and entry.turn == turn and entry.status == status
        )

    def reset(self) -> None:
        self._records.clear()

    def snapshot(self) -> dict[str, Any]:
        """JSON for `GET /_script/calls`: every call, and how often each (conversation, turn) was played.

        `counts` and `repeated` cover played turns (status 200) only: a request the script refused
        was not a model turn, and counting it would make a later good answer look like a replay.
        """
        counts = Counter((entry.conversation, entry.turn) for entry in self._records if entry.status == 200)
        per_turn = [
            {"conversation": conversation, "turn": turn, "count": count}
            for (conversation, turn), count in sorted(counts.items())
        ]
        return {
            "total": len(self._records),
            "calls": [asdict(entry) for entry in self._records],
            "counts": per_turn,
            "repeated": [entry for entry in per_turn if entry["count"] > 1],
        }

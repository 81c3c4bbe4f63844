"""Journal payloads at rest: sealing a step's request and response, opening them for a reader, and
the idempotency key a keyed write carries. The primitives (AES-GCM key ring, HMAC keys) are in
`crypto`; this module applies them to journal steps and decides what a sealed payload is bound to."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from abada.engine.v1.error_reason_pb2 import ErrorReason

from abada_engine.db.database import dumps
from abada_engine.definitions.model import ToolBinding
from abada_engine.errors import Category, EngineError
from abada_engine.runtime.crypto.keys import IdempotencyKeys, JournalIntegrityError, KeyRing
from abada_engine.runtime.views import StepView
from abada_engine.store.journal_steps import StepRow

# Associated data versions; a row records the one its payloads were sealed with (`aad_version`).
# v1 bound task, sequence and field; rows sealed so still open, and `abada-engine reseal` moves
# them to v2.
AAD_V1 = 1
# v2 binds as well what the engine acts on when it reads a step back: the attempt (a keyed write's
# idempotency key and which calls a new attempt abandons derive from it), the kind, the tool, and the
# key id (so two ids sharing key bytes still keep their rows apart).
AAD_V2 = 2
# What new rows are sealed with.
AAD_VERSION = AAD_V2


@dataclass(frozen=True, slots=True)
class Place:
    """The step a sealed payload belongs to: a payload moved to another task, sequence, field,
    attempt, kind, tool or key id does not open. The step's state is not bound: it moves (STARTED,
    OUTCOME_UNKNOWN, COMPLETED) while the request stays sealed as it was, and every state change is
    guarded by the lease or a person's decision instead."""

    task_id: uuid.UUID
    sequence: int
    attempt: int
    kind: str
    tool_ref: str
    key_id: str
    aad_version: int = AAD_VERSION

    @staticmethod
    def of(row: StepRow) -> Place:
        return Place(
            row.task_id, row.sequence, row.attempt, row.kind, row.tool_ref, row.key_id, row.aad_version
        )

    def aad(self, field: str) -> bytes:
        if self.aad_version == AAD_V2:
            # The key id is length-prefixed and the tool reference comes last, so no choice of either
            # can make two different places read the same.
            return (
                f"abada.journal/v2|{self.task_id}|{self.sequence}|{field}|{self.attempt}|{self.kind}|"
                f"{len(self.key_id)}:{self.key_id}|{self.tool_ref}"
            ).encode()
        if self.aad_version == AAD_V1:
            return f"abada.journal/v1|{self.task_id}|{self.sequence}|{field}".encode()
        raise JournalIntegrityError(f"associated data version {self.aad_version} is unknown")


class StepSealer:
    def __init__(self, keys: KeyRing, idempotency: IdempotencyKeys) -> None:
        self._keys = keys
        self._idempotency = idempotency

    @property
    def primary_key_id(self) -> str:
        """The key new rows are sealed under."""
        return self._keys.primary

    def seal(
        self, place: Place, field: str, value: dict[str, Any] | None
    ) -> tuple[bytes | None, bytes | None]:
        """The sealed payload and its keyed digest (both None for no payload)."""
        if value is None:
            return None, None
        blob = self._keys.seal(place.key_id, dumps(value).encode(), place.aad(field))
        return blob, self._keys.digest(place.key_id, value)

    def knows(self, key_id: str) -> bool:
        """Whether the key ring holds `key_id`."""
        return key_id in self._keys.keys

    def digest(self, key_id: str, value: Any) -> bytes:
        """A keyed digest of a payload, to recognise an identical re-send without decrypting."""
        return self._keys.digest(key_id, value)

    def open(self, row: StepRow, field: str) -> dict[str, Any] | None:
        blob = row.request_ciphertext if field == "request" else row.response_ciphertext
        return self.open_sealed(Place.of(row), field, blob)

    def open_sealed(self, place: Place, field: str, blob: bytes | None) -> dict[str, Any] | None:
        """One sealed payload of the step at `place`, opened; None for no payload."""
        if blob is None:
            return None
        return json.loads(self._plaintext(place, field, blob))

    def reseal(self, row: StepRow, field: str) -> tuple[bytes | None, bytes | None]:
        """One payload of a row sealed again under the primary key and the current associated data,
        with its digest under that key: the same plaintext bytes, so nothing a reader sees changes."""
        blob = row.request_ciphertext if field == "request" else row.response_ciphertext
        if blob is None:
            return None, None
        plaintext = self._plaintext(Place.of(row), field, blob)
        to = Place(row.task_id, row.sequence, row.attempt, row.kind, row.tool_ref, self.primary_key_id)
        return (
            self._keys.seal(to.key_id, plaintext, to.aad(field)),
            self._keys.digest(to.key_id, json.loads(plaintext)),
        )

    def _plaintext(self, place: Place, field: str, blob: bytes) -> bytes:
        try:
            return self._keys.open(place.key_id, bytes(blob), place.aad(field))
        except JournalIntegrityError as error:
            raise EngineError(
                Category.DATA_LOSS,
                ErrorReason.JOURNAL_INTEGRITY,
                f"journal step {place.task_id}/{place.sequence} {field}: {error}",
                field="task_id",
            ) from None

    def view(
        self,
        row: StepRow,
        request: dict[str, Any] | None = None,
        response: dict[str, Any] | None = None,
        key: str = "",
    ) -> StepView:
        """The step as a reader sees it; payloads the caller already has in clear are not opened again."""
        return StepView(
            sequence=row.sequence,
            attempt=row.attempt,
            kind=row.kind,
            state=row.state,
            tool_ref=row.tool_ref,
            request=request if request is not None else self.open(row, "request"),
            response=response if response is not None else self.open(row, "response"),
            input_tokens=row.input_tokens,
            output_tokens=row.output_tokens,
            idempotency_key=key,
            abandoned=row.abandoned,
            created_at=row.created_at,
            updated_at=row.updated_at,
        )

    def views(self, rows: list[StepRow], bindings: list[ToolBinding]) -> list[StepView]:
        """Open the rows, and give each keyed write its idempotency key."""
        by_ref = {b.ref: b for b in bindings}
        return [self.view(row, key=self.key_for(row, by_ref.get(row.tool_ref))) for row in rows]

    def key_for(self, row: StepRow, binding: ToolBinding | None) -> str:
        if binding is None or binding.policy != "write" or binding.idempotency != "key":
            return ""
        return self._idempotency.key(row.task_id, row.attempt, row.sequence)

"""Journal payloads at rest: sealing a step's request and response, opening them for a reader, and
the idempotency key a keyed write carries. The primitives (AES-GCM key ring, HMAC keys) are in
`crypto`; this module applies them to journal steps."""

from __future__ import annotations

import json
import uuid
from typing import Any

from abada_engine.db.database import dumps
from abada_engine.definitions.model import ToolBinding
from abada_engine.errors import Category, EngineError
from abada_engine.store.journal_steps import StepRow

from .crypto import IdempotencyKeys, JournalIntegrityError, KeyRing
from .views import StepView


class StepSealer:
    def __init__(self, keys: KeyRing, idempotency: IdempotencyKeys) -> None:
        self._keys = keys
        self._idempotency = idempotency

    @property
    def primary_key_id(self) -> str:
        """The key new rows are sealed under."""
        return self._keys.primary

    def seal(
        self, key_id: str, task_id: uuid.UUID, sequence: int, field: str, value: dict[str, Any] | None
    ) -> tuple[bytes | None, bytes | None]:
        """The sealed payload and its keyed digest (both None for no payload)."""
        if value is None:
            return None, None
        blob = self._keys.seal(key_id, dumps(value).encode(), task_id, sequence, field)
        return blob, self._keys.digest(key_id, value)

    def digest(self, key_id: str, value: Any) -> bytes:
        """A keyed digest of a payload, to recognise an identical re-send without decrypting."""
        return self._keys.digest(key_id, value)

    def open(self, row: StepRow, field: str) -> dict[str, Any] | None:
        blob = row.request_ciphertext if field == "request" else row.response_ciphertext
        return self.open_sealed(row.key_id, row.task_id, row.sequence, field, blob)

    def open_sealed(
        self, key_id: str, task_id: uuid.UUID, sequence: int, field: str, blob: bytes | None
    ) -> dict[str, Any] | None:
        """One sealed payload of the step at (task, sequence), opened; None for no payload."""
        if blob is None:
            return None
        try:
            return json.loads(self._keys.open(key_id, bytes(blob), task_id, sequence, field))
        except JournalIntegrityError as error:
            raise EngineError(Category.DATA_LOSS, "JOURNAL_INTEGRITY", str(error), field="task_id") from None

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

"""The step journal, split by job: `append` (a worker journals and reads its steps), `takeover`
(a task changes hands after a lease ran out), `resolutions` (a person's decision on a journal
incident). Sealing is in `runtime/crypto/sealing.py`; the checks a step must pass are in `rules`."""

from abada_engine.runtime.journal.append import AppendResult, Journal
from abada_engine.runtime.journal.resolutions import JournalResolutions
from abada_engine.runtime.journal.rules import StepRequest
from abada_engine.runtime.journal.takeover import UNKEYED_WRITE_GRACE_SECONDS, Takeover

__all__ = [
    "UNKEYED_WRITE_GRACE_SECONDS",
    "AppendResult",
    "Journal",
    "JournalResolutions",
    "StepRequest",
    "Takeover",
]

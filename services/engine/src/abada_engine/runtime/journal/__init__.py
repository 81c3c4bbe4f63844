"""The step journal, split by job: `append` (a worker journals and reads its steps), `takeover`
(a task changes hands after a lease ran out), `resolutions` (a person's decision on a journal
incident). Sealing is in `runtime/sealing.py`; the checks a step must pass are in `rules`."""

from .append import AppendResult, Journal
from .resolutions import JournalResolutions
from .rules import StepRequest
from .takeover import UNKEYED_WRITE_GRACE_SECONDS, Takeover

__all__ = [
    "UNKEYED_WRITE_GRACE_SECONDS",
    "AppendResult",
    "Journal",
    "JournalResolutions",
    "StepRequest",
    "Takeover",
]

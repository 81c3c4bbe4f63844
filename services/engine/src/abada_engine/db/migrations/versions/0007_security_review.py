"""Security review: an admission says whether it admitted the call or found it admitted already.

A model call's STARTED that the journal then refuses gives its admission back. Before, a second
STARTED at a sequence already admitted (a re-send, or anyone claiming that sequence) was answered
"admitted" exactly like a new admission, so its refusal erased the first call's admission: its
concurrency slot and tokens were freed while it ran. The re-send branch of `abada_admit_model_calls`
now answers with the reason `already_admitted`, and only a fresh admission is ever given back.
"""

from __future__ import annotations

from abada_engine.db.migrations.earlier_revisions import constant_from
from alembic import op

revision = "0007"
down_revision = "0006"

_RESENT_AS_NEW = "admitted := true; retry_after_ms := 0; reason := ''; waiting_ahead := 0;\n            RETURN NEXT;\n            CONTINUE;\n        END IF;\n        my_ticket"
_RESENT_AS_RESENT = (
    "admitted := true; retry_after_ms := 0; reason := 'already_admitted'; waiting_ahead := 0;\n"
    "            RETURN NEXT;\n            CONTINUE;\n        END IF;\n        my_ticket"
)


def _batch_function() -> str:
    """Migration 0004's admission function, as `CREATE OR REPLACE`."""
    text = constant_from("0004_model_quota_batches.py", "ADMIT_BATCH_FUNCTION")
    assert text.count(_RESENT_AS_NEW) == 1
    return text.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1)


def upgrade() -> None:
    op.execute(_batch_function().replace(_RESENT_AS_NEW, _RESENT_AS_RESENT))


def downgrade() -> None:
    op.execute(_batch_function())

"""How long a model quota's window is, as admission counts it."""

from __future__ import annotations

# A minute, as providers count their per-minute quotas.
WINDOW_SECONDS = 60
# Admission happens before the provider receives the call: the STARTED step still has to be
# journaled and answered, and the worker has to send the request. The provider counts the call from
# its arrival, so an admitted call is counted for longer than the window: otherwise a call that took
# a while to leave and one admitted a minute after it promptly would both fall in one of the
# provider's minutes beside a full window's worth. Windows count whole seconds (a call admitted late in
# second s counts from s), so the margin the way to the provider may take is one second less than
# this: four. Two (one in effect) was too little on a loaded two-core machine, where 41 calls of a
# 40-per-minute quota reached the scripted provider within one minute.
ADMISSION_MARGIN_SECONDS = 5
QUOTA_SPAN_SECONDS = WINDOW_SECONDS + ADMISSION_MARGIN_SECONDS

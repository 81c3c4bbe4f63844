"""How long a model quota's window is, as admission counts it."""

from __future__ import annotations

# A minute, as providers count their per-minute quotas.
WINDOW_SECONDS = 60
# Admission happens a moment before the provider receives the call (the worker still has to send
# it). An admitted call is counted for two more seconds than the window, so that moment cannot let
# two calls that the provider sees within one minute slip past the quota.
ADMISSION_MARGIN_SECONDS = 2
QUOTA_SPAN_SECONDS = WINDOW_SECONDS + ADMISSION_MARGIN_SECONDS

"""What any Abada process accepts from a tool server (or a model provider) before it stops listening.

A tool server is reached over the network and may be hostile or broken: an endless `tools/list`
pagination, a list of a million tools, an answer of hundreds of megabytes, or one that trickles a
byte every few seconds so that no read ever times out. The engine (at deploy) and the agent worker
(at every task) apply the same caps.
"""

from __future__ import annotations

# Pages of one `tools/list`: real servers answer in one or a few.
MAX_TOOL_LIST_PAGES = 50
# Tools one server may list.
MAX_TOOLS = 1_000
# Bytes of one HTTP response body from a tool server or a model provider, counted as it streams in.
MAX_RESPONSE_BYTES = 8 * 1024 * 1024


class TooMuchFromServer(Exception):
    """The server sent more than a cap allows: a refusal to go on, never worth retrying."""

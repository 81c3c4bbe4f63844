"""New row ids: UUIDv7 (RFC 9562), in time order, still opaque to callers.

A random (v4) key puts every insert on a random leaf of the primary key and of every index that
carries the id, so with millions of rows each insert reads index pages from disk. Time-ordered keys
land on the right edge of those indexes, which stays in memory. Callers see an ordinary UUID and
must not read the time out of it.
"""

from __future__ import annotations

import os
import threading
import time
import uuid

_lock = threading.Lock()
_last = 0


def new_id() -> uuid.UUID:
    """A UUIDv7: 48 bits of Unix milliseconds, 12 bits of sub-millisecond time (RFC 9562, method 3),
    62 random bits. Ids from one process never go backwards, even if the clock does."""
    global _last
    with _lock:
        # Milliseconds in the top 48 bits, then 12 bits of the millisecond's fraction (units of 1/4096 ms).
        stamp = time.time_ns() * 4096 // 1_000_000
        stamp = max(stamp, _last + 1)
        _last = stamp
    milliseconds, fraction = divmod(stamp, 4096)
    value = (milliseconds & 0xFFFF_FFFF_FFFF) << 80
    value |= 0x7 << 76 | fraction << 64
    value |= 0b10 << 62 | int.from_bytes(os.urandom(8)) & 0x3FFF_FFFF_FFFF_FFFF
    return uuid.UUID(int=value)

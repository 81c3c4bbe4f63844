"""Telling a loopback host from any other, for the rules that hold off loopback only."""

from __future__ import annotations

import ipaddress


def is_loopback_host(host: str) -> bool:
    """`localhost`, `127.0.0.1`, `::1` or `[::1]`; a name other than localhost is never taken as loopback
    (what it resolves to may change)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False

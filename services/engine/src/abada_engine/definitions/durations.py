"""ISO-8601 durations (`PT30M`, `P2D`) as seconds: the form every duration in a bundle takes."""

from __future__ import annotations

import re

_ISO_DURATION = re.compile(
    r"^P(?:(?P<weeks>\d+(?:\.\d+)?)W)?(?:(?P<days>\d+(?:\.\d+)?)D)?"
    r"(?:T(?:(?P<hours>\d+(?:\.\d+)?)H)?(?:(?P<minutes>\d+(?:\.\d+)?)M)?(?:(?P<seconds>\d+(?:\.\d+)?)S)?)?$"
)
_DURATION_UNITS = {"weeks": 604_800, "days": 86_400, "hours": 3_600, "minutes": 60, "seconds": 1}


def iso_duration_seconds(text: str) -> float | None:
    """Seconds in an ISO-8601 duration of weeks, days, hours, minutes and seconds (no years or
    months: their length depends on the calendar); None if it is not one."""
    match = _ISO_DURATION.match(text.strip())
    if match is None or text.strip() in ("P", "PT") or text.strip().endswith("T"):
        return None
    parts = {name: value for name, value in match.groupdict().items() if value is not None}
    if not parts:
        return None
    return sum(float(value) * _DURATION_UNITS[name] for name, value in parts.items())

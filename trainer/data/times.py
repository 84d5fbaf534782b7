"""Time values of rows (a `time_field`, a stage's time windows) as one comparable number."""

from __future__ import annotations

import datetime as dt
from typing import Any

from specs.errors import UsageError


def parse_time(value: Any, where: str) -> float:
    """A number (seconds, or any unit the user keeps to) or an ISO 8601 date/time (UTC if naive)."""
    if isinstance(value, bool) or value is None:
        raise UsageError(f"{where}: time {value!r} is not a number or an ISO date")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, (dt.date, dt.datetime)):
        value = value.isoformat()
    try:
        stamp = dt.datetime.fromisoformat(str(value))
    except ValueError:
        try:
            return float(value)
        except ValueError:
            raise UsageError(f"{where}: time {value!r} is not a number or an ISO date") from None
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=dt.timezone.utc)
    return stamp.timestamp()

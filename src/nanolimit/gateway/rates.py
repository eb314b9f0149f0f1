"""Rates as people write them: ``"5/minute"``, ``"100 per 10 seconds"``.

The one parser of rate strings (rules, rules files, the CLI), kept apart
from the rules so the spellings users bring from other limiters are
handled in one place.
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple

from .._shared import ValidationError

__all__ = ["Rate", "parse_rate"]


_UNITS: dict[str, float] = {}
for _names, _seconds in (
    (("ms", "msec", "millisecond", "milliseconds"), 0.001),
    (("s", "sec", "secs", "second", "seconds"), 1.0),
    (("m", "min", "mins", "minute", "minutes"), 60.0),
    (("h", "hr", "hrs", "hour", "hours"), 3600.0),
    (("d", "day", "days"), 86400.0),
):
    for _name in _names:
        _UNITS[_name] = _seconds

_RATE_RE = re.compile(
    r"""^\s*(?P<limit>\d+)\s*
        (?:/|\bper\b)\s*
        (?P<count>\d+(?:\.\d+)?)?\s*
        (?P<unit>[a-z]+)\s*
        (?:\bburst\b\s*=?\s*(?P<burst>\d+))?\s*$""",
    re.IGNORECASE | re.VERBOSE,
)

_RATE_HELP = (
    "expected '<limit>/<unit>' or '<limit> per [<n>] <unit>' with an optional 'burst <n>', "
    "e.g. '5/minute', '100 per 10 seconds', '10/s burst 20'; units: ms, s, m, h, d and their long names"
)


class Rate(NamedTuple):
    """A parsed rate: ``limit`` units per ``window_seconds``, optional ``burst``."""

    limit: int
    window_seconds: float
    burst: int | None = None


def parse_rate(text: str) -> Rate:
    """Parse a rate the way users write one elsewhere (flask-limiter, slowapi,
    nginx): ``"5/minute"``, ``"100 per 10 seconds"``, ``"1000/hour"``,
    ``"10/s burst 20"``. Anything else is a :class:`ValidationError` that says
    what the accepted forms are."""
    if not isinstance(text, str):
        raise ValidationError(f"a rate must be a str, got {type(text).__name__}")
    m = _RATE_RE.match(text)
    if m is None:
        raise ValidationError(f"cannot parse rate {text!r}: {_RATE_HELP}")
    unit = _UNITS.get(m["unit"].lower())
    if unit is None:
        raise ValidationError(f"cannot parse rate {text!r}: unknown unit {m['unit']!r}; {_RATE_HELP}")
    limit = int(m["limit"])
    count = float(m["count"]) if m["count"] is not None else 1.0
    if limit <= 0:
        raise ValidationError(f"cannot parse rate {text!r}: the limit must be >= 1")
    if count <= 0 or not math.isfinite(count):
        raise ValidationError(f"cannot parse rate {text!r}: the window must be > 0")
    burst = int(m["burst"]) if m["burst"] is not None else None
    if burst is not None and burst <= 0:
        raise ValidationError(f"cannot parse rate {text!r}: the burst must be >= 1")
    return Rate(limit, count * unit, burst)

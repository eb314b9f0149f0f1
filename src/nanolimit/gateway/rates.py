"""Rates as people write them: ``"5/minute"``, ``"100 per 10 seconds"``,
and lists of them: ``"5/minute;100/hour"``.

The one parser of rate strings (rules, rules files, the CLI), kept apart
from the rules so the spellings users bring from other limiters
(flask-limiter, slowapi, ``limits``) are handled in one place.

Units, and what each is in seconds (fixed lengths, never calendar ones):

- ``ms``, ``msec``, ``millisecond(s)``: 0.001
- ``s``, ``sec(s)``, ``second(s)``: 1
- ``m``, ``min(s)``, ``minute(s)``: 60
- ``h``, ``hr(s)``, ``hour(s)``: 3,600
- ``d``, ``day(s)``: 86,400
- ``w``, ``week(s)``: 7 days, 604,800
- ``mo``, ``mon``, ``month(s)``: 30 days, 2,592,000 (not a calendar month)
- ``y``, ``yr``, ``year(s)``: 365 days, 31,536,000 (no leap days)

A month is 30 days because a window is one length: a fixed window of a
month is aligned to the Unix epoch in 30-day steps, never to the first of a
calendar month (docs/gateway.md, "Rates"). ``m`` is a minute, as in
flask-limiter; a month is ``mo``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import NamedTuple

from ..errors import ValidationError

__all__ = ["Rate", "parse_rate", "parse_rates", "rate_rule_name"]


_UNITS: dict[str, float] = {}
for _names, _seconds in (
    (("ms", "msec", "millisecond", "milliseconds"), 0.001),
    (("s", "sec", "secs", "second", "seconds"), 1.0),
    (("m", "min", "mins", "minute", "minutes"), 60.0),
    (("h", "hr", "hrs", "hour", "hours"), 3600.0),
    (("d", "day", "days"), 86400.0),
    (("w", "week", "weeks"), 7 * 86400.0),
    (("mo", "mon", "month", "months"), 30 * 86400.0),
    (("y", "yr", "year", "years"), 365 * 86400.0),
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
    "e.g. '5/minute', '100 per 10 seconds', '10/s burst 20'; units: ms, s, m (minute), h, d, w, "
    "mo (30 days), y (365 days) and their long names"
)
# Items of a rate list: flask-limiter and slowapi write "5/minute;100/hour",
# some configs "5/minute, 100/hour"; either, or both, separate items.
_SEPARATOR_RE = re.compile(r"[;,]")


class Rate(NamedTuple):
    """A parsed rate: ``limit`` units per ``window_seconds``, optional ``burst``."""

    limit: int
    window_seconds: float
    burst: int | None = None


def _whole(text: str, what: str, digits: str) -> int:
    """A limit or burst as an int. ``int()`` refuses a string past Python's
    digit limit (4300) with a bare ValueError; such a count is far above any
    limit a limiter takes, so it is a ValidationError here."""
    try:
        return int(digits)
    except ValueError:
        raise ValidationError(
            f"cannot parse rate {text[:60]!r}...: the {what} has {len(digits)} digits"
        ) from None


def parse_rate(text: str) -> Rate:
    """Parse a rate the way users write one elsewhere (flask-limiter, slowapi,
    nginx): ``"5/minute"``, ``"100 per 10 seconds"``, ``"1000/hour"``,
    ``"10/s burst 20"``. Anything else is a :class:`ValidationError` that says
    what the accepted forms are.

    One rate only: a list (``["5/minute", "100/hour"]`` or
    ``"5/minute;100/hour"``) is stacked limits, which :func:`parse_rates` reads
    and a list of rules enforces; the error says so rather than keeping one
    of them."""
    if not isinstance(text, str):
        if isinstance(text, (list, tuple)):
            raise ValidationError(
                f"parse_rate takes one rate, got a {type(text).__name__} of {len(text)}: "
                "for stacked limits use parse_rates (or one rule per limit, stacked)"
            )
        raise ValidationError(f"a rate must be a str, got {type(text).__name__}")
    m = _RATE_RE.match(text)
    if m is None:
        if _SEPARATOR_RE.search(text):
            raise ValidationError(
                f"cannot parse rate {text!r}: it looks like several rates; parse_rate takes one, "
                "for stacked limits use parse_rates (or one rule per limit, stacked)"
            )
        raise ValidationError(f"cannot parse rate {text!r}: {_RATE_HELP}")
    unit = _UNITS.get(m["unit"].lower())
    if unit is None:
        raise ValidationError(f"cannot parse rate {text!r}: unknown unit {m['unit']!r}; {_RATE_HELP}")
    limit = _whole(text, "limit", m["limit"])
    count = float(m["count"]) if m["count"] is not None else 1.0
    if limit <= 0:
        raise ValidationError(f"cannot parse rate {text!r}: the limit must be >= 1")
    if count <= 0 or not math.isfinite(count):
        raise ValidationError(f"cannot parse rate {text!r}: the window must be > 0")
    burst = _whole(text, "burst", m["burst"]) if m["burst"] is not None else None
    if burst is not None and burst <= 0:
        raise ValidationError(f"cannot parse rate {text!r}: the burst must be >= 1")
    return Rate(limit, count * unit, burst)


def rate_rule_name(name: str, window_seconds: float) -> str:
    """The rule name of one rate of a list: ``<name>:<window>s``, e.g.
    ``api:3600s``. A key's state is kept per rule name, so the name holds
    the window alone: editing a limit on reload keeps the budget already
    spent (docs/spec.md §6), where a name with the limit in it started every
    key over. The window is its shortest exact repr (``60``, ``0.1``,
    ``1000001``): two windows never share a name, as ``:g`` made 1000000 and
    1000001 do. :func:`parse_rates` refuses one window twice."""
    text = repr(float(window_seconds))
    return f"{name}:{text.removesuffix('.0')}s"


def parse_rates(text: str | Sequence[str]) -> tuple[Rate, ...]:
    """Parse a list of rates, as flask-limiter and slowapi take them:
    ``"5/minute;100/hour"``, ``"5/minute, 100/hour"``, ``"5 per minute; 100
    per hour"``, or a list or tuple of such strings (each may itself be a
    list). The rates come back in the order written.

    Refused, with a :class:`ValidationError` naming the item: an empty item
    (``"5/minute;;100/hour"``: a typo must not drop a limit), a rate that does
    not parse, the same window twice (each window of a list is one rule,
    named by its window so a limit edit keeps its spent budget: see
    :func:`rate_rule_name`; two limits over one window are dead weight or a
    copy-paste that meant another window), and an empty list.
    Whether the limits are enforced together is up to the caller (stacked
    rules); this only reads them."""
    if isinstance(text, str):
        parts: list[str] = [text]
    elif isinstance(text, (list, tuple)):
        parts = []
        for i, part in enumerate(text, 1):
            if not isinstance(part, str):
                raise ValidationError(f"item {i} of a rate list must be a str, got {type(part).__name__}")
            parts.append(part)
    else:
        raise ValidationError(f"rates must be a str or a list of str, got {type(text).__name__}")
    items = [item.strip() for part in parts for item in _SEPARATOR_RE.split(part)]
    shown = text if isinstance(text, str) else list(text)
    if not parts or items == [""]:
        raise ValidationError(f"no rates in {shown!r}: expected e.g. '5/minute;100/hour'")
    rates: list[Rate] = []
    seen: dict[float, str] = {}
    for n, item in enumerate(items, 1):
        if not item:
            raise ValidationError(f"rate {n} of {shown!r} is empty (a doubled or trailing separator?)")
        try:
            rate = parse_rate(item)
        except ValidationError as exc:
            raise ValidationError(f"rate {n} of {shown!r}: {exc}") from None
        first = seen.get(rate.window_seconds)
        if first is not None:
            raise ValidationError(
                f"rate {n} of {shown!r}, {item!r}, repeats {first!r}: the same window twice "
                "(each window of a list is one rule, named by its window)"
            )
        seen[rate.window_seconds] = item
        rates.append(rate)
    return tuple(rates)

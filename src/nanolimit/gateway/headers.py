"""The gateway's answer as HTTP writes it: the five rate-limit headers,
``Retry-After`` and the 429 body (docs/spec.md §2).

The gateway renders them from a rule's pieces formatted once per rule
(``X-RateLimit-Limit``, ``RateLimit-Policy``, the ``RateLimit`` prefix),
because a request should not format what never changes; the core renders
a whole Decision's (``Decision.headers``) through the same two functions,
``rule_texts`` and ``five_headers`` (the Python twin's one place). When the native core is built, admitted
requests get their headers from ``AdmittedRequests.record`` in C; this
module writes them otherwise and for every denial, and must write the same
bytes and refuse the same inputs (``tests/test_gateway_headers.py`` holds
both lanes, and ``Decision.headers``, to it).
"""

from __future__ import annotations

import json
import math
import re
from typing import NamedTuple

from .._clocks import MAX_TIME
from .._decision_py import five_headers, rule_texts
from ..errors import ValidationError

__all__ = [
    "MAX_HEADER_SECONDS",
    "RATE_HEADERS",
    "RulePieces",
    "deny_body",
    "rate_headers",
    "retry_seconds",
    "rule_pieces",
]

_ceil = math.ceil

# The five rate-limit headers, in the order every writer sets them.
RATE_HEADERS = (
    "X-RateLimit-Limit",
    "X-RateLimit-Remaining",
    "X-RateLimit-Reset",
    "RateLimit-Policy",
    "RateLimit",
)

# The largest reset a header may carry: ceil() of anything below it is an
# exact int64 (the native lane writes C integers). A decision of the core
# never comes near it (every documented rule stays under 2**62 s).
MAX_HEADER_SECONDS = float(1 << 62)


class RulePieces(NamedTuple):
    """What a rule's headers hold whatever the decision: ``X-RateLimit-Limit``,
    ``RateLimit-Policy``, and ``RateLimit`` up to its remaining count."""

    limit_str: str
    policy: str
    r_prefix: str


def rule_pieces(rule: str, capacity: int, window_seconds: float) -> RulePieces:
    """A rule's constant header text, formatted once per rule (as
    ``Decision.headers`` formats it per call): the policy's window in whole
    seconds, rounded up, at least 1."""
    return RulePieces(*rule_texts(rule, capacity, window_seconds))


def rate_headers(
    limit_str: str, policy: str, r_prefix: str, left: int, reset: float, wall_now: float
) -> dict[str, str]:
    """The five rate-limit headers of one decision, from its rule's
    preformatted pieces (``five_headers``): what ``AdmittedRequests.record``
    writes in C.

    Refuses (``ValidationError``) a wall clock that is not a finite time and
    a reset outside ``[0, MAX_HEADER_SECONDS)``, as the native lane does:
    those would be written as NaN, an overflow or a 300-digit header."""
    if not (abs(wall_now) < MAX_TIME and 0.0 <= reset < MAX_HEADER_SECONDS):
        raise ValidationError(f"cannot write headers for wall_now={wall_now!r}, reset_after={reset!r}")
    return five_headers(limit_str, policy, r_prefix, left, reset, wall_now)


def retry_seconds(retry_after: float) -> int:
    """``Retry-After`` and the 429 body's ``retry_after``: whole seconds,
    rounded up (a client that waits that long is admitted) and at least 1
    (``0`` would invite an immediate retry that is denied again)."""
    return max(1, _ceil(retry_after))


_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.:@/+-]*\Z")
# (rule, retry seconds) -> 429 body: a flood of denials renders few bodies.
_BODIES: dict[tuple[str, int], bytes] = {}
_MAX_BODIES = 4096


def deny_body(rule: str, retry_after: int) -> bytes:
    """docs/spec.md §2: the JSON body of a 429. Rule names are validated to
    need no JSON escaping (see ``RateLimitRule``), so the body is formatted
    directly; anything else goes through ``json.dumps``. Bodies are kept
    (bounded): a flood of denials mostly repeats a few (rule, seconds)."""
    body = _BODIES.get((rule, retry_after))
    if body is not None:
        return body
    if _SAFE_NAME.match(rule):
        body = b'{"error": "rate_limit_exceeded", "rule": "%s", "retry_after": %d}' % (
            rule.encode(),
            retry_after,
        )
    else:
        body = json.dumps({"error": "rate_limit_exceeded", "rule": rule, "retry_after": retry_after}).encode()
    if len(rule) <= 128:  # names a RateLimitRule accepts; never cache a caller's long text
        if len(_BODIES) >= _MAX_BODIES:
            _BODIES.clear()
        _BODIES[(rule, retry_after)] = body
    return body

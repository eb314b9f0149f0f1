"""What the pipeline answers: the :class:`Outcome` every front end writes
out, the 429 of a cost no wait lets through, and the denial log. What a
``count_when`` request spent until its response settles it is
:mod:`nanolimit.gateway.charges`.

The pipeline itself is :mod:`nanolimit.gateway.middleware`, which exports
these names too.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .._select import native_core
from .headers import deny_body
from .request import Request

__all__ = ["CostTooHigh", "Outcome", "Response", "render_body"]


# One record per denial, itself limited: a flood of 429s must not flood the log.
denial_log = logging.getLogger("nanolimit.denials")


@dataclass(slots=True)
class Response:
    """A response of the framework-free pipeline."""

    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""

    def json(self) -> Any:
        return json.loads(self.body)


class Outcome(NamedTuple):
    """The pipeline's answer on one request, what every front end writes out.

    ``allowed``: let it through (always true for dry-run rules);
    ``headers``: what to add to the response, or the 429's headers (with
    ``Retry-After``), rendered once; ``delay``: seconds a shaping
    leaky-bucket rule wants the request to wait; ``rule``: the deciding (or
    denying) rule's name; ``retry_after``: whole seconds for the 429 body;
    ``decision``: the core's Decision or CompoundDecision (a
    :class:`CostTooHigh` when the request's cost exceeds a rule's
    capacity); ``charge``: what to give back if the response does not
    count (rules with ``count_when``), else None — hand the response status
    to :meth:`RateLimitPipeline.settle`.

    A named tuple: an answer is a fact, and the hot path builds it with one
    C call (``_outcome``), not a Python ``__init__``.
    """

    allowed: bool
    headers: dict[str, str]
    delay: float
    rule: str
    retry_after: int
    decision: Any
    charge: Any = None

    def body(self) -> bytes:
        """The 429 body (meaningful when not allowed)."""
        decision = self.decision
        if type(decision) is CostTooHigh:
            return decision.body(self.rule)
        return render_body(self.rule, self.retry_after)

    def __repr__(self) -> str:
        return f"<Outcome allowed={self.allowed} rule={self.rule!r} delay={self.delay!r}>"


# deny_body, formatted in C when the native core is built (the same bytes):
# what Outcome.body() and the adapters' 429s write
render_body: Callable[[str, int], bytes] = getattr(native_core(), "deny_body", deny_body)

# Outcome(...) without NamedTuple's generated Python __new__: about 40 % cheaper
# per request, the same object.
_outcome = tuple.__new__


class CostTooHigh(NamedTuple):
    """A request costing more than a rule's capacity: no wait would let it
    pass, so its 429 has no ``Retry-After`` and says why."""

    cost: int
    capacity: int

    @property
    def allowed(self) -> bool:
        return False

    def body(self, rule: str) -> bytes:
        return json.dumps(
            {
                "error": "rate_limit_exceeded",
                "rule": rule,
                "retry_after": None,
                "reason": "cost_exceeds_limit",
                "cost": self.cost,
                "limit": self.capacity,
            }
        ).encode()


class _DenialLog:
    """At most one ``nanolimit.denials`` record per rule per ``interval``
    seconds, each saying how many it stood for: a flood of 429s costs a few
    lines. Client-written text (the path) is quoted and cut, so a request
    cannot forge log lines."""

    __slots__ = ("_lock", "_next", "_suppressed", "interval")

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._next: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._lock = threading.Lock()

    def __call__(self, request: Request, outcome: Outcome) -> None:
        """A denial: a record, unless one was written within the interval."""
        if not self.skip(outcome.rule):
            retry = (
                "never (cost over the limit)"
                if type(outcome.decision) is CostTooHigh
                else outcome.retry_after
            )
            self.write(request, outcome.rule, retry)

    def skip(self, rule: str) -> bool:
        """Whether a denial by ``rule`` falls within the interval of its last
        record: then it is only counted, for the next record to say."""
        if time.monotonic() < self._next.get(rule, 0.0):
            # the flood's common case, without the lock: a count a racing
            # thread may miss is a number in a log line, never a decision
            self._suppressed[rule] = self._suppressed.get(rule, 0) + 1
            return True
        return False

    def write(self, request: Request, rule: str, retry_after: object, more: int = 0) -> None:
        """The record of a denial that :meth:`skip` (or a native lane's own
        interval, which counted ``more`` since) let through."""
        now = time.monotonic()
        with self._lock:
            if now < self._next.get(rule, 0.0):
                self._suppressed[rule] = self._suppressed.get(rule, 0) + 1 + more
                return
            if len(self._next) > 4096:  # bounded: rule names are few, but be sure
                self._next.clear()
            self._next[rule] = now + self.interval
            more += self._suppressed.pop(rule, 0)
        path = request.path if len(request.path) <= 200 else request.path[:200] + "..."
        denial_log.warning(
            "rate limit exceeded: rule=%s method=%r path=%r retry_after=%s%s",
            rule,
            request.method[:32],
            path,
            retry_after,
            f" (+{more} more since the last record)" if more else "",
            extra={"rule": rule, "suppressed": more},
        )

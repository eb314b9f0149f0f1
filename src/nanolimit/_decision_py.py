"""The pure-Python twin's answers: the Decision, its header rendering, the
batch and compound results, and how a kernel's verdict becomes a Decision
(docs/spec.md §2). ``_core.Decision`` is the native twin's Decision; the
batch and compound results are shared by both twins.
"""

from __future__ import annotations

import math
import time
from array import array
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ._limiter_config import LimiterConfig
from .errors import ValidationError

_FIELDS = (
    "allowed",
    "limit",
    "remaining",
    "retry_after",
    "reset_after",
    "rule",
    "window",
    "delay",
    "degraded",
    "reason",
)


class Decision:
    """The answer to one request (docs/spec.md §2). Frozen: a Decision is a fact.

    ``degraded`` is true when the store could not decide normally and a policy
    answered instead; ``reason`` then says which ("storage_full",
    "store_unavailable"); it is "" for an ordinary decision.

    ``at`` is the limiter-clock time the decision was made at (the key's own
    time, which a sliding log stamps): the name a ``refund`` gives the charge
    back by. 0.0 when a policy answered or the Decision was built by hand.
    It is a receipt, not part of the answer: equality, hashing and repr
    leave it out, pickling keeps it.
    """

    __slots__ = (*_FIELDS, "at")

    allowed: bool
    limit: int
    remaining: int
    retry_after: float
    reset_after: float
    rule: str
    window: float
    delay: float
    degraded: bool
    reason: str
    at: float

    def __init__(
        self,
        allowed: bool,
        limit: int,
        remaining: int,
        retry_after: float,
        reset_after: float,
        rule: str = "",
        window: float = 0.0,
        delay: float = 0.0,
        degraded: bool = False,
        reason: str = "",
        at: float = 0.0,
    ) -> None:
        setter = object.__setattr__
        setter(self, "allowed", bool(allowed))
        setter(self, "limit", int(limit))
        setter(self, "remaining", int(remaining))
        setter(self, "retry_after", float(retry_after))
        setter(self, "reset_after", float(reset_after))
        setter(self, "rule", str(rule))
        setter(self, "window", float(window))
        setter(self, "delay", float(delay))
        setter(self, "degraded", bool(degraded))
        setter(self, "reason", str(reason))
        setter(self, "at", float(at))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Decision is frozen; cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"Decision is frozen; cannot delete {name!r}")

    def _astuple(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in _FIELDS)

    def __eq__(self, other: object) -> bool:
        if not hasattr(other, "_astuple") or not hasattr(other, "retry_after"):
            return NotImplemented
        return bool(self._astuple() == other._astuple())

    def __hash__(self) -> int:
        return hash(self._astuple())

    def __repr__(self) -> str:
        return (
            f"Decision(allowed={self.allowed!r}, limit={self.limit!r}, "
            f"remaining={self.remaining!r}, retry_after={self.retry_after!r}, "
            f"reset_after={self.reset_after!r}, rule={self.rule!r}, "
            f"window={self.window!r}, delay={self.delay!r}, degraded={self.degraded!r}, "
            f"reason={self.reason!r})"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (*self._astuple(), self.at))

    def headers(self, wall_now: float | None = None) -> dict[str, str]:
        """HTTP headers for this decision; ``wall_now`` defaults to ``time.time()``."""
        return render_headers(
            self.allowed,
            self.limit,
            self.remaining,
            self.retry_after,
            self.reset_after,
            self.rule,
            self.window,
            wall_now,
        )


class BatchResult(Sequence["Decision"]):
    """The answer to ``allow_many``: flat arrays, one slot per request.

    Keeping arrays instead of N Decision objects is what makes a batch cheap;
    ``result[i]`` builds the full Decision only when someone asks for it.
    ``degraded`` says whether any request was answered by a policy;
    ``reasons`` maps each such request's index to its reason (sparse: a
    policy answers rarely), so ``result[i]`` is degraded only if it was
    (``None``: no per-request detail, every request shares ``degraded``).
    """

    __slots__ = (
        "_decision",
        "allowed",
        "degraded",
        "delay",
        "limit",
        "reasons",
        "remaining",
        "reset_after",
        "retry_after",
        "rule",
        "window",
    )

    allowed: array[int]
    remaining: array[int]
    retry_after: array[float]
    reset_after: array[float]
    delay: array[float]

    def __init__(
        self,
        decision_type: Callable[..., Decision],
        limit: int,
        rule: str,
        window: float,
        allowed: array[int],
        remaining: array[int],
        retry_after: array[float],
        reset_after: array[float],
        delay: array[float],
        degraded: bool = False,
        reasons: dict[int, str] | None = None,
    ) -> None:
        self._decision = decision_type
        self.degraded = degraded or bool(reasons)
        # without per-request reasons, a degraded batch marks every request
        self.reasons: dict[int, str] | None = reasons
        self.limit = limit
        self.rule = rule
        self.window = window
        self.allowed = allowed
        self.remaining = remaining
        self.retry_after = retry_after
        self.reset_after = reset_after
        self.delay = delay

    def __len__(self) -> int:
        return len(self.allowed)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        i = range(len(self))[index.__index__()]  # negative indexes, IndexError
        if self.reasons is None:
            degraded, reason = self.degraded, ""
        else:
            degraded, reason = i in self.reasons, self.reasons.get(i, "")
        return self._decision(
            bool(self.allowed[i]),
            self.limit,
            self.remaining[i],
            self.retry_after[i],
            self.reset_after[i],
            self.rule,
            self.window,
            self.delay[i],
            degraded,
            reason,
        )

    def __iter__(self) -> Iterator[Decision]:
        for i in range(len(self)):
            yield self[i]

    @property
    def allowed_count(self) -> int:
        """How many requests of the batch were admitted."""
        return sum(self.allowed)

    def __repr__(self) -> str:
        return f"<BatchResult n={len(self)} allowed={self.allowed_count} rule={self.rule!r}>"


def sf_string_body(text: str) -> str:
    """``text`` as the inside of an RFC 8941 sf-string: printable ASCII as
    is, ``"`` and ``\\`` escaped with a backslash, anything else (CR, LF,
    NUL, non-ASCII, lone surrogates) and ``%`` as ``%XX`` of its UTF-8
    bytes. A bare limiter's rule is any ``str``: written raw, a CR LF in it
    split the response's headers, a quote ended the string early, and a
    character past Latin-1 fails a server's Latin-1 header encoding (an
    error for every request of the rule). Distinct names stay distinct."""
    if text.isascii() and text.isprintable() and '"' not in text and "\\" not in text and "%" not in text:
        return text  # every RateLimitRule name: unchanged, one scan
    out: list[str] = []
    for ch in text:
        if ch == '"' or ch == "\\":
            out.append("\\" + ch)
        elif " " <= ch <= "~" and ch != "%":
            out.append(ch)
        else:
            out.extend(f"%{b:02X}" for b in ch.encode("utf-8", "surrogatepass"))
    return "".join(out)


def rule_texts(rule: str, limit: int, window: float) -> tuple[str, str, str]:
    """A rule's constant header text: ``X-RateLimit-Limit``,
    ``RateLimit-Policy`` (its window in whole seconds, rounded up, at least
    1) and ``RateLimit`` up to its remaining count. The rule's name is
    written as a valid sf-string (``sf_string_body``), so no rule can
    inject or break a header."""
    name = sf_string_body(rule)
    return str(limit), f'"{name}";q={limit};w={max(1, math.ceil(window))}', f'"{name}";r='


def five_headers(
    limit_str: str, policy: str, r_prefix: str, left: int, reset_after: float, wall_now: float
) -> dict[str, str]:
    """docs/spec.md §2's five rate-limit headers from a rule's constant
    texts (``rule_texts``): the one place the Python twin formats them, for
    ``Decision.headers`` and the gateway's ``rate_headers`` alike (the
    native twin's is ``header_values`` in _core_gateway.pxi)."""
    text = str(left)
    return {
        "X-RateLimit-Limit": limit_str,
        "X-RateLimit-Remaining": text,
        "X-RateLimit-Reset": str(math.ceil(wall_now + reset_after)),
        "RateLimit-Policy": policy,
        "RateLimit": f"{r_prefix}{text};t={math.ceil(reset_after)}",
    }


def render_headers(
    allowed: bool,
    limit: int,
    remaining: int,
    retry_after: float,
    reset_after: float,
    rule: str,
    window: float,
    wall_now: float | None = None,
) -> dict[str, str]:
    """docs/spec.md §2: the GitHub-style trio, the IETF draft-10 pair, and Retry-After."""
    if wall_now is None:
        wall_now = time.time()
    headers = five_headers(*rule_texts(rule, limit, window), max(0, remaining), reset_after, wall_now)
    if not allowed:
        headers["Retry-After"] = str(max(1, math.ceil(retry_after)))
    return headers


# What a kernel answers: (allowed, remaining before floor, retry_after,
# reset_after, delay, degraded), and, when a policy answered, its reason
# ("store_unavailable", "storage_full") seventh; eighth, when the store says
# it, the key's time the decision was made at (Decision.at, what a refund names).
KernelVerdict = (
    tuple[bool, float, float, float, float, bool]
    | tuple[bool, float, float, float, float, bool, str]
    | tuple[bool, float, float, float, float, bool, str, float]
)


# Decision.reason when a failure policy answered for a store that could not
# decide (docs/spec.md §2 degraded decisions).
REASON_STORE_UNAVAILABLE = "store_unavailable"
# ... and when a policy answered one key's error reply while the store is up.
REASON_STORE_ERROR = "store_error"


def decision_from_verdict(decision_type: Callable[..., Any], cfg: LimiterConfig, v: Sequence[Any]) -> Any:
    """A ``decision_type`` (either twin's Decision) from a kernel verdict:
    remaining floored and never below 0 (docs/spec.md §2), the degraded flag and
    reason when a policy answered, and the decision's time when the verdict
    carries one (an eighth element)."""
    return decision_type(
        v[0],
        cfg.capacity,
        max(0, math.floor(v[1])),
        v[2],
        v[3],
        cfg.rule,
        cfg.window_seconds,
        v[4],
        len(v) > 5 and bool(v[5]),
        v[6] if len(v) > 6 else "",
        v[7] if len(v) > 7 else 0.0,
    )


class CompoundDecision:
    """The answer to a request bound by several limits at once.

    It passed only if every limit allowed, and then every limit was charged;
    if any denied, none was (``decisions`` then hold what each would have
    answered). ``limit``, ``remaining``, ``rule``, ``window`` and the
    headers describe one limit, the binding one, so a client never reads one
    rule's name with another's quota: when denied, the denial with the
    longest ``retry_after`` (``denied_by``); when allowed, the limit with the
    smallest remaining. ``retry_after``, ``reset_after`` and ``delay`` are
    the longest over all limits.
    """

    __slots__ = ("_binding", "allowed", "decisions", "denied_by")

    def __init__(self, decisions: Sequence[Decision]) -> None:
        if not decisions:
            raise ValidationError("a compound decision needs at least one decision")
        self.decisions = tuple(decisions)
        self.allowed = all(d.allowed for d in self.decisions)
        denied = [d for d in self.decisions if not d.allowed]
        self.denied_by: str | None = None
        if denied:
            self._binding = max(denied, key=lambda d: d.retry_after)
            self.denied_by = self._binding.rule
        else:
            self._binding = min(self.decisions, key=lambda d: d.remaining)

    @property
    def limit(self) -> int:
        return self._binding.limit

    @property
    def remaining(self) -> int:
        return self._binding.remaining

    @property
    def rule(self) -> str:
        return self._binding.rule

    @property
    def window(self) -> float:
        return self._binding.window

    @property
    def retry_after(self) -> float:
        return max(d.retry_after for d in self.decisions)

    @property
    def reset_after(self) -> float:
        return max(d.reset_after for d in self.decisions)

    @property
    def delay(self) -> float:
        return max(d.delay for d in self.decisions)

    @property
    def degraded(self) -> bool:
        return any(d.degraded for d in self.decisions)

    def headers(self, wall_now: float | None = None) -> dict[str, str]:
        """docs/spec.md §2 headers of the binding limit (its own reset; Retry-After
        is the longest wait, which is the binding denial's)."""
        b = self._binding
        return render_headers(
            self.allowed, b.limit, b.remaining, self.retry_after, b.reset_after, b.rule, b.window, wall_now
        )

    def __repr__(self) -> str:
        return (
            f"<CompoundDecision allowed={self.allowed} denied_by={self.denied_by!r} "
            f"remaining={self.remaining} retry_after={self.retry_after!r}>"
        )

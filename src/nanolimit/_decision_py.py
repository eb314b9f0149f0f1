"""The pure-Python Decision; ``_core.Decision`` is its native twin."""

from __future__ import annotations

from typing import Any

from ._shared import render_headers

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
    """

    __slots__ = _FIELDS

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
        return (type(self), self._astuple())

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

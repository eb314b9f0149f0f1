"""What counting by response keeps (``count_when``, docs/routes.md): the
charge of an admitted request, given back when its response does not
count. The Python side of ``nanolimit._core.Charge``, which a native lane
makes for a plain rule; these are made by the pipeline's Python paths
(the reference twin, costs above 1, dry runs, stacked rules). Each item
is ``(binding, key, cost, decision)``: the binding's ``rule.counts`` and
``limiter`` settle it."""

from __future__ import annotations

from typing import Any

__all__ = ["Charges", "Counted"]


class Counted(list[Any]):
    """What one ``count_when`` rule's admitted request spent, ``[binding,
    key, cost, decision]``, given back by :meth:`settle` when its response
    does not count: the common case of counting by response, built by
    ``list``'s own constructor in C (no Python ``__init__`` per request)."""

    __slots__ = ()

    @property
    def open(self) -> bool:
        """Not settled yet (a lazy WSGI app's response still owes it)."""
        return bool(self)

    def _take(self, status: int) -> tuple[Any, str, int, Any] | None:
        if not self:
            return None  # settled already: once only
        b, key, cost, d = self
        self.clear()
        if b.rule.counts(status):
            return None
        return b, key, cost, d

    def settle(self, status: int) -> int:
        due = self._take(status)
        if due is None:
            return 0
        b, key, cost, d = due
        b.limiter.refund(key, cost, at=d.at)
        return cost

    async def settle_async(self, status: int) -> int:
        due = self._take(status)
        if due is None:
            return 0
        b, key, cost, d = due
        await b.limiter.refund_async(key, cost, at=d.at)
        return cost


class Charges:
    """What a request under several ``count_when`` rules spent (a stack):
    each admitted (binding, key, cost, decision), given back by
    :meth:`settle` when the response does not count for that rule."""

    __slots__ = ("items",)

    def __init__(self, items: list[tuple[Any, str, int, Any]]) -> None:
        self.items = items

    @property
    def open(self) -> bool:
        """Not settled yet (a lazy WSGI app's response still owes it)."""
        return bool(self.items)

    def _due(self, status: int) -> list[tuple[Any, str, int, Any]]:
        items, self.items = self.items, []  # once: a second settle refunds nothing
        return [item for item in items if not item[0].rule.counts(status)]

    def settle(self, status: int) -> int:
        """Refund what ``status`` does not count; returns the units given back."""
        back = 0
        for b, key, cost, d in self._due(status):
            b.limiter.refund(key, cost, at=d.at)
            back += cost
        return back

    def refund(self) -> int:
        """Give every charge back, whatever each rule counts: the request
        never ran (an enforced rule of its stack refused it). Not a status
        to settle by: a ``count_when`` callable may count any status, or
        raise on one no server sends."""
        items, self.items = self.items, []
        for b, key, cost, d in items:
            b.limiter.refund(key, cost, at=d.at)
        return sum(item[2] for item in items)

    async def settle_async(self, status: int) -> int:
        """:meth:`settle` awaiting the store (``AsyncRedisStorage``)."""
        back = 0
        for b, key, cost, d in self._due(status):
            await b.limiter.refund_async(key, cost, at=d.at)
            back += cost
        return back

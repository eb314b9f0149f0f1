"""Fixtures and helpers of the gateway tests (rules, middleware, front ends)."""

from __future__ import annotations

import types
from typing import Any

from nanolimit.gateway.factory import LimiterFactory
from nanolimit.gateway.middleware import RateLimitPipeline, Request, Response
from nanolimit.gateway.registry import RuleRegistry
from nanolimit.gateway.rules import RateLimitRule

WALL = 1_700_000_000.0


def rule(name: str, rate_limit: int = 5, window: float = 60.0, **kw: Any) -> RateLimitRule:
    """A rule with test defaults: every method, every path, per IP, token bucket."""
    fields: dict[str, Any] = {
        "method": "*",
        "path_prefix": "/",
        "scope": "ip",
        "algorithm": "token_bucket",
        "burst": None,
    }
    extra = {k: kw.pop(k) for k in ("tier", "dry_run", "shape", "count_when") if k in kw}
    fields.update(kw)
    return RateLimitRule(
        name,
        fields["method"],
        fields["path_prefix"],
        fields["scope"],
        fields["algorithm"],
        rate_limit,
        window,
        fields["burst"],
        **extra,
    )


def gateway(
    backend: types.SimpleNamespace,
    rules: list[RateLimitRule],
    clock: Any = None,
    *,
    default: RateLimitRule | None = None,
    stacked: bool = False,
    **kw: Any,
) -> RateLimitPipeline:
    """A framework-free middleware on a fresh store of the twin under test."""
    clock = clock if clock is not None else backend.FakeClock(0.0)
    factory = LimiterFactory(backend.InMemoryStorage(), clock)
    kw.setdefault("wall_clock", lambda: WALL)
    return RateLimitPipeline(RuleRegistry(rules, default, stacked=stacked), factory, **kw)


def ok_handler(request: Request) -> Response:
    return Response(200, {"Content-Type": "text/plain"}, b"ok")


def get(path: str = "/", client: str | None = "192.0.2.1", method: str = "GET", **headers: str) -> Request:
    return Request(method, path, {k.replace("_", "-").lower(): v for k, v in headers.items()}, client)


def audit_decisions(monkeypatch: Any) -> list[bool | None]:
    """Log the answer of each call of a pipeline's public ``decide`` (the
    native twin binds its C lane per pipeline, so each new pipeline's own is
    wrapped): a front end that decided in a copy of its own logs nothing."""
    from nanolimit.gateway.middleware import RateLimitPipeline

    log: list[bool | None] = []
    init = RateLimitPipeline.__init__

    def audited_init(self: Any, *args: Any, **kw: Any) -> None:
        init(self, *args, **kw)
        decide = self.decide

        def audited(*args: Any, **kw: Any) -> Any:
            outcome = decide(*args, **kw)
            log.append(None if outcome is None else outcome[0])
            return outcome

        self.decide = audited

    monkeypatch.setattr(RateLimitPipeline, "__init__", audited_init)
    return log


async def post_statuses(mw: Any, times: int) -> list[object]:
    """What ``times`` POSTs to /login get from the ASGI middleware ``mw``:
    the status sent, or the app's ValueError (the server's 500)."""
    out: list[object] = []
    for _ in range(times):
        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        async def receive() -> dict[str, Any]:
            return {"type": "http.request"}

        client = ("203.0.113.9", 1)
        scope = {"type": "http", "method": "POST", "path": "/login", "client": client, "headers": []}
        try:
            await mw(scope, receive, send)
            out.append(sent[0]["status"])
        except ValueError:
            out.append(500)
    return out


def aiohttp_startup(app: Any, timeout: float = 30.0) -> None:
    """Start ``app`` on a real aiohttp TestServer (127.0.0.1) and close it:
    what its startup raises (a route limit that binds to nothing) is
    raised here."""
    import asyncio

    from aiohttp.test_utils import TestServer

    async def main() -> None:
        server = TestServer(app, host="127.0.0.1")
        try:
            await server.start_server()
        finally:
            await server.close()

    asyncio.run(asyncio.wait_for(main(), timeout))

"""The async API on the in-memory store: it answers at once, like ``allow``."""

from __future__ import annotations

import asyncio

import pytest


def test_allow_async_matches_allow(backend, limiter_cls) -> None:
    async def run() -> None:
        clock = backend.FakeClock(0.0)
        a = limiter_cls(3, 1.0, clock=clock)
        b = limiter_cls(3, 1.0, clock=clock)
        for step in range(6):
            got = await a.allow_async("k", 1 + step % 2)
            want = b.allow("k", 1 + step % 2)
            assert (got.allowed, got.remaining, got.retry_after) == (
                want.allowed,
                want.remaining,
                want.retry_after,
            )
            assert isinstance(got, backend.Decision)
            peeked = await a.peek_async("k")
            assert peeked.allowed == b.peek("k").allowed
        assert a.state("k") == b.state("k")

    asyncio.run(run())


def test_allow_async_validates(backend) -> None:
    limiter = backend.GCRA(5, 1.0, clock=backend.FakeClock(0.0))

    async def run() -> None:
        with pytest.raises(backend.ValidationError):
            await limiter.allow_async("k", 0)
        with pytest.raises(backend.ValidationError):
            await limiter.allow_async(b"k")

    asyncio.run(run())
    assert limiter.state("k") is None

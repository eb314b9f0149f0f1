"""Typing examples: checked by ``mypy --strict`` (not run by pytest), so a
change that breaks how users type against the public API fails CI."""

from __future__ import annotations

from nanolimit import (
    GCRA,
    BatchResult,
    CompoundDecision,
    Decision,
    FakeClock,
    InMemoryStorage,
    LimiterState,
    RateLimiter,
    TokenBucket,
    ValidationError,
)


def decide(limiter: RateLimiter, key: str) -> bool:
    decision = limiter.allow(key)
    return bool(decision.allowed)


def headers_for(limiter: TokenBucket, key: str) -> dict[str, str]:
    decision: Decision = limiter.allow(key, cost=2)
    retry: float = decision.retry_after
    remaining: int = decision.remaining
    assert retry >= 0 and remaining >= 0
    return decision.headers(wall_now=0.0)


def batch(limiter: GCRA, keys: list[str]) -> int:
    result: BatchResult = limiter.allow_many(keys, [1] * len(keys), times=[0.0] * len(keys))
    first: Decision = result[0]
    return result.allowed_count + int(first.allowed)


def compound(storage: InMemoryStorage, a: TokenBucket, b: GCRA) -> str | None:
    answer: CompoundDecision = storage.allow_all([(a, "user:1"), (b, "10.0.0.1", 2)])
    return answer.denied_by


def snapshot(limiter: TokenBucket) -> float | None:
    state: LimiterState | None = limiter.state("user:1")
    return None if state is None else state.level


def build() -> TokenBucket:
    storage = InMemoryStorage(max_keys=1000, on_full="deny_new", evict_idle_after=600.0)
    try:
        return TokenBucket(100, 60.0, storage, FakeClock(0.0), "api", burst=20)
    except ValidationError:
        raise

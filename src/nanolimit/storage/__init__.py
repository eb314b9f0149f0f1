"""The storage layer beyond the in-memory core: Redis and Valkey
(``storage.redis``) and the two-tier store (``storage.two_tier``). It sits
above the core and below the gateway (docs/architecture.md)."""

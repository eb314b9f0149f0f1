"""The storage layer beyond the in-memory core: Redis and Valkey
(``storage.redis``), the two-tier store (``storage.two_tier``) and the
shared-memory zone (``storage.shared_memory``). It sits
above the core and below the gateway (docs/architecture.md)."""

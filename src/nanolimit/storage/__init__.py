"""The storage layer beyond the in-memory core: Redis and Valkey
(``storage.redis``), the two-tier store (``storage.two_tier``) and the
shared-memory zone (``storage.shared_memory``), and ``storage_from_uri``,
which names any of them by a URI (``storage.uri``). It sits
above the core and below the gateway (docs/architecture.md)."""

from .uri import storage_from_uri

__all__ = ["storage_from_uri"]

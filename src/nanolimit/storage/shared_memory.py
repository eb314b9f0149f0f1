"""The shared-memory zone: one budget for every worker process of a host.

``SharedMemoryStorage`` is native (``nanolimit._core``): the striped table in
a named POSIX shared-memory segment, decided in C by every process that
attaches (docs/shared_memory.md). Without the extension (the pure-Python
twin, or ``NANOLIMIT_NO_EXTENSIONS``) the name still imports, and making one
says why it cannot work: Python objects cannot hold state that other
processes decide on at native speed, so there is no pure fallback.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._select import native_core
from ..errors import ValidationError

__all__ = ["SharedMemoryStorage"]

_core = native_core()

if TYPE_CHECKING:
    from .._core import SharedMemoryStorage
elif _core is not None:
    SharedMemoryStorage = _core.SharedMemoryStorage
else:

    class SharedMemoryStorage:
        """Stands in for the native zone where the extension is not built."""

        def __init__(self, name: str, **options: Any) -> None:
            raise ValidationError(
                "SharedMemoryStorage needs nanolimit's native extension, which this process does not "
                "use (not built, or NANOLIMIT_NO_EXTENSIONS is set): install a wheel, or share limits "
                "between processes with RedisStorage"
            )

        @staticmethod
        def attach(name: str) -> Any:
            raise ValidationError("SharedMemoryStorage needs nanolimit's native extension")

        @staticmethod
        def unlink_segment(name: str) -> bool:
            raise ValidationError("SharedMemoryStorage needs nanolimit's native extension")

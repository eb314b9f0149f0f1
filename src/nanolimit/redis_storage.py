"""``nanolimit.redis_storage``, a documented import path: the module lives in
``nanolimit.storage.redis`` (see docs/architecture.md). This name is the same module
object, so its attributes, and pickles that name this path, keep working."""

import sys

from .storage import redis as _module
from .storage.redis import *  # noqa: F403 (the public names, for type checkers)

sys.modules[__name__] = _module

"""``nanolimit.two_tier``, a documented import path: the module lives in
``nanolimit.storage.two_tier`` (see docs/architecture.md). This name is the same module
object, so its attributes, and pickles that name this path, keep working."""

import sys

from .storage import two_tier as _module
from .storage.two_tier import *  # noqa: F403 (the public names, for type checkers)

sys.modules[__name__] = _module

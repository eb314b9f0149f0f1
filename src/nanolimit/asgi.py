"""``nanolimit.asgi``, a documented import path: the module lives in
``nanolimit.gateway.asgi`` (see docs/architecture.md). This name is the same module
object, so its attributes, and pickles that name this path, keep working."""

import sys

from .gateway import asgi as _module
from .gateway.asgi import *  # noqa: F403 (the public names, for type checkers)

sys.modules[__name__] = _module

"""``nanolimit.wsgi``, a documented import path: the module lives in
``nanolimit.gateway.wsgi`` (see docs/architecture.md). This name is the same module
object, so its attributes, and pickles that name this path, keep working."""

import sys

from .gateway import wsgi as _module
from .gateway.wsgi import *  # noqa: F403 (the public names, for type checkers)

sys.modules[__name__] = _module

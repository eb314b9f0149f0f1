"""``nanolimit.aiohttp``, the documented import path of the aiohttp
middleware: the module lives in ``nanolimit.gateway.aiohttp`` (see
docs/architecture.md). This name is the same module object, so its
attributes, and pickles that name this path, keep working."""

import sys

from .gateway import aiohttp as _module
from .gateway.aiohttp import *  # noqa: F403 (the public names, for type checkers)

sys.modules[__name__] = _module

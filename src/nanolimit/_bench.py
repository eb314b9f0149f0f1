"""``nanolimit._bench``, a documented import path: the module lives in
``nanolimit.cli.bench`` (see docs/architecture.md). This name is the same module
object, so its attributes, and pickles that name this path, keep working."""

import sys

from .cli import bench as _module
from .cli.bench import *  # noqa: F403 (the public names, for type checkers)

sys.modules[__name__] = _module

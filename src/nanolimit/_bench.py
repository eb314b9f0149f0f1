"""``nanolimit._bench``, a documented import path: the module lives in
``nanolimit.cli.bench`` (see docs/architecture.md). This name is the same module
object, so its attributes, and pickles that name this path, keep working.

Run (``python -m nanolimit._bench ...``, what CI's bench job calls), it is
``nanolimit bench``."""

import sys

from .cli import bench as _module
from .cli.bench import *  # noqa: F403 (the public names, for type checkers)

if __name__ == "__main__":
    raise SystemExit(_module.main())
sys.modules[__name__] = _module

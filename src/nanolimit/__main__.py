"""``python -m nanolimit``: the command line lives in ``nanolimit.cli.main``.

Imported (not run), this name is that module object, so ``nanolimit.__main__:main``
(the console script) and whatever reached it through this path keep working."""

import sys

from .cli import main as _module
from .cli.main import *  # noqa: F403 (the public names, for type checkers)
from .cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
sys.modules[__name__] = _module

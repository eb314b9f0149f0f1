"""``nanolimit.flask``, the documented import path of the Flask extension: the
module lives in ``nanolimit.gateway.flask`` (see docs/architecture.md). This
name is the same module object, so its attributes, and pickles that name this
path, keep working."""

import sys

from .gateway import flask as _module
from .gateway.flask import *  # noqa: F403 (the public names, for type checkers)

sys.modules[__name__] = _module

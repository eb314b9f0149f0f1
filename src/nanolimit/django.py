"""``nanolimit.django``, the documented import path of the Django adapter
(``"nanolimit.django.RateLimitMiddleware"`` in ``settings.MIDDLEWARE``): the
module lives in ``nanolimit.gateway.django`` (see docs/architecture.md). This
name is the same module object, so settings, decorators and pickles that
name this path keep working."""

import sys

from .gateway import django as _module
from .gateway.django import *  # noqa: F403 (the public names, for type checkers)

sys.modules[__name__] = _module

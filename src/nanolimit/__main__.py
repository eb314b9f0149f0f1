"""``python -m nanolimit``: the command line, which lives in ``nanolimit.cli.main``
(``main`` is also the console script, ``nanolimit.__main__:main``)."""

from .cli.main import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())

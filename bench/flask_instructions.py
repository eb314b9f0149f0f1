"""Instructions per request of the Flask rows of ``asgi_inprocess.py
--frameworks``, under callgrind (``django_instructions.py``'s method: each
row twice in a fresh interpreter, N1 and N2 requests, counted only around
the requests):

    python bench/flask_instructions.py            # every row, 1,000 and 2,000 requests
    python bench/flask_instructions.py --n1 200 --n2 400 nanolimit nanolimit_wsgi

    instructions per request = (count(N2) - count(N1)) / (N2 - N1)

Rows: ``bare`` (the app alone), ``nanolimit`` (the extension, a default
limit), ``nanolimit_denied`` (its 429s, no handler of the app's own),
``nanolimit_counted`` (a limit on the view counting only 5xx answers: each
200 charged, then given back), ``nanolimit_wsgi`` and
``nanolimit_wsgi_denied`` (nanolimit's WSGI middleware around the app, one
prefix rule: the same decision without Flask's hooks).
"""

from __future__ import annotations

import sys

from django_instructions import main

ROWS = (
    "bare",
    "nanolimit",
    "nanolimit_denied",
    "nanolimit_counted",
    "nanolimit_wsgi",
    "nanolimit_wsgi_denied",
)

if __name__ == "__main__":
    sys.exit(main(rows=ROWS, calls="_flask_calls", doc=__doc__ or ""))

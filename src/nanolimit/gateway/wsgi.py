"""WSGI middleware: Flask (``app.wsgi_app = RateLimitMiddleware(app.wsgi_app,
...)``), Django (wrap ``get_wsgi_application()``) or any WSGI callable.

Imports nothing from any framework. A denied request answers 429 with the
docs/spec.md §2 JSON body and headers without calling the app; an admitted one gets
the headers appended in ``start_response``. A shaping leaky-bucket rule
makes the admitted request ``time.sleep(delay)`` in its worker thread first.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from .._select import native_core
from ..errors import ValidationError
from .factory import LimiterFactory
from .keys import KeyExtractor
from .metrics import Metrics
from .middleware import DICT, WSGI_PAIRS, CostTooHigh, render_body
from .middleware import RateLimitPipeline as Core
from .registry import RuleRegistry
from .request import Request

__all__ = ["RateLimitMiddleware", "WSGIApp", "request_from_environ"]

Environ = dict[str, Any]
StartResponse = Callable[..., Any]
WSGIApp = Callable[[Environ, StartResponse], Iterable[bytes]]


class _EnvironHeaders(Mapping[str, str]):
    """``environ``'s ``HTTP_*`` keys as a lower-case header mapping, read
    lazily (no dict is built per request)."""

    __slots__ = ("_environ",)

    def __init__(self, environ: Environ) -> None:
        self._environ = environ

    @staticmethod
    def _cgi(key: str) -> str:
        name = key.upper().replace("-", "_")
        if name in ("CONTENT_TYPE", "CONTENT_LENGTH"):
            return name
        return "HTTP_" + name

    def __getitem__(self, key: str) -> str:
        value = self._environ[self._cgi(key)]
        if not isinstance(value, str):
            raise KeyError(key)
        return value

    def get(self, key: str, default: Any = None) -> Any:
        value = self._environ.get(self._cgi(key), default)
        return value if isinstance(value, str) else default

    def __iter__(self) -> Iterator[str]:
        for key in self._environ:
            if key.startswith("HTTP_"):
                yield key[5:].lower().replace("_", "-")
            elif key in ("CONTENT_TYPE", "CONTENT_LENGTH"):
                yield key.lower().replace("_", "-")

    def __len__(self) -> int:
        return sum(1 for _ in self)


def environ_path(environ: Environ) -> str:
    """The request's path as :func:`request_from_environ` gives it."""
    info = environ.get("PATH_INFO") or ""
    if info[:1] != "/" and info:
        info = "/" + info
    path = (environ.get("SCRIPT_NAME") or "") + info
    if not path.isascii():
        # PEP 3333 hands the path over as latin-1-decoded bytes: rules are
        # written (and ASGI gives paths) in UTF-8
        path = path.encode("latin-1", "replace").decode("utf-8", "replace")
    return path or "/"


def request_from_environ(environ: Environ) -> Request:
    """The gateway's view of a WSGI request: the client is ``REMOTE_ADDR``
    (the connection), the user ``REMOTE_USER``; the path includes
    ``SCRIPT_NAME`` so rules match the public URL of a mounted app.

    The path is handed over as the server decoded it (``/%2flogin`` arrives
    as ``//login``); the ruleset normalises it when it matches
    (:func:`nanolimit.gateway.rules.normalize_path`), the one place ASGI, WSGI and
    the framework-free pipeline share. Only the join is done here: a
    ``PATH_INFO`` without its leading ``/`` is still below ``SCRIPT_NAME``
    (Werkzeug routes ``login`` as ``/login``)."""
    return Request(
        environ.get("REQUEST_METHOD", "GET"),
        environ_path(environ),
        _EnvironHeaders(environ),
        environ.get("REMOTE_ADDR") or None,
        environ.get("REMOTE_USER") or None,
        1,
        None,
        environ,
    )


_JSON = ("Content-Type", "application/json")
# Content-Length by body size: 429 bodies come in a few sizes
_LENGTHS: dict[int, tuple[str, str]] = {}


class RateLimitMiddleware:
    """``RateLimitMiddleware(app, registry, factory, extractor, metrics)``;
    ``core`` shares one framework-free middleware (and its metrics); other
    keywords are the pipeline's options (``headers``, ``header_names``,
    ``on_breach``, ``log_denials``, ``route_resolver``).
    ``deny(request, outcome)`` may return a WSGI app that answers the 429
    instead (None: the default). A rule counting by response is settled
    by the status the app starts its response with."""

    def __init__(
        self,
        app: WSGIApp,
        registry: RuleRegistry | None = None,
        factory: LimiterFactory | None = None,
        extractor: KeyExtractor | None = None,
        metrics: Metrics | None = None,
        *,
        core: Core | None = None,
        request_factory: Callable[[Environ], Request] = request_from_environ,
        sleep: Callable[[float], Any] = time.sleep,
        deny: Callable[[Request, Any], WSGIApp | None] | None = None,
        **pipeline: Any,
    ) -> None:
        if not callable(app) or isinstance(app, RuleRegistry):
            raise TypeError(f"RateLimitMiddleware(app, registry, ...) wraps a WSGI app first, got {app!r}")
        if core is None:
            if registry is None:
                raise TypeError("RateLimitMiddleware needs a registry (or a core)")
            core = Core(registry, factory, extractor, metrics, **pipeline)
        elif pipeline:
            raise TypeError(f"pipeline options {sorted(pipeline)} go to the core you passed, not here")
        if deny is not None and not callable(deny):
            raise TypeError(f"deny must be callable, got {deny!r}")
        _check_routes(core)
        self.deny = deny
        self.app = app
        self.core = core
        self.metrics = core.metrics
        self.request_factory = request_factory
        self.sleep = sleep
        # the pipeline's decide() on the environ's fields: the stock request
        # view, the pipeline's own check() and decide()
        self._lane = (
            request_factory is request_from_environ
            and type(core).check is Core.check
            and type(core).decide is Core.decide
            and type(core).settle is Core.settle
        )

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        request: Request | None = None
        if self._lane:
            # the pipeline's decide(): no Request built unless a rule needs one
            outcome = self.core.decide(
                environ,
                environ.get("REQUEST_METHOD", "GET"),
                environ_path(environ),
                environ.get("REMOTE_ADDR") or None,
                None,
                request_from_environ,
                WSGI_PAIRS if self.deny is None else DICT,
            )
        else:
            request = self.request_factory(environ)
            outcome = self.core.check(request)
        if outcome is None:
            return self.app(environ, start_response)
        headers: Any  # the lane's WSGI pairs (a fresh list), or a dict
        allowed, headers, delay, rule, retry_after, decision, charge = outcome  # one unpacking
        if type(headers) is not list:
            headers = list(headers.items())
        if not allowed:
            if self.deny is not None:
                custom = self.deny(request if request is not None else self.request_factory(environ), outcome)
                if custom is not None:
                    return custom(environ, start_response)
            # outcome.body(), without its call and lookups
            body = outcome.body() if type(decision) is CostTooHigh else render_body(rule, retry_after)
            size = len(body)
            length = _LENGTHS.get(size)
            if length is None:
                length = ("Content-Length", str(size))
                if len(_LENGTHS) < 1024:
                    _LENGTHS[size] = length
            headers += (_JSON, length)
            start_response("429 Too Many Requests", headers)
            return [body]
        if delay > 0.0:
            self.sleep(delay)
        if charge is not None:
            if not self._lane:
                return self._counted(environ, start_response, outcome)
            # the pipeline's own settle() is the charge's, called in place:
            # by the status the response starts with (500 if the app raises
            # first); a restart after an error refunds nothing more

            try:
                response = self.app(environ, _header_start(start_response, headers, charge))
            except BaseException:
                charge.settle(500)
                raise
            if charge.open:  # a lazy app: it starts its response as it is iterated
                return _Settling(response, charge.settle)
            return response
        if not headers:
            return self.app(environ, start_response)
        return self.app(environ, _header_start(start_response, headers))

    def _counted(self, environ: Environ, start_response: StartResponse, outcome: Any) -> Iterable[bytes]:
        """An admitted request under ``count_when`` rules, settled through
        a pipeline whose ``settle`` is its own: by the status it starts its
        response with (500 if the app raises first)."""
        core = self.core
        headers = outcome.headers
        if type(headers) is not list:
            headers = list(headers.items())

        started = False

        def start_settling(status: str, response_headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            nonlocal started
            started = True
            core.settle(outcome, _status_code(status))  # at most once: a restart refunds nothing more
            response_headers = [*response_headers, *headers]
            if exc_info is not None:
                return start_response(status, response_headers, exc_info)
            return start_response(status, response_headers)

        def settle_unstarted(status: int) -> None:
            nonlocal started
            if not started:
                started = True
                core.settle(outcome, status)

        try:
            body = self.app(environ, start_settling)
        except BaseException:
            settle_unstarted(500)
            raise
        if started:
            return body
        return _Settling(body, settle_unstarted)  # a lazy app: it starts its response as it is iterated


def _check_routes(core: Core) -> None:
    """Refuse a ruleset that names routes when nothing tells the pipeline a
    request's route: a bare WSGI app has no route table, so a rules file's
    ``routes = [...]`` limits and ``exempt`` entries would silently never
    apply (every request unlimited by them; a health check refused)."""
    ruleset = core.registry.ruleset
    if not ruleset.routed or core.route_resolver is not None:
        return
    exempt = {entry if isinstance(entry, str) else entry[0] for entry in ruleset.exempt}
    named = sorted(ruleset.routes() | exempt)
    raise ValidationError(
        f"nanolimit.wsgi.RateLimitMiddleware cannot see the app's routes, so the rules and exemptions "
        f"naming routes {named} would never apply: use nanolimit.flask or nanolimit.django (they read "
        "the route table), or pass route_resolver=(request) -> the route template"
    )


class _Settling:
    """A lazy app's response (a generator that calls ``start_response`` as
    it is iterated), whose ``count_when`` charge is still open: settled as
    500 if iterating raises, or if the server closes it with no response
    started, so a crash never spends the client's budget. ``settle`` gives
    back at most once (the charge's own rule), so a status already settled
    stands. ``close()`` reaches the app's iterable, as PEP 3333 asks."""

    __slots__ = ("_body", "_items", "_settle")

    def __init__(self, body: Iterable[bytes], settle: Callable[[int], Any]) -> None:
        self._body = body
        self._settle = settle
        try:
            self._items = iter(body)
        except BaseException:
            settle(500)
            raise

    def __iter__(self) -> Iterator[bytes]:
        return self

    def __next__(self) -> bytes:
        try:
            return next(self._items)
        except StopIteration:
            raise
        except BaseException:
            self._settle(500)  # the app failed: the client sees an error
            raise

    def close(self) -> None:
        try:
            close = getattr(self._body, "close", None)
            if close is not None:
                close()
        finally:
            self._settle(500)  # no response started: the client saw an error


def _header_start_py(
    start_response: StartResponse, headers: list[tuple[str, str]], charge: Any = None
) -> StartResponse:
    """``start_response`` adding ``headers`` and, with a ``charge``,
    settling it by the status (made apart: a closure in ``__call__`` would
    make its names cells on every request)."""

    def start_with_headers(status: str, response_headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
        if charge is not None:
            charge.settle(_status_code(status))
        response_headers = [*response_headers, *headers]  # the outcome's headers, once
        if exc_info is not None:
            return start_response(status, response_headers, exc_info)
        return start_response(status, response_headers)

    return start_with_headers


# The native twin's: a callable object, so no closure is made per request
_header_start: Callable[..., StartResponse] = getattr(native_core(), "header_start", None) or _header_start_py


# status line -> code: apps start their responses with a few constant lines
_CODES: dict[str, int] = {}


def _status_code(status: str) -> int:
    """The code of a WSGI status line (PEP 3333: ``"200 OK"``); 500 for
    one that has none. Only a str is looked up: a status of another type,
    even an unhashable one, is read as ``int(status[:3])``."""
    code = _CODES.get(status) if type(status) is str else None
    if code is None:
        try:
            code = int(status[:3])
        except (TypeError, ValueError):
            code = 500
        if len(_CODES) < 1024 and type(status) is str and len(status) <= 64:
            _CODES[status] = code
    return code

"""Key functions: ``key=callable(request) -> str`` on a rule or a route
declaration, naming whose budget a request spends when no scope says it
(a tenant read from an API key, a session, a header the app trusts).

Why a module of its own: what a key function is handed and what it may
return are decided once here, for every front end. It is handed the
framework's own request, the object its users already write key functions
for (:func:`key_argument`), and what it returns is checked
(:func:`call_key`): a non-empty str. Anything else is an error naming the
rule, raised into the request: a key function is the app's code, and a
wrong one must be seen, never quietly keyed as someone else. A str over
``MAX_KEY_BYTES`` UTF-8 bytes, or one UTF-8 cannot hold (a lone
surrogate), is keyed by its digest (``DIGESTED`` and blake2b-128 hex), as
a scope's value is: its length is the client's to choose (a header, a
token), and a client must not turn its requests into the server's errors
by sending a long one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._validation import check_key
from ..errors import ValidationError
from .keys import MAX_VALUE_BYTES, digest_key
from .request import Request

__all__ = ["DIGESTED", "MAX_KEY_BYTES", "call_key", "key_argument"]

#: The longest key a key function may return, in UTF-8 bytes: the bound a
#: scope's value is kept within (longer ones are digested there).
MAX_KEY_BYTES = MAX_VALUE_BYTES

_Connection: Any = None  # starlette.requests.HTTPConnection, once imported
_StarletteRequest: Any = None


def _starlette(scope: dict[str, Any]) -> Any:
    """A Starlette ``Request`` over an HTTP scope (an ``HTTPConnection``
    over a websocket's), or the scope itself without Starlette."""
    global _Connection, _StarletteRequest
    if _StarletteRequest is None:
        try:
            from starlette.requests import HTTPConnection
            from starlette.requests import Request as StarletteRequest
        except ImportError:
            return scope
        _Connection, _StarletteRequest = HTTPConnection, StarletteRequest
    return (_StarletteRequest if scope["type"] == "http" else _Connection)(scope)


def key_argument(request: Request) -> Any:
    """What a key function is handed: the framework's own request.

    - ASGI (Starlette, FastAPI, Litestar, any ASGI app): a
      ``starlette.requests.Request`` over the scope (an ``HTTPConnection``
      for a websocket), or the scope itself where Starlette is not
      installed;
    - Flask: ``flask.request``; Django: the ``HttpRequest``; aiohttp: the
      ``web.Request``; the WSGI middleware: the WSGI environ;
    - the framework-free pipeline: the gateway :class:`Request` itself.
    """
    native = request.native
    if native is None:
        return request
    if type(native) is dict and native.get("type") in ("http", "websocket"):
        return _starlette(native)
    return native


def call_key(fn: Callable[[Any], Any], request: Request, rule: str) -> str:
    """The key ``fn`` names for ``request`` under ``rule``, checked. What
    ``fn`` raises reaches the front end as it is (the framework answers it:
    a 500, or the ``HTTPException`` the function meant), noted with the
    rule's name where Python keeps notes."""
    try:
        value = fn(key_argument(request))
    except Exception as exc:
        note = getattr(exc, "add_note", None)
        if note is not None:
            note(f"nanolimit: raised by the key function of rule {rule!r}")
        raise
    if type(value) is str and value and value.isascii() and len(value) <= MAX_KEY_BYTES:
        return value
    return _checked(fn, value, rule)


# What a digested key starts with: no ASCII key does, and a non-ASCII one
# that does is marked once more, so no key a function returns is taken for
# another's digest.
DIGESTED = "\u2020"


def _checked(fn: Callable[[Any], Any], value: Any, rule: str) -> str:
    if isinstance(value, str) and value:
        text: str = str.__str__(value)
        marked = text.startswith(DIGESTED)
        try:
            fits = len(text.encode("utf-8")) + (3 if marked else 0) <= MAX_KEY_BYTES
        except UnicodeEncodeError:  # a lone surrogate: no UTF-8 key can hold it
            fits = False
        if not fits:
            return DIGESTED + digest_key(text)
        return DIGESTED + text if marked else text
    try:
        check_key(value, MAX_KEY_BYTES)
    except ValidationError as exc:
        name = getattr(fn, "__qualname__", None) or type(fn).__name__
        raise ValidationError(
            f"rule {rule!r}: its key function {name} returned {value!r}: {exc}; a key function "
            "returns a non-empty str"
        ) from None
    raise AssertionError("unreachable: check_key refuses all but a non-empty str")  # pragma: no cover

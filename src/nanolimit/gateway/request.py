"""The gateway's view of a request: the one value every gateway module reads.

It sits at the bottom of the gateway, importing nothing from it, so keys,
the pipeline and the adapters all depend on it and none on another just to
name a request (keys.py used to import the pipeline for it, which imported
keys.py back).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Request"]


@dataclass(slots=True)
class Request:
    """What the gateway needs to know about a request.

    ``path`` is the decoded path, as ASGI's ``scope["path"]`` and WSGI's
    ``PATH_INFO`` give it; rules match it after
    :func:`nanolimit.gateway.rules.normalize_path` (repeated slashes collapse), and
    a ``GET`` rule covers a ``HEAD`` request. ``headers`` maps lower-case
    names to values; ``client`` is the peer address of the connection (never
    a header, which any client can write); ``user`` is an authenticated user
    id if the framework knows one.

    ``cost`` is how many units the request spends (a fan-out search can
    declare 10); a rule's own ``cost`` multiplies it. ``route`` is the
    framework's matched route template (``/users/{id}/avatar``, under its
    host as ``//host/path``), when the front end knows it: rules declared
    on a route match it, and the pipeline's route cache keys by it.
    ``native`` is the framework's own object (the ASGI scope, the WSGI
    environ, a Flask or Django request), for cost and denial hooks that
    need more than this view.
    """

    method: str
    path: str
    headers: Mapping[str, str] = field(default_factory=dict)
    client: str | None = None
    user: str | None = None
    cost: int = 1
    route: str | None = None
    native: Any = None


def under_root(root: str, path: str) -> str:
    """``path`` under an ASGI ``root_path`` it does not start with: rules are
    written against the public URL, where a mount's prefix is part of it."""
    return root + path if path[:1] == "/" else f"{root}/{path}"


def public_path(root: str, path: str) -> str:
    """The public URL of an ASGI ``path`` under a non-empty ``root_path``. A
    server that follows the spec puts the root in ``path``; an older one
    leaves it out, and then it is joined. The root counts as in ``path``
    only at a segment boundary, as Starlette routes it: ``/v1beta/x`` under
    ``/v1`` is ``/v1/v1beta/x``, not a request for ``/v1beta/x``."""
    if path.startswith(root) and (len(path) == len(root) or path[len(root)] == "/" or root.endswith("/")):
        return path
    return under_root(root, path)

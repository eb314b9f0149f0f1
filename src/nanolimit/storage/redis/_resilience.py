"""Failures: the errors a storage raises, how a server's error reply is
classified (the server's trouble, or one key's), the circuit breaker, and
the one record per outage it lets the storage write.

Why a private module: what counts as "the store is down" decides whether a
request is answered by policy and whether the breaker opens (docs/redis.md,
"Failures"); the rules sit together here, apart from the I/O that meets them.
"""

from __future__ import annotations

import functools
import importlib
import logging
import threading
import time
from collections.abc import Iterable
from typing import Final, Literal

log = logging.getLogger("nanolimit.storage.redis")

OnError = Literal["allow", "deny", "raise", "local"]
# "local": decide in a bounded in-process store at a share of each limit while
# the server is unreachable (``_local``); a key's error reply is denied.
ON_ERROR_POLICIES: Final = ("allow", "deny", "raise", "local")

# --------------------------------------------------------------------------
# Error replies: which say the server cannot answer now (they feed the circuit
# breaker) and which are about one call's key (answered by that key's policy).
# Classified by the reply's error code, its first word; never by its text.

# The server, or its role in a cluster, is not able to serve anyone right now.
SERVER_ERROR_CODES: Final = frozenset(
    {
        "LOADING",  # loading its dataset after a restart
        "BUSY",  # another script is running past the busy threshold
        "MASTERDOWN",  # a replica that lost its primary
        "READONLY",  # a replica (a failover moved the primary)
        "CLUSTERDOWN",
        "TRYAGAIN",  # slot migration in progress
        "MOVED",
        "ASK",
        "NOREPLICAS",
        "NOAUTH",
        "WRONGPASS",
    }
)
# Writes refused server-wide (memory full under noeviction, persistence
# failing): answered per call, not by the breaker, counted in ``write_refused``.
WRITE_REFUSED_CODES: Final = frozenset({"OOM", "MISCONF"})
# The server refused this client the command or the key (an ACL): not one
# key's value, which nobody but the operator can plant, but a deployment that
# limits nothing. Answering it by the policy made ``"allow"`` admit every
# request without a single log line, so it raises under every policy.
PERMISSION_CODES: Final = frozenset({"NOPERM"})

# Codes redis-py/valkey-py strip from the message when they pick a class.
_CLASS_CODES: Final = {
    "NoScriptError": "NOSCRIPT",
    "OutOfMemoryError": "OOM",
    "ReadOnlyError": "READONLY",
    "ExecAbortError": "EXECABORT",
    "NoPermissionError": "NOPERM",
    "AskError": "ASK",
    "MovedError": "MOVED",
    "TryAgainError": "TRYAGAIN",
    "ClusterDownError": "CLUSTERDOWN",
    "MasterDownError": "MASTERDOWN",
    "ClusterCrossSlotError": "CROSSSLOT",
    "BusyLoadingError": "LOADING",
    "AuthenticationError": "NOAUTH",
}


def _code_of_text(text: str) -> str:
    """The error code that starts an error reply's text (``"ERR"`` when the
    text starts with none: redis-py strips ``ERR``)."""
    word = text.split(" ", 1)[0]
    if word.isascii() and word.isupper() and word.replace("_", "").isalpha():
        return word
    return "ERR"


@functools.cache
def _class_codes(package: str) -> dict[type, str]:
    """The classes of ``package.exceptions`` (redis-py, valkey-py) that stand
    for a stripped error code, by identity: a class elsewhere that merely
    shares a name is not one of them."""
    try:
        exceptions = importlib.import_module(package + ".exceptions")
    except ImportError:
        return {}
    codes: dict[type, str] = {}
    for name, code in _CLASS_CODES.items():
        cls = getattr(exceptions, name, None)
        if isinstance(cls, type):
            codes[cls] = code
    return codes


def _code_of_class(exc: BaseException) -> str | None:
    """The code the client stripped when it picked ``exc``'s class (or a
    class ``exc``'s derives from), else None."""
    codes = _class_codes(type(exc).__module__.split(".")[0])
    if codes:
        for cls in type(exc).__mro__:
            found = codes.get(cls)
            if found is not None:
                return found
    return None


def error_code(exc: BaseException) -> str:
    """The error code of a server's error reply (``WRONGTYPE``, ``OOM``,
    ``BADSTATE``, ...): redis-py 8's ``status_code``, else the class the
    client picked for it, else the first word of the reply."""
    code = getattr(exc, "status_code", None)
    if isinstance(code, str) and code:
        return code
    found = _code_of_class(exc)
    if found is not None:
        return found
    return _code_of_text(str(exc.args[0]) if exc.args else "")


def is_noscript(exc: BaseException) -> bool:
    """redis-py and valkey-py raise ``NoScriptError`` (the ``NOSCRIPT`` prefix
    stripped); other clients may hand back the raw reply."""
    return error_code(exc) == "NOSCRIPT"


# --------------------------------------------------------------------------
# Circuit breaker


class _Breaker:
    """Closed → (``threshold`` consecutive failures) → open for ``cooldown``
    seconds, answering by policy without a round trip → half-open: one caller
    probes; failure opens it again, success starts the recovery. Stops a dead
    server from costing every request a full timeout.

    Hysteresis: a probe's success does not close the breaker outright. It
    lets traffic through again (``state`` is ``closed``), but the breaker
    stays *recovering* until ``threshold`` answers in a row have come back; one
    failure meanwhile opens it again at once, without counting up to the
    threshold anew. A flapping server therefore costs one outage, not one per
    flap: ``closed`` (what ends an ``on_error="local"`` episode) is only true
    once the recovery is complete.

    ``name`` is what the breaker guards: ``""`` for a standalone server (or
    a Sentinel-managed one), a cluster node's ``host:port``, one breaker per
    node (see ``_cluster``).

    An *outage* (an episode) runs from a failure while ``closed`` to the
    answer that makes it ``closed`` again: :meth:`failure` says when one
    starts and :meth:`success` when it ends, so the storage logs each once
    (a flapping server is one outage, as above)."""

    __slots__ = (
        "_down",
        "_failures",
        "_lock",
        "_open_until",
        "_probing",
        "_recovering",
        "_tripped",
        "cooldown",
        "name",
        "opened",
        "retired",
        "threshold",
    )

    def __init__(self, threshold: int, cooldown: float, name: str = "") -> None:
        self.threshold = threshold
        self.cooldown = cooldown
        self.name = name
        self._failures = 0  # consecutive failures while closed
        self._tripped = False  # open or half-open: calls are refused but for a probe
        self._recovering = 0  # answers still wanted in a row before it is closed again
        self._open_until = 0.0
        self._probing = False
        self._lock = threading.Lock()
        self.opened = 0
        self._down = False  # in an outage: from its first failure until closed again
        # its node left the cluster's map (``_cluster``): a decision still
        # routed here is stale, and must not open a fresh local episode
        self.retired = False

    def allow_call(self) -> bool:
        if not self._tripped:
            return True
        with self._lock:
            if not self._tripped:
                return True
            now = time.monotonic()
            if now < self._open_until:
                return False
            # Half-open: this caller is the probe. A probe that never reports
            # (cancelled, interrupted, failed on its own input) must not keep
            # the breaker half-open for good: after another cooldown the next
            # caller probes instead.
            self._probing = True
            self._open_until = now + self.cooldown
            return True

    def success(self) -> bool:
        """An answer; True when it ends an outage (the breaker closed again)."""
        # in an outage one of the three is set, so the common case is this test
        if self._failures or self._tripped or self._recovering:
            with self._lock:
                self._failures = 0
                self._probing = False
                if self._tripped:
                    self._tripped = False
                    self._recovering = self.threshold - 1  # this answer is the first of them
                elif self._recovering:
                    self._recovering -= 1
                if self._down and not self._recovering:
                    self._down = False
                    return True
        return False

    def failure(self) -> bool:
        """A failure; True when it starts an outage."""
        with self._lock:
            probe, self._probing = self._probing, False
            began = not self._down
            self._down = True
            if self._tripped or self._recovering:
                # open again at once: a relapse during the recovery, or a failed
                # half-open probe (each is an opening; a call that was in flight
                # when it opened is not)
                if not self._tripped or probe:
                    self.opened += 1
                self._tripped = True
                self._recovering = 0
                self._open_until = time.monotonic() + self.cooldown
                return began
            self._failures += 1
            if self._failures >= self.threshold:
                self._tripped = True
                self._failures = 0
                self.opened += 1
                self._open_until = time.monotonic() + self.cooldown
            return began

    @property
    def closed(self) -> bool:
        """Neither open, half-open nor recovering: the outage is over."""
        return not self._tripped and not self._recovering

    @property
    def recovering(self) -> bool:
        """Letting calls through again, but not yet ``closed``."""
        return not self._tripped and self._recovering > 0

    @property
    def state(self) -> str:
        """``closed`` (calls go through; maybe still recovering), ``open``
        or ``half-open`` (the next caller probes)."""
        if not self._tripped:
            return "closed"
        return "half-open" if time.monotonic() >= self._open_until else "open"


def log_outage(address: str, breaker: _Breaker, exc: BaseException, policies: Iterable[str]) -> None:
    """The first failure of an outage (:meth:`_Breaker.failure` said so):
    one WARNING naming where the store is (``address``, redacted), the
    error, and the policy answering until the store answers again."""
    text = str(exc).replace("\n", " ")
    first, *rest = policies
    every = sorted({first, *rest})
    answer = f"on_error={first!r}" + (f" (per rule: {every})" if len(every) > 1 else "")
    log.warning(
        "nanolimit: the Redis store at %s%s is failing (%s: %s): decisions follow %s until it "
        "answers again (logged once per outage)",
        address,
        f" (node {breaker.name})" if breaker.name else "",
        type(exc).__name__,
        text if len(text) <= 200 else text[:200] + "...",
        answer,
        extra={"store": address, "node": breaker.name},
    )


def log_recovery(address: str, breaker: _Breaker) -> None:
    """The answer that ends an outage (the breaker closed again)."""
    log.info(
        "nanolimit: the Redis store at %s%s answers again: decisions are its own",
        address,
        f" (node {breaker.name})" if breaker.name else "",
        extra={"store": address, "node": breaker.name},
    )

"""``nanolimit inspect KEY`` and ``nanolimit clear KEY``: one key of a live store.

``inspect`` prints what the store holds for KEY under one rule (the
limiter's ``state(key)``) and what KEY's next request would get (``peek``:
nothing is spent); ``clear`` forgets KEY under that rule
(``limiter.reset(key)``), so its next request sees a full budget, and says
whether there was anything to forget.

The store is named by a URI (``--storage``, the same URIs as
``nanolimit.storage_from_uri``; docs/storage_uris.md): ``redis://HOST:PORT/DB``
and the other Redis and Valkey schemes (add ``?prefix=...`` if the gateway
sets one: the prefix is part of every Redis key), or ``shm://NAME`` for a
shared-memory zone, attached with the zone's own parameters. ``memory://``
works too, but a fresh process's memory holds nothing: there every key
reads as never seen. An ``async+`` scheme is read synchronously here (the
same server, the same keys). Errors from Redis are reported, never
answered by a failure policy.

The rule: ``--rules FILE --rule NAME`` reads it from a rules file (TOML or
JSON, as the gateway loads it; ``default`` names the file's default rule),
or ``--rule NAME --algorithm ALG --rate RATE`` describes it. The rule's name
and algorithm are part of where the state lives, so they must be the
gateway's.

KEY is the client as the rule counts it, turned into the limiter's key as
the gateway does: an address for ``ip`` (``203.0.113.7``, or an IPv6 address,
counted by its /64), a user id for ``user``, the API key itself for
``api_key`` (the gateway keys a digest of it), anything for ``global``.
``--scope`` defaults to the rule's own scope from a rules file; with
``--rate`` give it, or KEY is taken as the limiter's key as it is
(``--scope raw``, e.g. ``user:42``).

Exit status: 0 done; 1 the store could not be reached; 2 a bad URI, rule,
key or option (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .._limiter_config import Algorithm
from ..errors import ValidationError
from ..gateway.factory import LimiterFactory
from ..gateway.keys import DefaultKeyExtractor
from ..gateway.request import Request
from ..gateway.rules import KeyScope, RateLimitRule
from ..storage.uri import redact_uri, storage_from_uri, storage_kind

__all__ = ["RAW", "add_arguments", "clear", "inspect_key"]

#: ``--scope raw``: KEY is the limiter's key as it is
RAW = "raw"
_DECISION_FIELDS = (
    "allowed",
    "limit",
    "remaining",
    "retry_after",
    "reset_after",
    "delay",
    "degraded",
    "reason",
)


class _Refused(Exception):
    """Bad input: exit 2 with this line."""


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    """The options both commands take."""
    parser.add_argument("key", metavar="KEY", help="the client, as the rule counts it (see --scope)")
    parser.add_argument(
        "--storage",
        required=True,
        metavar="URI",
        help="the store: redis://HOST:PORT/DB[?prefix=...], shm://NAME, memory:// ... (docs/storage_uris.md)",
    )
    parser.add_argument("--rules", metavar="FILE", help="read the rule from this rules file (TOML or JSON)")
    parser.add_argument(
        "--rule", required=True, metavar="NAME", help="the rule's name, as the gateway has it"
    )
    parser.add_argument(
        "--algorithm",
        choices=[a.value for a in Algorithm],
        help="the rule's algorithm (without --rules; default token_bucket)",
    )
    parser.add_argument(
        "--rate", help='the rule\'s limit (without --rules), e.g. "100/minute" or "10/s burst 20"'
    )
    parser.add_argument(
        "--scope",
        choices=[RAW, *(s.value for s in KeyScope)],
        help="how KEY becomes the limiter's key (default: the rule's scope with --rules, else raw)",
    )
    if command == "inspect":
        parser.add_argument("--json", action="store_true", help="print the report as JSON")


def _rule(args: argparse.Namespace) -> RateLimitRule:
    if args.rules is not None:
        if args.rate is not None or args.algorithm is not None:
            raise _Refused("--rate and --algorithm describe a rule without --rules; give one or the other")
        from ..gateway.config import load_rules

        try:
            loaded = load_rules(args.rules)
        except OSError as exc:
            raise _Refused(f"cannot read {args.rules}: {exc.strerror or exc}") from None
        except ValidationError as exc:
            raise _Refused(" ".join(str(exc).split())) from None
        for rule in loaded.active():
            if rule.name == args.rule:
                return rule
        if args.rule == "default" and loaded.default is not None:
            # the file's [default] by its role, whatever name it was given
            return loaded.default
        names = ", ".join(rule.name for rule in loaded.active())
        raise _Refused(f"{args.rules} has no rule {args.rule!r} (it has: {names})")
    if args.rate is None:
        raise _Refused("give --rules FILE, or --rate RATE (and --algorithm) to describe the rule")
    return RateLimitRule.from_rate(
        args.rule,
        args.rate,
        scope=args.scope if args.scope not in (None, RAW) else KeyScope.IP,
        algorithm=args.algorithm or Algorithm.TOKEN_BUCKET,
    )


def _limiter_key(key: str, scope: str) -> str:
    """KEY as the gateway's key extractor turns it into the limiter's key."""
    if scope == RAW:
        return key
    extractor = DefaultKeyExtractor()
    kind = KeyScope(scope)
    if kind is KeyScope.USER:
        request = Request("GET", "/", user=key)
    elif kind is KeyScope.API_KEY:
        request = Request("GET", "/", headers={"x-api-key": key})
    else:
        request = Request("GET", "/", client=key)
    return extractor.storage_key_for(request, kind)


def _storage(uri: str) -> Any:
    kind = storage_kind(uri)
    if kind == "async":  # the same server and keys, read synchronously
        scheme, _, rest = uri.strip().partition("://")
        uri = f"{scheme[len('async+') :]}://{rest}"
        kind = "redis"
    if kind == "redis":
        return storage_from_uri(uri, on_error="raise")  # a failure is reported, not answered
    return storage_from_uri(uri)


def _setup(args: argparse.Namespace) -> tuple[Any, Any, RateLimitRule, str]:
    rule = _rule(args)
    scope = args.scope or (rule.scope.value if args.rules is not None else RAW)
    key = _limiter_key(args.key, scope)
    storage = _storage(args.storage)
    try:
        limiter = LimiterFactory(storage).for_rule(rule)
    except BaseException:
        _close(storage)
        raise
    return storage, limiter, rule, key


def _close(storage: Any) -> None:
    close = getattr(storage, "close", None)
    if callable(close):
        close()


def _run(command: str, args: argparse.Namespace, body: Any) -> int:
    """Run ``body(storage, limiter, rule, key)``; bad input is one line and
    exit 2, an unreachable store one line and exit 1, never a traceback."""
    try:
        storage, limiter, rule, key = _setup(args)
    except (_Refused, ValidationError, ValueError) as exc:
        print(f"nanolimit {command}: {_line(exc)}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - the store's own errors, whatever its library
        print(f"nanolimit {command}: {redact_uri(args.storage)}: {_line(exc)}", file=sys.stderr)
        return 1
    try:
        return int(body(storage, limiter, rule, key))
    except ValidationError as exc:
        print(f"nanolimit {command}: {_line(exc)}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001
        print(f"nanolimit {command}: {redact_uri(args.storage)}: {_line(exc)}", file=sys.stderr)
        return 1
    finally:
        _close(storage)


def _line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if isinstance(exc, (_Refused, ValidationError)) else f"{type(exc).__name__}: {text}"


def _state_fields(state: Any) -> dict[str, Any] | None:
    if state is None:
        return None
    out: dict[str, Any] = {}
    for name in ("algorithm", "updated_at", "level", "window_index", "count", "previous", "tat", "log"):
        value = getattr(state, name, None)
        if value is None:
            continue
        if isinstance(value, Algorithm):
            value = value.value
        elif isinstance(value, tuple):
            value = list(value)
        out[name] = value
    return out


def _where(storage: Any, limiter: Any, key: str) -> dict[str, Any]:
    where: dict[str, Any] = {"storage": type(storage).__name__}
    redis_key = getattr(storage, "redis_key", None)
    if callable(redis_key):
        where["redis_key"] = redis_key(limiter.config, key)
    name = getattr(storage, "name", None)
    if isinstance(name, str):
        where["zone"] = name
    return where


def inspect_key(args: argparse.Namespace) -> int:
    """``nanolimit inspect``."""

    def body(storage: Any, limiter: Any, rule: RateLimitRule, key: str) -> int:
        state = _state_fields(limiter.state(key))
        decision = limiter.peek(key)
        nxt = {name: getattr(decision, name) for name in _DECISION_FIELDS if hasattr(decision, name)}
        report = {
            "key": key,
            "rule": {
                "name": rule.name,
                "algorithm": rule.algorithm.value,
                "limit": rule.limit,
                "window_seconds": rule.window_seconds,
                "burst": rule.burst,
                "scope": rule.scope.value,
            },
            **_where(storage, limiter, key),
            "exists": state is not None,
            "state": state,
            "next": nxt,
        }
        if args.json:
            print(json.dumps(report, indent=2))
            return 0
        print(f"key        {key}")
        burst = f" burst {rule.burst}" if rule.burst is not None else ""
        print(f"rule       {rule.name}: {rule.algorithm.value} {rule.limit}/{rule.window_seconds:g}s{burst}")
        for name in ("storage", "redis_key", "zone"):
            if name in report:
                print(f"{name:<10} {report[name]}")
        if state is None:
            print("state      none: the store holds nothing for this key (a full budget)")
        else:
            print("state      " + " ".join(f"{k}={v}" for k, v in state.items() if k != "algorithm"))
        verdict = "allowed" if nxt.get("allowed") else "denied"
        print(
            f"next       {verdict}: remaining {nxt.get('remaining')} of {nxt.get('limit')}, "
            f"retry_after {nxt.get('retry_after', 0.0):.3f}s, reset_after {nxt.get('reset_after', 0.0):.3f}s"
        )
        return 0

    return _run("inspect", args, body)


def clear(args: argparse.Namespace) -> int:
    """``nanolimit clear``."""

    def body(storage: Any, limiter: Any, rule: RateLimitRule, key: str) -> int:
        existed = limiter.state(key) is not None
        limiter.reset(key)
        if existed:
            print(f"cleared {key} under rule {rule.name} ({rule.algorithm.value}): it existed")
        else:
            print(f"{key} had no state under rule {rule.name} ({rule.algorithm.value}): nothing to clear")
        return 0

    return _run("clear", args, body)

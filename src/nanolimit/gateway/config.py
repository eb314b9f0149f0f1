"""Rules files (TOML or JSON) and their hot reload.

``load_rules(path)`` validates the whole file and raises one
:class:`ConfigError` listing every bad rule with its name and the field at
fault, so an operator fixes a file in one pass. :class:`ConfigWatcher` polls
the file; a changed file, once two polls in a row read the same bytes, is
validated and swapped in with ``RuleRegistry.replace`` (atomic); a bad one
leaves the old rules running and logs why. Unchanged rules keep their limiters and their keys' state.

File format (TOML; JSON has the same shape)::

    stacked = false            # optional: every matching rule applies

    [default]                  # optional: for requests no rule matches
    rate = "1000/hour"
    scope = "ip"

    [[rules]]
    name = "login"
    method = "POST"            # default "*"
    path_prefix = "/login"     # default "/"
    scope = "ip"               # user | api_key | ip | global (default ip)
    algorithm = "sliding_counter"   # default token_bucket
    rate = "5/minute"          # or: limit = 5 and window_seconds = 60
    tier = "free"              # optional
    dry_run = false            # optional: shadow mode
    shape = true               # optional: leaky bucket waits its delay

    [storage]                  # optional: where the limiters keep their state
    type = "shared_memory"     # memory (the default) | shared_memory
    name = "api-gateway"       # shared_memory: the zone every worker attaches to
    max_keys = 100000          # the zone's fixed capacity (memory: its bound)
    on_full = "evict"          # optional: evict | deny_new
    evict_idle_after = 3600    # optional: seconds
    arena_bytes = 8388608      # optional (shared_memory): room for sliding logs
    stripes = 64               # optional

The storage section is read when the gateway starts (``LoadedRules.factory``
builds the limiters on it); a reload that changes it is refused, because a
zone's capacity is fixed and its state lives on in other processes.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import stat
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from typing_extensions import Self

from ..errors import ConfigError, Problem, RuleValidationError, ValidationError
from .factory import LimiterFactory
from .rates import parse_rates, rate_rule_name
from .registry import RuleRegistry
from .rules import RateLimitRule

# tomllib (3.11+), else the tomli backport if installed (Python 3.10), else JSON only.
tomllib: Any
try:
    tomllib = importlib.import_module("tomllib" if sys.version_info >= (3, 11) else "tomli")
except ImportError:  # pragma: no cover - Python 3.10 without tomli
    tomllib = None

__all__ = [
    "ConfigWatcher",
    "LoadedRules",
    "StorageSection",
    "load_rules",
    "parse_rules",
]

log = logging.getLogger("nanolimit.config")

_RULE_FIELDS = {
    "name",
    "method",
    "path_prefix",
    "scope",
    "algorithm",
    "rate",
    "limit",
    "window_seconds",
    "burst",
    "tier",
    "dry_run",
    "shape",
    "cost",
    "routes",
    "count_when",
    "group",
}
_TOP_FIELDS = {"rules", "default", "stacked", "storage", "exempt"}

# The storage section's fields, by type: (field, accepted types, description).
_STORAGE_FIELDS: dict[str, dict[str, tuple[type | tuple[type, ...], str]]] = {
    "memory": {
        "max_keys": (int, "an int"),
        "on_full": (str, "a string"),
        "evict_idle_after": ((int, float), "a number of seconds"),
        "stripes": (int, "an int"),
    },
    "shared_memory": {
        "name": (str, "a string"),
        "max_keys": (int, "an int"),
        "on_full": (str, "a string"),
        "evict_idle_after": ((int, float), "a number of seconds"),
        "stripes": (int, "an int"),
        "arena_bytes": (int, "an int"),
        "if_stale": (str, "a string"),
    },
    "uri": {"uri": (str, "a storage URI, e.g. 'redis://host:6379/0' (see docs/storage_uris.md)")},
}
_STORAGE_REQUIRED = {"memory": (), "shared_memory": ("name", "max_keys"), "uri": ("uri",)}


def _field_name(key: object) -> str:
    """A field name as a message can show it: an odd one (empty, blank,
    not a str) is quoted so the reader sees what was there."""
    if isinstance(key, str) and key.strip() and key.isprintable():
        return key
    return repr(key)


def _shown_option(key: str, value: Any) -> str:
    """An option's value as any output shows it: a URI with its passwords
    as ``***`` (``redact_uri``), a secret-looking option as ``***`` whole."""
    from ..storage.uri import SECRET_FIELD_NAME, redact_uri

    if key == "uri":
        return repr(redact_uri(value)) if isinstance(value, str) else f"<{type(value).__name__}>"
    if SECRET_FIELD_NAME.search(key):
        return "'***'"
    return repr(value)


@dataclass(frozen=True)
class StorageSection:
    """A rules file's ``[storage]``: the type and its options, checked.

    Its ``repr`` (and so a ``LoadedRules``' one, and what an ``on_reload``
    hook logs of either) shows a URI without its passwords: ``options``
    keeps the URI as given, for ``build`` alone."""

    type: str = "memory"
    options: tuple[tuple[str, Any], ...] = ()

    def shown_options(self) -> str:
        """``key=value ...`` as output may show them (no password in any spelling)."""
        return " ".join(f"{key}={_shown_option(key, value)}" for key, value in self.options)

    def __repr__(self) -> str:
        options = ", ".join(f"({key!r}, {_shown_option(key, value)})" for key, value in self.options)
        if len(self.options) == 1:
            options += ","
        return f"StorageSection(type={self.type!r}, options=({options}))"

    def build(self) -> Any:
        """The storage it describes: every worker that builds a
        ``shared_memory`` section attaches to the one zone of that name."""
        options = dict(self.options)
        if self.type == "uri":
            from ..storage.uri import storage_from_uri

            return storage_from_uri(options["uri"])
        if self.type == "shared_memory":
            from ..storage.shared_memory import SharedMemoryStorage

            return SharedMemoryStorage(options.pop("name"), **options)
        from .._select import twin
        from .factory import DEFAULT_MAX_KEYS

        options.setdefault("max_keys", DEFAULT_MAX_KEYS)
        return twin.InMemoryStorage(**options)


@dataclass(frozen=True)
class LoadedRules:
    """A validated rules file: what ``RuleRegistry`` and ``LimiterFactory`` need."""

    rules: tuple[RateLimitRule, ...]
    default: RateLimitRule | None = None
    stacked: bool = False
    storage: StorageSection | None = None
    exempt: tuple[str, ...] = ()

    def registry(self, *, cache_size: int = 4096) -> RuleRegistry:
        return RuleRegistry(
            self.rules, self.default, stacked=self.stacked, cache_size=cache_size, exempt=self.exempt
        )

    def factory(self, clock: Any = None) -> LimiterFactory:
        """A factory on the file's ``[storage]`` (the bounded in-memory
        default without one); a storage that cannot be made is a
        ``ConfigError`` naming the section."""
        if self.storage is None:
            return LimiterFactory(clock=clock)
        try:
            storage = self.storage.build()
        except ValidationError as exc:
            raise ConfigError("<rules>", [Problem("-", "storage", str(exc))]) from None
        return LimiterFactory(storage, clock)

    def active(self) -> tuple[RateLimitRule, ...]:
        return self.rules if self.default is None else (*self.rules, self.default)


def _rule(table: Any, label: str, problems: list[Problem], defaults: dict[str, Any]) -> list[RateLimitRule]:
    """The rules of one table: one, or one per rate of a rate list (named
    ``<name>:<window>s`` by :func:`rate_rule_name`, so a limit edit keeps
    the spent budget; one group: they decide together)."""
    if not isinstance(table, dict):
        problems.append(Problem(label, "-", f"a rule must be a table, got {type(table).__name__}"))
        return []
    raw_name = table.get("name", defaults.get("name", label))
    # problems are reported under the rule's name, or its position when the
    # name itself is unusable (not a string, or blank)
    name = raw_name if isinstance(raw_name, str) and raw_name.strip() else label
    if name is label and "name" in table:
        problems.append(Problem(label, "name", f"must be a non-empty string, got {raw_name!r}"))
    unknown = sorted(set(table) - _RULE_FIELDS)
    for key in unknown:
        problems.append(Problem(name, _field_name(key), "unknown field"))
    before = len(problems)
    burst: Any = table.get("burst")
    rates: list[tuple[Any, Any, Any]] = [(table.get("limit"), table.get("window_seconds"), burst)]
    if "rate" in table:
        if "limit" in table or "window_seconds" in table:
            problems.append(Problem(name, "rate", "give either rate or limit and window_seconds, not both"))
        else:
            try:
                parsed = parse_rates(table["rate"])
            except ValidationError as exc:
                problems.append(Problem(name, "rate", str(exc)))
            else:
                if burst is not None and (len(parsed) > 1 or parsed[0].burst is not None):
                    problems.append(Problem(name, "burst", "given both in rate and as burst"))
                rates = [(r.limit, r.window_seconds, burst if r.burst is None else r.burst) for r in parsed]
    else:
        for key in ("limit", "window_seconds"):
            if key not in table:
                problems.append(Problem(name, key, "missing (or give rate)"))
    if len(problems) > before:
        return []
    out = []
    for limit, window, burst_ in rates:
        rule_name = name if len(rates) == 1 else rate_rule_name(name, window)
        try:
            out.append(
                RateLimitRule(
                    rule_name,
                    table.get("method", defaults.get("method", "*")),
                    table.get("path_prefix", defaults.get("path_prefix", "/")),
                    table.get("scope", "ip"),
                    table.get("algorithm", "token_bucket"),
                    limit,
                    window,
                    burst_,
                    tier=table.get("tier"),
                    dry_run=table.get("dry_run", False),
                    shape=table.get("shape", True),
                    cost=table.get("cost", 1),
                    routes=table.get("routes", ()),
                    count_when=table.get("count_when"),
                    group=table.get("group", name if len(rates) > 1 else None),
                )
            )
        except RuleValidationError as exc:
            problems.append(Problem(exc.rule if exc.rule == rule_name else name, exc.field, exc.message))
    return out


def _storage(table: Any, problems: list[Problem]) -> StorageSection | None:
    if not isinstance(table, dict):
        problems.append(Problem("-", "storage", f"must be a table, got {type(table).__name__}"))
        return None
    kind = table.get("type", "memory")
    if not isinstance(kind, str) or kind not in _STORAGE_FIELDS:  # a list is unhashable: str first
        from ..storage.uri import redact_uri

        kinds = ", ".join(_STORAGE_FIELDS)
        # a URI pasted as the type (type = "redis://app:PASSWORD@host") is shown redacted
        got = repr(redact_uri(kind)) if isinstance(kind, str) else type(kind).__name__
        problems.append(Problem("storage", "type", f"must be one of {kinds}, got {got}"))
        return None
    fields = _STORAGE_FIELDS[kind]
    before = len(problems)
    for key in sorted(set(table) - set(fields) - {"type"}):
        problems.append(Problem("storage", _field_name(key), f"unknown field for type {kind!r}"))
    for key in _STORAGE_REQUIRED[kind]:
        if key not in table:
            problems.append(Problem("storage", key, f"missing (type {kind!r} needs it)"))
    options = []
    for key, (types, what) in fields.items():
        if key not in table:
            continue
        value = table[key]
        if isinstance(value, bool) or not isinstance(value, types):
            got = "a " + type(value).__name__ if key == "uri" else _shown_option(key, value)
            problems.append(Problem("storage", key, f"must be {what}, got {got}"))
        options.append((key, value))
    if len(problems) > before:
        return None
    section = StorageSection(kind, tuple(options))
    problem = _check_section(section)
    if problem is not None:
        problems.append(problem)
        return None
    return section


def _check_section(section: StorageSection) -> Problem | None:
    """The section's options range-checked now, as the storage would check
    them when it is built (so check-config and a reload refuse what the
    gateway's start would): nothing is made or connected."""
    from .._validation import check_storage_options
    from ..storage.uri import check_storage_uri

    options = dict(section.options)
    try:
        if section.type == "uri":
            check_storage_uri(options["uri"])
        elif section.type == "memory":
            from .factory import DEFAULT_MAX_KEYS

            check_storage_options(
                options.get("stripes", 64),
                1024,
                options.get("max_keys", DEFAULT_MAX_KEYS),
                options.get("on_full", "evict"),
                options.get("evict_idle_after"),
            )
        else:
            from .._validation import check_zone_options

            check_zone_options(options.pop("name"), options)
    except ValidationError as exc:
        return Problem("storage", section.type, str(exc))
    return None


def parse_rules(data: Any, source: str = "<rules>") -> LoadedRules:
    """Validate a parsed rules document (a dict, as TOML or JSON gives)."""
    problems: list[Problem] = []
    if not isinstance(data, dict):
        raise ConfigError(source, [Problem("-", "-", "the document must be a table/object")])
    for key in sorted(set(data) - _TOP_FIELDS):
        problems.append(Problem("-", _field_name(key), "unknown top-level field"))
    stacked = data.get("stacked", False)
    if not isinstance(stacked, bool):
        problems.append(Problem("-", "stacked", f"must be a bool, got {stacked!r}"))
        stacked = False
    raw_rules = data.get("rules", [])
    if not isinstance(raw_rules, list):
        problems.append(Problem("-", "rules", "must be an array of tables ([[rules]])"))
        raw_rules = []
    rules: list[RateLimitRule] = []
    seen: dict[str, int] = {}
    for i, table in enumerate(raw_rules):
        label = f"rules[{i}]"
        if isinstance(table, dict) and "name" not in table:
            problems.append(Problem(label, "name", "missing"))
            continue
        for rule in _rule(table, label, problems, {}):
            if rule.name in seen:
                problems.append(Problem(rule.name, "name", f"duplicate of rules[{seen[rule.name]}]"))
                continue
            seen[rule.name] = i
            rules.append(rule)
    default = None
    if "default" in data:
        defaults = _rule(
            data["default"], "default", problems, {"name": "default", "method": "*", "path_prefix": "/"}
        )
        if len(defaults) > 1:
            problems.append(Problem("default", "rate", "the default takes one rate (give a list to a rule)"))
            defaults = []
        default = defaults[0] if defaults else None
        if default is not None and default.name in seen:
            problems.append(Problem(default.name, "name", "the default shares its name with a rule"))
            default = None
    storage = _storage(data["storage"], problems) if "storage" in data else None
    exempt = data.get("exempt", [])
    if isinstance(exempt, str):
        exempt = [exempt]
    if not isinstance(exempt, list) or not all(isinstance(e, str) and e.strip() for e in exempt):
        problems.append(Problem("-", "exempt", f"must be a list of route templates, got {exempt!r}"))
        exempt = []
    if not problems and not rules and default is None:
        # an empty or truncated file would otherwise lift every limit at once
        problems.append(Problem("-", "-", "no rules and no default: nothing to enforce"))
    if problems:
        raise ConfigError(source, problems)
    return LoadedRules(tuple(rules), default, stacked, storage, tuple(exempt))


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose every key is given once: ``json`` keeps the last
    of a repeated key without a word, so ``{"rate": "5/minute", "rate":
    "500/minute"}`` would raise a limit (and a second ``"rules"`` drop every
    rule of the first) where TOML refuses the file."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key[:60]!r} is given twice in one object")
        out[key] = value
    return out


def _parse_bytes(raw: bytes, path: Path) -> Any:
    # utf-8-sig: a byte-order mark (Windows editors write one) is no content;
    # kept, it was "Invalid statement (at line 1, column 1)", invisible in the file
    text = raw.decode("utf-8-sig")
    if path.suffix.lower() == ".json":
        return json.loads(text, object_pairs_hook=_unique_keys)
    if tomllib is None:
        raise ConfigError(
            str(path),
            [Problem("-", "-", "TOML needs Python 3.11+ (tomllib) or the tomli package; or use JSON")],
        )
    return tomllib.loads(text)


def _load_bytes(raw: bytes, path: Path) -> LoadedRules:
    try:
        data = _parse_bytes(raw, path)
    except ConfigError:
        raise
    except RecursionError:
        raise ConfigError(str(path), [Problem("-", "-", "nested too deeply")]) from None
    except (ValueError, UnicodeDecodeError) as exc:  # TOMLDecodeError and JSONDecodeError are ValueErrors
        raise ConfigError(
            str(path), [Problem("-", "-", f"not valid {path.suffix.lstrip('.') or 'toml'}: {exc}")]
        ) from None
    return parse_rules(data, str(path))


#: The most a rules file may hold: it is read whole, at every poll of a watcher.
MAX_RULES_FILE_BYTES: Final = 16 << 20


def _read_rules_file(path: Path) -> bytes:
    """The bytes of a regular file of at most ``MAX_RULES_FILE_BYTES``, else
    a ``ConfigError`` ("cannot read: ..."). A path swapped for a FIFO or a
    device (a symlink to /dev/zero) is refused, not read: a FIFO blocked
    the reader (and a watcher's lock) for good, /dev/zero grew it until
    MemoryError; O_NONBLOCK opens a FIFO without waiting for a writer."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                why = "not a regular file (a directory, a FIFO or a device)"
            else:
                with open(fd, "rb", closefd=False) as f:
                    raw = f.read(MAX_RULES_FILE_BYTES + 1)
                if len(raw) <= MAX_RULES_FILE_BYTES:
                    return raw
                why = f"over {MAX_RULES_FILE_BYTES} bytes"
        finally:
            os.close(fd)
    except OSError as exc:
        why = str(exc.strerror or exc)
    raise ConfigError(str(path), [Problem("-", "-", f"cannot read: {why}")])


def load_rules(path: str | os.PathLike[str]) -> LoadedRules:
    """Read and validate a rules file (``.json`` is JSON, anything else TOML)."""
    p = Path(path)
    return _load_bytes(_read_rules_file(p), p)


_UNSET = object()  # no file installed yet: any storage section is the first
#: The longest poll interval a watcher takes: a day.
MAX_INTERVAL: Final = 86_400.0


class ConfigWatcher:
    """Keeps a registry in step with a rules file.

    ``check()`` polls once (call it from your own scheduler), ``start()``
    polls every ``interval`` seconds on a daemon thread until ``stop()``.
    The file's bytes are compared by digest, so an editor that rewrites the
    same content, or a timestamp-preserving copy, is handled correctly.
    ``on_reload(loaded)`` and ``on_error(exc)`` are optional hooks; an
    exception from ``on_reload`` is logged, and the rules it saw stay
    installed (they were live before it ran).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        registry: RuleRegistry,
        factory: LimiterFactory | None = None,
        *,
        interval: float = 1.0,
        on_reload: Callable[[LoadedRules], None] | None = None,
        on_error: Callable[[Exception], None] | None = None,
    ) -> None:
        from .._validation import check_seconds_option

        # inf or 1e12 passed a "> 0" check and killed the polling thread at its
        # first wait (OverflowError): hot reload gone while start() said nothing
        interval = check_seconds_option("interval", interval, 0, MAX_INTERVAL)
        self.path = Path(path)
        self.registry = registry
        self.factory = factory
        self.interval = float(interval)
        self.on_reload = on_reload
        self.on_error = on_error
        self.reloads = 0
        self.errors = 0
        self.last_error: Exception | None = None
        self._digest: bytes | None = None
        self._bad_digest: bytes | None = None
        self._pending: bytes | None = None  # new bytes seen by one poll, not yet by two
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._storage: StorageSection | object | None = _UNSET

    def load(self) -> LoadedRules:
        """Load the file now and install it; raises on a bad file (the old rules stay)."""
        with self._lock:
            raw = self._read()
            return self._install(raw)

    def _read(self) -> bytes:
        return _read_rules_file(self.path)

    def _install(self, raw: bytes) -> LoadedRules:
        digest = hashlib.blake2b(raw, digest_size=16).digest()
        loaded = _load_bytes(raw, self.path)
        if self._storage is not _UNSET and loaded.storage != self._storage:
            raise ConfigError(
                str(self.path),
                [Problem("-", "storage", "cannot change while running (restart the gateway to move it)")],
            )
        self._storage = loaded.storage
        self.registry.replace(
            loaded.rules, default=loaded.default, stacked=loaded.stacked, exempt=loaded.exempt
        )
        if self.factory is not None:
            self.factory.prune((*loaded.active(), *self.registry.declared))
        self._digest = digest
        self._pending = None
        self._bad_digest = None  # the same bad file again later is logged again
        self.reloads += 1
        log.info("nanolimit: loaded %d rule(s) from %s", len(loaded.rules), self.path)
        if self.on_reload is not None:
            try:
                self.on_reload(loaded)
            except Exception:  # the hook's own fault, not the file's
                # the rules are live: a hook's error must not read as a refused
                # file ("keeping the current rules") nor make check() say False
                log.exception("nanolimit: rules from %s installed; the on_reload hook failed", self.path)
        return loaded

    def check(self) -> bool:
        """Reload if the file changed; True when new rules were installed.
        A bad or unreadable file is logged (once per distinct content or read
        error) and changes nothing.

        Once rules are installed, new bytes are installed only when two polls
        in a row read them: a file rewritten in place (``cat >``, an editor,
        a chunked copy) is valid TOML at many points of its writing, and a
        poll that caught one would run a cut rule set for an interval (a
        limit of ``15`` for ``1500``; a rule not yet written dropped, its
        paths unlimited). Renaming a finished file over it is the safe way
        to write."""
        with self._lock:
            try:
                raw = _read_rules_file(self.path)
            except ConfigError as exc:
                why = "; ".join(p.message for p in exc.problems)
                # keyed by the reason: a missing file is logged once, not at every poll
                key = hashlib.blake2b(b"unreadable\0" + why.encode(), digest_size=16).digest()
                self._fail(exc, key)
                return False
            digest = hashlib.blake2b(raw, digest_size=16).digest()
            if digest == self._digest:
                self._bad_digest = None  # back to the rules running: a new failure is news
                self._pending = None
                return False
            if self._digest is not None and digest != self._pending:
                # first sight: the writer may not be done; the next poll decides
                self._pending = digest
                return False
            try:
                if _read_rules_file(self.path) != raw:
                    return False  # being written (truncated, then filled): the next poll sees it whole
            except ConfigError:
                return False
            try:
                self._install(raw)
            except ValidationError as exc:
                self._fail(exc, digest)
                return False
            except (ValueError, TypeError, ArithmeticError) as exc:
                # a value the loader failed to check: still a bad file, logged
                # once per content, not a traceback per poll
                problem = Problem("-", "-", f"cannot load: {type(exc).__name__}: {exc}")
                self._fail(ConfigError(str(self.path), [problem]), digest)
                return False
            return True

    def _fail(self, exc: Exception, digest: bytes) -> None:
        """Count every failure; log it (and call ``on_error``) only when it
        differs from the last one since the rules last installed or read
        back, so a poll every second does not repeat one error all day."""
        self.errors += 1
        repeated = digest == self._bad_digest
        self._bad_digest = digest
        self.last_error = exc
        if not repeated:
            log.error("nanolimit: keeping the current rules; %s", exc)
            if self.on_error is not None:
                self.on_error(exc)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.check()
            except Exception:  # never let the watcher thread die
                log.exception("nanolimit: rules watcher failed")

    def start(self) -> Self:
        """Poll on a daemon thread (the first poll happens at once)."""
        if self._thread is not None and self._thread.is_alive():
            return self
        self.check()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="nanolimit-config-watcher", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float | None = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

"""Validation of what callers hand in (docs/spec.md §3) and the bounds that keep
every value the kernels compute exact in IEEE double and int64. The native
core re-implements the hot checks in C and uses these for messages.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Iterable, Sequence
from typing import Any, SupportsIndex, cast

from .errors import ValidationError

__all__ = [
    "DUPLICATE_COMPOUND",
    "MAX_COST",
    "MAX_KEYS",
    "MAX_KEY_BYTES",
    "MAX_LIMIT",
    "MAX_LOG_CAPACITY",
    "MAX_STRIPES",
    "MAX_WINDOW",
    "MIN_KEYS_PER_STRIPE",
    "MIN_WINDOW",
    "ON_FULL_POLICIES",
    "as_float",
    "batch_keys",
    "check_batch",
    "check_bounds",
    "check_cost",
    "check_cutoff",
    "check_int_option",
    "check_key",
    "check_seconds_option",
    "check_storage_options",
    "compound_items",
    "stripes_within",
]


# Bounds keep every value the kernels compute exact in IEEE double and int64,
# which is what lets the C kernels, this reference and Lua agree bit for bit.
MAX_LIMIT = (1 << 32) - 1  # window counts are uint32 in the native entry


MAX_COST = MAX_LIMIT


MIN_WINDOW = 1e-6


MAX_WINDOW = 1e9


MAX_KEY_BYTES = 1024


# The sliding log stores one double per unit: 16M units is 128 MiB per key.
MAX_LOG_CAPACITY = 1 << 24


ON_FULL_POLICIES = ("evict", "deny_new")


# A table's bound: each stripe's capacity is a uint32 in the native table (a
# larger one raised OverflowError only when the table was first used: for a
# Redis storage's local fallback, at the first decision of an outage).
MAX_KEYS = (1 << 32) - 1


def _shown(value: object) -> str:
    """``value`` as a message shows it: short, and never failing (an int
    past ``sys.get_int_max_str_digits`` has no repr)."""
    try:
        text = repr(value)
    except ValueError:
        return f"an int of {value.bit_length()} bits" if isinstance(value, int) else type(value).__name__
    return text if len(text) <= 60 else text[:57] + "..."


def as_float(value: float | numbers.Real) -> float:
    """``value`` as a float, an int or other real too large for one as ±inf.

    ``float(10**400)`` and ``math.isfinite(10**400)`` raise OverflowError:
    converted here, such a value meets the caller's finiteness check and is
    refused as a ValidationError like ``inf``."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf  # type: ignore[operator]


def check_int_option(name: str, value: object, low: int, high: int) -> int:
    """An int option in ``[low, high]``, checked where it is given: ``bool``
    is refused (``True`` is not a count), and so is a value the store could
    only fail on later (an int that overflows a C field, a count no memory
    holds). The message names the option and its bounds."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValidationError(f"{name} must be an int in [{low}, {high}], got {_shown(value)}")
    return int(value)


def check_seconds_option(
    name: str, value: object, low: float, high: float, *, low_open: bool = True
) -> float:
    """A number of seconds in ``(low, high]`` (``[low, high]`` when not
    ``low_open``): a finite int or float, not a bool, not NaN or inf."""
    ok = (
        not isinstance(value, bool)
        and isinstance(value, (int, float))
        and math.isfinite(as_float(value))
        and (low < value if low_open else low <= value)
        and value <= high
    )
    if not ok:
        bounds = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise ValidationError(f"{name} must be a finite number of seconds in {bounds}, got {_shown(value)}")
    return float(value)  # type: ignore[arg-type]


def check_bounds(
    max_keys: object, on_full: object, evict_idle_after: object
) -> tuple[int | None, str, float | None]:
    """Validate the bounded-memory options of an InMemoryStorage."""
    if max_keys is not None and (
        isinstance(max_keys, bool) or not isinstance(max_keys, int) or not 1 <= max_keys <= MAX_KEYS
    ):
        raise ValidationError(f"max_keys must be an int in [1, {MAX_KEYS}] or None, got {_shown(max_keys)}")
    if on_full not in ON_FULL_POLICIES:
        raise ValidationError(f"on_full must be one of {ON_FULL_POLICIES}, got {on_full!r}")
    idle: float | None = None
    if evict_idle_after is not None:
        if isinstance(evict_idle_after, bool) or not isinstance(evict_idle_after, (int, float)):
            raise ValidationError(f"evict_idle_after must be seconds or None, got {_shown(evict_idle_after)}")
        idle = as_float(evict_idle_after)
        if not math.isfinite(idle) or idle <= 0:
            raise ValidationError(f"evict_idle_after must be finite and > 0, got {_shown(evict_idle_after)}")
    assert isinstance(on_full, str)
    return max_keys, on_full, idle


MAX_STRIPES = 1 << 16


def check_storage_options(
    stripes: object, max_key_bytes: object, max_keys: object, on_full: object, evict_idle_after: object
) -> tuple[int, int, int | None, str, float | None]:
    """An ``InMemoryStorage``'s options, checked in one place for both twins:
    returns the stripe count it uses (``stripes_within``), ``max_key_bytes``
    and the bounded-memory options."""
    if (
        isinstance(stripes, bool)
        or not isinstance(stripes, int)
        or not 1 <= stripes <= MAX_STRIPES
        or stripes & (stripes - 1)
    ):
        raise ValidationError(f"stripes must be a power of two in [1, {MAX_STRIPES}], got {_shown(stripes)}")
    if (
        isinstance(max_key_bytes, bool)
        or not isinstance(max_key_bytes, int)
        or not 1 <= max_key_bytes <= 1 << 20
    ):
        raise ValidationError(f"max_key_bytes must be an int in [1, 1048576], got {_shown(max_key_bytes)}")
    bounded, policy, idle = check_bounds(max_keys, on_full, evict_idle_after)
    return stripes_within(stripes, bounded), max_key_bytes, bounded, policy, idle


#: A zone's bounds, as ``_core_zone.pxi`` checks them when a zone is made
#: (its ZONE_NAME_BYTES, ZONE_NAME_CHARS, ZONE_MAX_KEYS, and _table.pxd's
#: MAX_STRIPE_ENTRIES); test_storage_uri keeps the two in step.
ZONE_NAME_BYTES = 200
ZONE_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")
ZONE_MAX_KEYS = 1 << 30
MAX_STRIPE_ENTRIES = 0xFFFFFE


def check_zone_name(name: object) -> str:
    """A shared-memory zone's name, as the zone checks it."""
    if not isinstance(name, str):
        raise ValidationError(f"a shared-memory zone's name must be a str, got {type(name).__name__}")
    if not 1 <= len(name) <= ZONE_NAME_BYTES or not set(name) <= ZONE_NAME_CHARS:
        raise ValidationError(
            f"a shared-memory zone's name is 1 to {ZONE_NAME_BYTES} characters of A-Z a-z 0-9 _ . -, "
            f"got {_shown(name)}"
        )
    return name


def check_zone_options(name: object, options: dict[str, Any]) -> None:
    """A ``SharedMemoryStorage(name, **options)``'s arguments checked with
    nothing made: what check-config and a rules file's ``[storage]`` check
    must refuse, so a file they pass never stops the gateway's start."""
    check_zone_name(name)
    max_keys = options.get("max_keys")
    if isinstance(max_keys, bool) or not isinstance(max_keys, int) or not 1 <= max_keys <= ZONE_MAX_KEYS:
        raise ValidationError(
            f"max_keys of a shared-memory zone must be an int in [1, {ZONE_MAX_KEYS:,}], "
            f"got {_shown(max_keys)}"
        )
    stripes, _, _, _, _ = check_storage_options(
        options.get("stripes", 64),
        options.get("max_key_bytes", MAX_KEY_BYTES),
        max_keys,
        options.get("on_full", "evict"),
        options.get("evict_idle_after"),
    )
    per_stripe = -(-max_keys // stripes)
    if per_stripe > MAX_STRIPE_ENTRIES:
        raise ValidationError(
            f"max_keys={max_keys:,} over stripes={stripes} puts {per_stripe:,} keys in a stripe, "
            f"past the {MAX_STRIPE_ENTRIES:,} one can index: give more stripes"
        )
    arena = options.get("arena_bytes")
    if arena is not None and (
        isinstance(arena, bool) or not isinstance(arena, int) or not 0 <= arena <= 1 << 40
    ):
        raise ValidationError(f"arena_bytes must be an int in [0, 2**40], got {_shown(arena)}")
    if options.get("if_stale", "reuse") not in ("reuse", "reset"):
        raise ValidationError(f"if_stale must be 'reuse' or 'reset', got {_shown(options.get('if_stale'))}")


def batch_keys(keys: object) -> list[Any]:
    """A batch's keys as a list. One ``str`` is refused: iterating it
    would decide each of its characters as a key (``allow_many("user42")``
    charged "u", "s", "e", "r", "4", "2" and never "user42")."""
    if isinstance(keys, (str, bytes, bytearray)):
        raise ValidationError(
            f"keys must be a sequence of keys, got one {type(keys).__name__}: pass [key] for a single key"
        )
    try:
        items = iter(cast(Iterable[Any], keys))
    except TypeError:
        raise ValidationError(f"keys must be a sequence of keys, got {type(keys).__name__}") from None
    return list(items)  # an iterator's own error passes through as raised


def check_batch(keys: Sequence[Any], costs: Sequence[Any], capacity: int, max_key_bytes: int) -> list[int]:
    """Every key and cost of a batch, checked before any is spent; returns
    the costs as converted (see ``check_cost``): use those, not ``costs``."""
    if len(costs) != len(keys):
        raise ValidationError(f"{len(keys)} keys but {len(costs)} costs")
    units = []
    for key, cost in zip(keys, costs):
        check_key(key, max_key_bytes)
        units.append(check_cost(cost, capacity))
    return units


# A bounded stripe holds at least this many keys (or all of max_keys): a full
# stripe then has keys to choose a victim among, and a partly spent key is not
# forgotten just because it is alone in its stripe when a newcomer lands there.
MIN_KEYS_PER_STRIPE = 16


def stripes_within(stripes: int, max_keys: int | None) -> int:
    """The stripe count a bounded storage uses: at most one stripe per
    ``MIN_KEYS_PER_STRIPE`` keys of ``max_keys`` (so never more stripes than
    keys), the largest power of two not above that when ``stripes`` is more."""
    if max_keys is not None:
        most = max(1, max_keys // MIN_KEYS_PER_STRIPE)
        if most < stripes:
            return 1 << (most.bit_length() - 1)
    return stripes


def check_cutoff(cutoff: object) -> float:
    """An eviction cutoff: any number but NaN (``inf`` forgets every key)."""
    if isinstance(cutoff, bool) or not isinstance(cutoff, (int, float)):
        raise ValidationError(f"cutoff must be a number of seconds, got {type(cutoff).__name__}")
    value = as_float(cutoff)  # 10**400 is inf: it forgets every key
    if math.isnan(value):
        raise ValidationError("cutoff must not be NaN")
    return value


def check_cost(cost: object, capacity: int) -> int:
    """docs/spec.md §3: an int in [1, capacity], returned as an exact ``int``.

    The value is converted exactly once, by ``operator.index`` (which copies
    an ``int`` subclass's value without calling its ``__int__``), and the
    converted value is what is checked and what every caller must use: an
    ``int`` subclass whose ``__int__`` lies cannot pass as 1 and be charged
    as -5. ``bool`` is refused; numpy integers and ``__index__`` objects are
    accepted by their index."""
    if isinstance(cost, bool):
        raise ValidationError(f"cost must be an int, got {type(cost).__name__}")
    try:
        units = operator.index(cast(SupportsIndex, cost))
    except TypeError:
        raise ValidationError(f"cost must be an int, got {type(cost).__name__}") from None
    if units <= 0:
        raise ValidationError(f"cost must be >= 1, got {units}")
    if units > capacity:
        raise ValidationError(f"cost {units} exceeds the capacity {capacity}: it could never pass")
    return units


def check_key(key: object, max_key_bytes: int) -> bytes:
    """docs/spec.md §3 plus hostile-key hygiene: a non-empty str that encodes to UTF-8
    within ``max_key_bytes``. Returns the encoded bytes."""
    if not isinstance(key, str):
        raise ValidationError(f"key must be a str, got {type(key).__name__}")
    try:
        raw = key.encode("utf-8")
    except UnicodeEncodeError:
        raise ValidationError("key is not valid Unicode (lone surrogate)") from None
    if not raw:
        raise ValidationError("key must not be empty")
    if len(raw) > max_key_bytes:
        raise ValidationError(f"key is {len(raw)} bytes of UTF-8, over the limit of {max_key_bytes}")
    return raw


def compound_items(requests: Any) -> list[tuple[Any, str, int]]:
    """Normalise ``[(limiter, key), (limiter, key, cost), ...]``."""
    items: list[tuple[Any, str, int]] = []
    for request in requests:
        if not isinstance(request, tuple) or len(request) not in (2, 3):
            raise ValidationError("each compound request is (limiter, key) or (limiter, key, cost)")
        limiter, key = request[0], request[1]
        cost = request[2] if len(request) == 3 else 1
        items.append((limiter, key, cost))
    if not items:
        raise ValidationError("a compound request needs at least one limiter")
    return items


DUPLICATE_COMPOUND = "the same rule and key appear twice in one compound request"

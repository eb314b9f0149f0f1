# cython: language_level=3, freethreading_compatible=True, binding=False, embedsignature=True, embedsignature.format=clinic
# cython: boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
# binding=False: methods are builtin methods, which CPython calls directly;
# a cyfunction costs ~100 more instructions a call (-13 % per decision).
# The clinic-format signature keeps inspect.signature() working.
"""The native twin: Decision, the striped in-memory table and the six limiters.

Twin of ``nanolimit.reference``; the kernels are in ``_kernels.pxd`` and the
table in ``_table.pxd``. Hot paths hold the GIL (a decision is cheaper than
releasing it) but only one stripe lock; ``allow_many`` releases the GIL for
the whole batch. No Python object is touched while a stripe lock is held.
"""

cimport cython
from cpython.array cimport array, clone
from cpython.dict cimport PyDict_GetItem, PyDict_SetItem
from cpython.long cimport PyLong_AsLongLongAndOverflow, PyLong_AsSsize_t
from cpython.object cimport PyTypeObject
from cpython.ref cimport Py_DECREF, Py_INCREF, PyObject
from cpython.unicode cimport PyUnicode_AsUTF8AndSize, PyUnicode_DecodeUTF8
from libc.math cimport INFINITY, ceil, fabs, floor, isfinite
from libc.stdint cimport INT64_MIN, int64_t, uint8_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memcmp, memcpy, memmove, memset

from nanolimit._kernels cimport (
    add_clock_lead, clock_rebase, init_state, log_at, log_free, log_reserve, log_ring_size, run_kernel,
)
from nanolimit._table cimport (
    NAMESPACE_CHUNK, NS_ALGORITHM_MASK, Bounds, ObjectList, Stripe, entry_hash, entry_key, prefetch_entry,
    stripe_could_make_room, stripe_make_room, stripe_sweep_idle,
    prefetch_slot, stripe_clear, stripe_delete, stripe_evict, stripe_find, stripe_reclaim,
    BatchReaders, IndexHeader, batch_join, batch_leave,
    stripe_insert,
)
from nanolimit._types cimport (
    ALG_APPLY, ALG_FIXED_WINDOW, ALG_GCRA, ALG_LEAKY_BUCKET, ALG_SLIDING_COUNTER,
    ALG_SLIDING_LOG, ALG_TOKEN_BUCKET, NL_NOMEM, NL_OK, NL_REENTRANT,
    NL_TABLE_FULL, Entry, Params, Verdict, nl_hash_seeded, nl_lock_spin, nl_mum,
    nl_namespace_seed, nl_set_secrets, nl_add_u64_relaxed, nl_load_u64_relaxed,
    nl_cas_u64, nl_floor_i64, nl_load_pointer_relaxed, nl_load_u64_seq,
    nl_trylock, nl_unlock, nl_wall_now,
)

import os
import threading
import weakref

from nanolimit import reference as _reference
from nanolimit._shared import (
    MAX_KEY_BYTES,
    MAX_CLOCK_LEAD,
    MAX_TIME,
    Algorithm,
    DUPLICATE_COMPOUND,
    BatchResult,
    CompoundDecision,
    LimiterConfig,
    LimiterState,
    KernelStorage,
    Storage,
    SystemClock,
    ValidationError,
    check_bounds,
    check_cost,
    check_cutoff,
    check_key,
    check_now,
    compound_items,
    decide_async,
    render_headers,
    storage_key,
    stripes_within,
)

cdef extern from "Python.h":
    unsigned long PyThread_get_thread_ident() nogil
    bint PyUnicode_IS_COMPACT_ASCII(object o)
    void* PyUnicode_DATA(object o)
    Py_ssize_t PyUnicode_GET_LENGTH(object o)

IMPLEMENTATION = "native"

# Per-process hash secrets: keys chosen offline cannot collide on purpose.
_seed = os.urandom(24)
nl_set_secrets(int.from_bytes(_seed[:8], "little"), int.from_bytes(_seed[8:16], "little"),
               int.from_bytes(_seed[16:], "little"))
del _seed

cdef double MAX_TIME_C = MAX_TIME
cdef double MAX_CLOCK_LEAD_C = MAX_CLOCK_LEAD
cdef double MAX_HEADER_SECONDS = 4.611686018427388e18    # 2**62: ceil() of it fits int64
cdef str REASON_NONE = ""
cdef str REASON_STORAGE_FULL = "storage_full"
cdef int MAX_STRIPES = 1 << 16

cdef dict ALGORITHM_IDS = {
    Algorithm.TOKEN_BUCKET: ALG_TOKEN_BUCKET,
    Algorithm.LEAKY_BUCKET: ALG_LEAKY_BUCKET,
    Algorithm.FIXED_WINDOW: ALG_FIXED_WINDOW,
    Algorithm.SLIDING_LOG: ALG_SLIDING_LOG,
    Algorithm.SLIDING_COUNTER: ALG_SLIDING_COUNTER,
    Algorithm.GCRA: ALG_GCRA,
}

cdef array _U8 = array("B")
cdef array _I64 = array("q")
cdef array _F64 = array("d")


cdef void raise_status(int status) except *:
    if status == NL_NOMEM:
        raise MemoryError("nanolimit: out of memory for rate-limit state")
    if status == NL_TABLE_FULL:
        raise MemoryError("nanolimit: a table stripe is full (16,777,214 keys)")
    if status == NL_REENTRANT:
        raise RuntimeError(
            "InMemoryStorage re-entered from inside apply() on the same stripe; "
            "a mutate function must not call back into its storage"
        )
    raise RuntimeError(f"nanolimit: internal status {status}")


# ============================================================== validation

cdef inline const char* key_bytes(object key, Py_ssize_t max_bytes, Py_ssize_t* size) except NULL:
    """UTF-8 bytes of a valid key, borrowed from the str (cached there by
    CPython). Only the compact-ASCII case is inline: it is every hot call,
    and the rest (with its exception handling) would keep the compiler from
    inlining this into the callers."""
    if type(key) is str and PyUnicode_IS_COMPACT_ASCII(key):
        # ASCII str: its characters are its UTF-8 bytes, no call needed.
        size[0] = PyUnicode_GET_LENGTH(key)
        if 0 < size[0] <= max_bytes:
            return <const char*>PyUnicode_DATA(key)
    return key_bytes_general(key, max_bytes, size)


cdef const char* key_bytes_general(object key, Py_ssize_t max_bytes, Py_ssize_t* size) except NULL:
    """``key_bytes`` for every other key; the error path defers to the shared
    ``check_key`` message."""
    cdef const char* data = NULL
    if isinstance(key, str):
        try:
            data = PyUnicode_AsUTF8AndSize(key, size)
        except UnicodeEncodeError:
            data = NULL
        if data != NULL and 0 < size[0] <= max_bytes:
            return data
    check_key(key, max_bytes)
    raise ValidationError(f"invalid key {key!r}")


cdef object ONE = 1                   # CPython caches small ints: the default cost is this object


cdef inline int64_t cost_value(object cost, int64_t capacity) except -1:
    if cost is ONE:                     # the default: no conversion call (capacity >= 1 always)
        return 1
    return cost_value_general(cost, capacity)


cdef int64_t cost_value_general(object cost, int64_t capacity) except -1:
    cdef int overflow = 0
    cdef long long value
    if type(cost) is int:
        value = PyLong_AsLongLongAndOverflow(cost, &overflow)
        if overflow == 0 and 1 <= value <= capacity:
            return value
    return <int64_t>check_cost(cost, capacity)   # converted once, by operator.index


cdef inline double clock_value(object value) except? -1.0:
    cdef double t
    if type(value) is float:
        t = value
        if isfinite(t) and -MAX_TIME_C < t < MAX_TIME_C:
            return t
    return check_now(value)


# ============================================================== Decision

@cython.final
cdef class Decision:
    """The answer to one request (SPEC §2). Frozen: a Decision is a fact.

    ``degraded`` is true when the store could not decide normally and a policy
    answered instead; ``reason`` then says which ("storage_full",
    "store_unavailable"); it is "" for an ordinary decision.
    """

    cdef readonly bint allowed
    cdef readonly int64_t limit
    cdef readonly int64_t remaining
    cdef readonly double retry_after
    cdef readonly double reset_after
    cdef readonly str rule
    cdef readonly double window
    cdef readonly double delay
    cdef readonly bint degraded
    cdef readonly str reason

    def __init__(self, allowed, limit, remaining, retry_after, reset_after,
                 rule="", window=0.0, delay=0.0, degraded=False, reason=""):
        self.allowed = bool(allowed)
        self.limit = limit
        self.remaining = remaining
        self.retry_after = retry_after
        self.reset_after = reset_after
        self.rule = str(rule)
        self.window = window
        self.delay = delay
        self.degraded = bool(degraded)
        self.reason = str(reason)

    def _astuple(self):
        return (self.allowed, self.limit, self.remaining, self.retry_after,
                self.reset_after, self.rule, self.window, self.delay, self.degraded, self.reason)

    def __eq__(self, other):
        if not hasattr(other, "_astuple") or not hasattr(other, "retry_after"):
            return NotImplemented
        return self._astuple() == other._astuple()

    def __hash__(self):
        return hash(self._astuple())

    def __repr__(self):
        return (
            f"Decision(allowed={self.allowed!r}, limit={self.limit!r}, "
            f"remaining={self.remaining!r}, retry_after={self.retry_after!r}, "
            f"reset_after={self.reset_after!r}, rule={self.rule!r}, "
            f"window={self.window!r}, delay={self.delay!r}, degraded={self.degraded!r}, "
            f"reason={self.reason!r})"
        )

    def __reduce__(self):
        return (Decision, self._astuple())

    def headers(self, wall_now=None):
        """HTTP headers for this decision; ``wall_now`` defaults to ``time.time()``."""
        return render_headers(self.allowed, self.limit, self.remaining, self.retry_after,
                              self.reset_after, self.rule, self.window, wall_now)


cdef inline int64_t whole_units(double remaining) noexcept nogil:
    """``max(0, floor(remaining))`` (SPEC's remaining): for values of at
    least 1 truncation is the floor, and it needs no libm call."""
    return <int64_t>remaining if remaining >= 1.0 else 0


cdef extern from "_decision_pool.h":
    Decision nl_decision_new()
    int nl_decision_pool_install(PyTypeObject* decision_type) except -1
    int nl_decision_pool_size()

nl_decision_pool_install(<PyTypeObject*>Decision)


def _decision_pool_size():
    """Dead Decisions held for reuse; -1 where this build has no pool (tests)."""
    return nl_decision_pool_size()


cdef inline Decision make_decision(const Verdict* v, int64_t limit, str rule, double window):
    # Every field is set below: a pooled Decision still holds its last values.
    cdef Decision d = nl_decision_new()
    d.allowed = v.allowed
    d.limit = limit
    d.remaining = whole_units(v.remaining)
    d.retry_after = v.retry_after
    d.reset_after = v.reset_after
    d.rule = rule
    d.window = window
    d.delay = v.delay
    if v.storage_full:
        d.degraded = True
        d.reason = REASON_STORAGE_FULL
    else:
        d.degraded = False
        d.reason = REASON_NONE
    return d


# ============================================================== table ops

cdef inline bint room_for_new_key(Stripe* s, const Bounds* b, double now) noexcept nogil:
    """Bounded storages: run the idle sweep, then make room in a full stripe.
    False means the new key must be refused (``on_full="deny_new"``, or no
    entry could be freed)."""
    if b.idle_after > 0.0:
        stripe_sweep_idle(s, now - b.idle_after)
    if b.stripe_cap == 0:
        return True
    # a loop, not one eviction: an all-or-nothing compound may have left the
    # stripe over its cap (several new keys of one request), and the next
    # new key brings it back within
    while s.count >= s.cap:
        if not stripe_make_room(s, b.chunks, now, b.evict_active):
            s.denied_new += 1
            return False
    return True


cdef inline bint peek_finds_room(const Stripe* s, const Bounds* b, double now) noexcept nogil:
    """``room_for_new_key`` for ``peek``: the same answer, nothing changed.
    Only a full ``deny_new`` stripe can refuse."""
    if b.stripe_cap == 0 or b.evict_active or s.count < s.cap:
        return True
    return stripe_could_make_room(s, b.chunks, now, b.idle_after > 0.0, now - b.idle_after)


cdef inline void refuse_new_key(Verdict* v) noexcept nogil:
    v.allowed = False
    v.storage_full = True
    v.remaining = 0.0
    v.retry_after = 1.0
    v.reset_after = 0.0
    v.delay = 0.0


cdef int decide_new_key(Stripe* s, const Bounds* b, uint64_t h, uint32_t ns, const char* key,
                        uint32_t klen, uint32_t slot, double clock_now, int64_t cost,
                        const Params* p, bint commit, Verdict* v) noexcept nogil:
    """``table_decide`` for a key not in the table (kept out of line: the
    hot path is a key that is there). ``slot`` is where the probe ended."""
    cdef Entry* e
    cdef Entry scratch
    cdef int status = NL_OK
    if not commit:
        if b != NULL and b.reserve_on_peek and not room_for_new_key(s, b, clock_now):
            refuse_new_key(v)
            return NL_OK
        if b != NULL and not b.reserve_on_peek and not peek_finds_room(s, b, clock_now):
            refuse_new_key(v)   # what allow would answer, counting nothing
            return NL_OK
        init_state(&scratch, clock_now, p)
        return run_kernel(&scratch, clock_now, cost, p, False, v)
    if b != NULL:
        if not room_for_new_key(s, b, clock_now):
            refuse_new_key(v)
            return NL_OK
        stripe_find(s, h, ns, key, klen, &slot)   # eviction may have moved the probe run
    # Decided on a scratch state first: the key goes in only once its charge
    # has succeeded, so an out-of-memory leaves no key behind.
    init_state(&scratch, clock_now, p)
    status = run_kernel(&scratch, clock_now, cost, p, True, v)
    if status != NL_OK:
        return status
    e = stripe_insert(s, h, ns, key, klen, slot, &status)
    if e == NULL:
        if (ns & NS_ALGORITHM_MASK) == ALG_SLIDING_LOG:
            log_free(&scratch.state.log)
        return status
    e.state = scratch.state
    e.updated_at = clock_now
    return NL_OK


cdef inline int table_decide(Stripe* s, const Bounds* b, uint64_t h, uint32_t ns, const char* key,
                             uint32_t klen, double clock_now, int64_t cost,
                             const Params* p, bint commit, Verdict* v) noexcept nogil:
    """Find or create the key, bring it to ``now`` (never backwards), decide,
    stamp. ``commit=False`` works on a copy and creates nothing. ``b`` is
    NULL for an unbounded storage."""
    cdef uint32_t slot
    cdef Py_ssize_t position = stripe_find(s, h, ns, key, klen, &slot)
    cdef Entry* e
    cdef Entry scratch
    cdef double now
    cdef int status
    v.storage_full = False
    if position < 0:
        return decide_new_key(s, b, h, ns, key, klen, slot, clock_now, cost, p, commit, v)
    e = &s.entries[position]
    if e.updated_at - clock_now > MAX_CLOCK_LEAD_C:
        return decide_after_clock_fault(e, ns, clock_now, cost, p, commit, v)
    now = e.updated_at if e.updated_at > clock_now else clock_now
    if commit:
        status = run_kernel(e, now, cost, p, True, v)
        if status == NL_OK:   # out of memory (a sliding log's ring) leaves the entry as it was
            e.updated_at = now
    else:
        scratch = e[0]
        status = run_kernel(&scratch, now, cost, p, False, v)
    if now > clock_now:
        add_clock_lead(v, now - clock_now)
    return status


cdef int decide_after_clock_fault(Entry* e, uint32_t ns, double clock_now, int64_t cost,
                                  const Params* p, bint commit, Verdict* v) noexcept nogil:
    """``table_decide`` for a key stamped more than the clock lead ahead of
    the clock (kept out of line: it follows a clock fault): moved back to
    the clock, then decided at it."""
    cdef Entry scratch
    cdef int status
    if commit:
        clock_rebase(e, clock_now, p, True)
        status = run_kernel(e, clock_now, cost, p, True, v)
        if status == NL_OK:
            e.updated_at = clock_now
        return status
    scratch = e[0]
    status = clock_rebase(&scratch, clock_now, p, False)
    if status != NL_OK:
        return status
    status = run_kernel(&scratch, clock_now, cost, p, False, v)
    if (ns & NS_ALGORITHM_MASK) == ALG_SLIDING_LOG and e.state.log.length > 0:
        log_free(&scratch.state.log)    # the ring clock_rebase gave the copy
    return status


cdef void settle_clock_fault(Stripe* s, uint64_t h, uint32_t ns, const char* key, uint32_t klen,
                             double clock_now, const Params* p) noexcept nogil:
    """A denied compound charges nothing, but a key it found stamped more
    than the clock lead ahead is stored moved back (decided at cost 0): else
    every compound would move it back again from the clock's new time, and
    it would never refill (``reference.InMemoryStorage.allow_all`` alike)."""
    cdef uint32_t slot
    cdef Verdict v
    cdef Py_ssize_t position = stripe_find(s, h, ns, key, klen, &slot)
    if position >= 0 and s.entries[position].updated_at - clock_now > MAX_CLOCK_LEAD_C:
        decide_after_clock_fault(&s.entries[position], ns, clock_now, 0, p, True, &v)


cdef void forget_entry(Stripe* s, uint64_t h, uint32_t ns, const char* key,
                       uint32_t klen) noexcept nogil:
    """Remove a limiter's entry (never an ``apply`` one: no Python object to
    release) that an out-of-memory left half made."""
    cdef uint32_t slot
    cdef Py_ssize_t position = stripe_find(s, h, ns, key, klen, &slot)
    if position >= 0:
        stripe_delete(s, slot, <uint32_t>position)


cdef inline int lock_stripe(Stripe* s) noexcept:
    """Take a stripe lock while holding the GIL: try once, and only if that
    fails release the GIL to wait, so a holder that needs the GIL can finish."""
    if nl_trylock(&s.lock):
        return NL_OK
    if s.owner == PyThread_get_thread_ident():
        return NL_REENTRANT
    with nogil:
        nl_lock_spin(&s.lock)
    return NL_OK


cdef inline void release_objects(ObjectList* objects):
    cdef size_t i
    for i in range(objects.count):
        Py_DECREF(<object><PyObject*>objects.items[i])
    free(objects.items)
    objects.items = NULL
    objects.count = 0
    objects.capacity = 0


# ============================================================== storage

@cython.final
cdef class InMemoryStorage:
    """Per-key state in a striped open-addressing table in C memory.

    Keys are copied as UTF-8 and hashed with a multiply-mix hash under
    per-process random secrets. Each stripe has its own lock and its own table, so threads on
    different stripes never wait for each other. ``stripes`` must be a power
    of two; ``max_key_bytes`` bounds what a caller can make us store.
    """

    cdef Stripe* stripes
    cdef void* stripes_block
    cdef uint32_t stripe_mask
    cdef uint64_t hash_mask
    cdef BatchReaders readers            # allow_many batches reading indexes unlocked (_table.pxd)
    cdef Bounds bounds
    cdef bint bounded
    cdef readonly Py_ssize_t max_key_bytes
    cdef readonly object max_keys
    cdef readonly str on_full
    cdef readonly object evict_idle_after
    cdef dict _namespace_ids
    cdef list _namespace_names
    cdef list _namespace_users            # per namespace id: a WeakSet of the limiters using it
    cdef list _free_namespaces            # ids reclaimed from retired rules, for reuse
    cdef object _namespace_lock

    def __cinit__(self, *, stripes=64, max_key_bytes=MAX_KEY_BYTES, max_keys=None, on_full="evict",
                  evict_idle_after=None, _hash_mask=None):
        cdef uintptr_t address
        cdef uint32_t i
        bounds = check_bounds(max_keys, on_full, evict_idle_after)
        if isinstance(stripes, bool) or not isinstance(stripes, int) or not 1 <= stripes <= MAX_STRIPES \
                or stripes & (stripes - 1):
            raise ValidationError(f"stripes must be a power of two in [1, {MAX_STRIPES}], got {stripes!r}")
        if isinstance(max_key_bytes, bool) or not isinstance(max_key_bytes, int) \
                or not 1 <= max_key_bytes <= 1 << 20:
            raise ValidationError(f"max_key_bytes must be an int in [1, 1048576], got {max_key_bytes!r}")
        self.max_key_bytes = max_key_bytes
        stripes = stripes_within(stripes, max_keys)
        self.stripe_mask = stripes - 1
        # Test hook: a mask that forces collisions, to exercise long probe runs.
        self.hash_mask = 0xFFFFFFFFFFFFFFFF if _hash_mask is None else _hash_mask
        self.stripes_block = calloc(<size_t>stripes + 1, sizeof(Stripe))
        if self.stripes_block == NULL:
            raise MemoryError()
        address = <uintptr_t>self.stripes_block
        address = (address + 63) & ~(<uintptr_t>63)
        self.stripes = <Stripe*>address
        for i in range(self.stripe_mask + 1):
            self.stripes[i].random = <uint32_t>(nl_mum(nl_namespace_seed(i), <uint64_t>i + 1) | 1)
            self.stripes[i].hash_mask = self.hash_mask
            self.stripes[i].readers = &self.readers
        self.max_keys, self.on_full, self.evict_idle_after = bounds
        memset(&self.bounds, 0, sizeof(Bounds))
        self.bounds.chunks = <Params**>calloc(NAMESPACE_CHUNK, sizeof(Params*))
        if self.bounds.chunks == NULL:
            raise MemoryError()
        if max_keys is not None:
            # max_keys split over the stripes (never below one key a stripe)
            self.bounds.stripe_cap = 1
            for i in range(self.stripe_mask + 1):
                self.stripes[i].cap = <uint32_t>max(1, max_keys // stripes + (1 if i < max_keys % stripes else 0))
        self.bounds.evict_active = on_full == "evict"
        self.bounds.idle_after = 0.0 if evict_idle_after is None else evict_idle_after
        self.bounded = max_keys is not None or evict_idle_after is not None
        self._namespace_ids = {}
        self._namespace_names = [None]
        self._namespace_users = [None]
        self._free_namespaces = []
        self._namespace_lock = threading.Lock()

    def __dealloc__(self):
        cdef ObjectList objects
        cdef uint32_t i
        if self.stripes == NULL:
            return
        memset(&objects, 0, sizeof(ObjectList))
        for i in range(self.stripe_mask + 1):
            stripe_clear(&self.stripes[i], &objects)
        free(self.stripes_block)
        self.stripes = NULL
        if self.bounds.chunks != NULL:
            for i in range(<uint32_t>NAMESPACE_CHUNK):
                free(self.bounds.chunks[i])
            free(self.bounds.chunks)
            self.bounds.chunks = NULL
        release_objects(&objects)

    # -- namespaces ---------------------------------------------------------
    cdef uint32_t namespace(self, object algorithm, str rule, const Params* p, object limiter) except 0:
        """The id of (algorithm, rule): limiters of one rule share state, so a
        hot-reloaded rule keeps its keys; the algorithm is in the low bits.
        The latest parameters are kept per namespace so that a bounded table
        can tell which entries are back at rest. ``limiter`` is remembered
        weakly: a namespace no live limiter uses can be reclaimed when the
        ids run out (``reclaim_namespaces``)."""
        cdef uint32_t ident
        cdef Params* chunk
        name = (algorithm.value, rule)
        with self._namespace_lock:
            ns = self._namespace_ids.get(name)
            if ns is None:
                ident = self.free_namespace()
                ns = (ident << 3) | ALGORITHM_IDS[algorithm]
                self._namespace_ids[name] = ns
                self._namespace_names[ident] = name
                self._namespace_users[ident] = weakref.WeakSet()
            ident = (<uint32_t>ns) >> 3
            self._namespace_users[ident].add(limiter)
            chunk = self.bounds.chunks[ident // NAMESPACE_CHUNK]
            if chunk == NULL:
                chunk = <Params*>calloc(NAMESPACE_CHUNK, sizeof(Params))
                if chunk == NULL:
                    raise MemoryError()
                self.bounds.chunks[ident // NAMESPACE_CHUNK] = chunk
            chunk[ident % NAMESPACE_CHUNK] = p[0]
        return ns

    cdef uint32_t free_namespace(self) except 0:
        """An unused namespace id (the caller holds the namespace lock)."""
        if not self._free_namespaces:
            if len(self._namespace_names) < NAMESPACE_CHUNK * NAMESPACE_CHUNK:
                self._namespace_names.append(None)
                self._namespace_users.append(None)
                return len(self._namespace_names) - 1
            self.reclaim_namespaces()
            if not self._free_namespaces:
                raise ValidationError(
                    f"too many rules on one storage: {NAMESPACE_CHUNK * NAMESPACE_CHUNK - 1} "
                    "(algorithm, rule) pairs have live limiters"
                )
        return self._free_namespaces.pop()

    cdef void reclaim_namespaces(self) except *:
        """Free the namespaces of retired rules (no live limiter uses them),
        their keys with them: a renamed rule's old state is unreachable, and
        configuration history must never make a request fail."""
        cdef uint8_t* retired = <uint8_t*>calloc(NAMESPACE_CHUNK * NAMESPACE_CHUNK, 1)
        cdef uint32_t i
        cdef Stripe* s
        cdef ObjectList objects
        cdef int status
        if retired == NULL:
            raise MemoryError()
        reclaimed = []
        try:
            for ident in range(1, len(self._namespace_names)):
                users = self._namespace_users[ident]
                if users is not None and len(users) == 0:
                    retired[ident] = 1
                    reclaimed.append(ident)
            if not reclaimed:
                return
            memset(&objects, 0, sizeof(ObjectList))
            for i in range(self.stripe_mask + 1):
                s = &self.stripes[i]
                status = lock_stripe(s)
                if status != NL_OK:
                    raise_status(status)
                stripe_evict(s, INFINITY, retired, &objects)
                nl_unlock(&s.lock)
            release_objects(&objects)
            for ident in reclaimed:
                del self._namespace_ids[self._namespace_names[ident]]
                self._namespace_names[ident] = None
                self._namespace_users[ident] = None
                self.bounds.chunks[ident // NAMESPACE_CHUNK][ident % NAMESPACE_CHUNK].capacity = 0
            reclaimed.reverse()
            self._free_namespaces.extend(reclaimed)
        finally:
            free(retired)

    cdef inline const Bounds* bounds_or_null(self) noexcept nogil:
        return &self.bounds if self.bounded else NULL

    cdef inline Stripe* stripe_for(self, uint64_t h) noexcept nogil:
        return &self.stripes[(h >> 40) & self.stripe_mask]

    # -- the decision path --------------------------------------------------
    cdef inline uint64_t hash_key(self, uint64_t seed, const char* key, Py_ssize_t klen) noexcept nogil:
        return nl_hash_seeded(seed, key, <size_t>klen) & self.hash_mask

    cdef inline int decide(self, uint64_t h, uint32_t ns, const char* key, Py_ssize_t klen,
                           double now, int64_t cost, const Params* p, bint commit,
                           Verdict* v) noexcept:
        """One decision; ``h`` is ``hash_key`` of the key (the caller hashes
        early, to start the index slot's load before the lock)."""
        cdef Stripe* s = self.stripe_for(h)
        cdef int status = lock_stripe(s)
        if status != NL_OK:
            return status
        status = table_decide(s, self.bounds_or_null(), h, ns, key, <uint32_t>klen, now, cost, p, commit, v)
        nl_unlock(&s.lock)
        return status

    cdef int decide_batch(self, uint32_t ns, uint64_t seed, Py_ssize_t n, const char** keys,
                          const Py_ssize_t* sizes, const int64_t* costs, uint64_t* hashes,
                          double now, const double* times, const Params* p, uint8_t* allowed, int64_t* remaining,
                          double* retry_after, double* reset_after, double* delay,
                          uint8_t* storage_full, Py_ssize_t* done, Py_ssize_t* refused) noexcept nogil:
        """Decide ``n`` requests in order. Hashes are computed first so the
        loop can prefetch the index slot ``2 * AHEAD`` requests ahead and the
        entry ``AHEAD`` ahead: a large table costs cache misses, not probes."""
        cdef unsigned long me = PyThread_get_thread_ident()
        cdef Py_ssize_t i = 0
        cdef uint64_t h
        cdef Stripe* s
        cdef Stripe* held = NULL
        cdef Verdict v
        cdef int status = NL_OK
        cdef int run = 0
        cdef const Bounds* bounds = self.bounds_or_null()
        cdef Py_ssize_t AHEAD = 8
        cdef Py_ssize_t j
        # Counted in before the first unlocked read of an index, so an index
        # replaced from here on is retired, not freed (see index_release).
        cdef uint64_t epoch = batch_join(&self.readers)
        # Hashing here, without the GIL, keeps the GIL-held part of a batch
        # to the key checks, so batches on several threads overlap more. A
        # key is hashed 2*AHEAD requests before its decision, so its bytes
        # are still in cache for the comparison in the probe.
        for j in range(min(n, 2 * AHEAD)):
            hashes[j] = nl_hash_seeded(seed, keys[j], <size_t>sizes[j]) & self.hash_mask
        for i in range(n):
            j = i + 2 * AHEAD
            if j < n:
                hashes[j] = nl_hash_seeded(seed, keys[j], <size_t>sizes[j]) & self.hash_mask
                prefetch_slot(self.stripe_for(hashes[j]), hashes[j])
            if i + AHEAD < n:
                prefetch_entry(self.stripe_for(hashes[i + AHEAD]), hashes[i + AHEAD])
            h = hashes[i]
            s = self.stripe_for(h)
            # Consecutive requests on one stripe (a hot key) keep its lock, up
            # to a short run so other threads still get their turn.
            if s != held or run >= 32:
                if held != NULL:
                    nl_unlock(&held.lock)
                held = NULL
                if not nl_trylock(&s.lock):
                    if s.owner == me:
                        status = NL_REENTRANT
                        break
                    nl_lock_spin(&s.lock)
                held = s
                run = 0
            run += 1
            status = table_decide(s, bounds, h, ns, keys[i], <uint32_t>sizes[i],
                                  now if times == NULL else times[i], costs[i], p, True, &v)
            if status != NL_OK:
                break
            allowed[i] = v.allowed
            storage_full[i] = v.storage_full
            refused[0] += v.storage_full
            remaining[i] = whole_units(v.remaining)
            retry_after[i] = v.retry_after
            reset_after[i] = v.reset_after
            delay[i] = v.delay
        if held != NULL:
            nl_unlock(&held.lock)
        batch_leave(&self.readers, epoch)
        if nl_load_u64_relaxed(&self.readers.retired) != 0:
            self.reclaim_retired()
        done[0] = i if status != NL_OK else n
        return status

    cdef void reclaim_retired(self) noexcept nogil:
        """Free the index blocks no batch in flight can hold, and move the
        epoch on so the rest can be freed later (two rounds: when no batch
        is in flight, everything goes now). A busy stripe keeps its blocks
        until the next time."""
        cdef uint32_t i
        cdef Stripe* s
        cdef uint64_t epoch
        cdef int step
        for step in range(2):
            epoch = nl_load_u64_seq(&self.readers.epoch)
            if nl_load_u64_seq(&self.readers.active[(epoch - 1) & 1]) != 0:
                return
            for i in range(self.stripe_mask + 1):
                s = &self.stripes[i]
                if nl_load_pointer_relaxed(<const void* const*>&s.retired) != NULL and nl_trylock(&s.lock):
                    stripe_reclaim(s, epoch)
                    nl_unlock(&s.lock)
            if not nl_cas_u64(&self.readers.epoch, epoch, epoch + 1):
                return

    cdef int forget(self, uint32_t ns, uint64_t seed, const char* key, Py_ssize_t klen) except -1:
        cdef uint64_t h = nl_hash_seeded(seed, key, <size_t>klen) & self.hash_mask
        cdef Stripe* s = self.stripe_for(h)
        cdef uint32_t slot
        cdef Py_ssize_t position
        cdef void* obj = NULL
        cdef int status = lock_stripe(s)
        if status != NL_OK:
            raise_status(status)
        position = stripe_find(s, h, ns, key, <uint32_t>klen, &slot)
        if position >= 0:
            obj = stripe_delete(s, slot, <uint32_t>position)
        nl_unlock(&s.lock)
        if obj != NULL:
            Py_DECREF(<object><PyObject*>obj)
        return 0

    cdef object snapshot(self, uint32_t ns, uint64_t seed, const char* key, Py_ssize_t klen,
                         object algorithm):
        """A LimiterState copy of one key, built after the lock is released."""
        cdef uint64_t h = nl_hash_seeded(seed, key, <size_t>klen) & self.hash_mask
        cdef Stripe* s = self.stripe_for(h)
        cdef uint32_t slot, i
        cdef Py_ssize_t position
        cdef Entry copy
        cdef double* log = NULL
        cdef int status = lock_stripe(s)
        if status != NL_OK:
            raise_status(status)
        position = stripe_find(s, h, ns, key, <uint32_t>klen, &slot)
        if position >= 0:
            copy = s.entries[position]
            if (ns & NS_ALGORITHM_MASK) == ALG_SLIDING_LOG and copy.state.log.length:
                log = <double*>malloc(copy.state.log.length * sizeof(double))
                if log == NULL:
                    status = NL_NOMEM
                else:
                    for i in range(copy.state.log.length):
                        log[i] = log_at(&copy.state.log, i)
        nl_unlock(&s.lock)
        if status != NL_OK:
            raise_status(status)
        if position < 0:
            return None
        alg = ns & NS_ALGORITHM_MASK
        if alg == ALG_TOKEN_BUCKET or alg == ALG_LEAKY_BUCKET:
            return LimiterState(algorithm, copy.updated_at, level=copy.state.bucket.level)
        if alg == ALG_GCRA:
            return LimiterState(algorithm, copy.updated_at, tat=copy.state.gcra.tat)
        if alg == ALG_FIXED_WINDOW:
            return LimiterState(algorithm, copy.updated_at, window_index=copy.state.window.index,
                                count=copy.state.window.count)
        if alg == ALG_SLIDING_COUNTER:
            return LimiterState(algorithm, copy.updated_at, window_index=copy.state.window.index,
                                count=copy.state.window.count, previous=copy.state.window.previous)
        try:
            entries = tuple([log[i] for i in range(copy.state.log.length)])
        finally:
            free(log)
        return LimiterState(algorithm, copy.updated_at, log=entries)

    # -- compound limits ------------------------------------------------------
    cdef int prepare_compound(self, Py_ssize_t n, const uint64_t* hashes, const uint32_t* namespaces,
                              const char** data, const Py_ssize_t* sizes, const double* nows,
                              const int64_t* units, const Params** params, uint8_t* created) noexcept nogil:
        """Before ``allow_all`` charges anything, make what charging will
        allocate: every new key's entry and every sliding log's room. If any
        of it fails, the new entries go again, so an out-of-memory charges
        nothing rather than the limits before the failing one."""
        cdef Py_ssize_t i
        cdef uint32_t slot
        cdef Py_ssize_t position
        cdef Stripe* s
        cdef Entry* e
        cdef int status = NL_OK
        for i in range(n):
            created[i] = 0
        for i in range(n):
            s = self.stripe_for(hashes[i])
            position = stripe_find(s, hashes[i], namespaces[i], data[i], <uint32_t>sizes[i], &slot)
            if position < 0:
                e = stripe_insert(s, hashes[i], namespaces[i], data[i], <uint32_t>sizes[i], slot, &status)
                if e == NULL:
                    break
                init_state(e, nows[i], params[i])
                created[i] = 1
            else:
                e = &s.entries[position]
            if (namespaces[i] & NS_ALGORITHM_MASK) == ALG_SLIDING_LOG:
                # before expiry: at least what the kernel will need after it
                status = log_reserve(&e.state.log, <int64_t>e.state.log.length + units[i], params[i].capacity)
                if status != NL_OK:
                    break
        if status != NL_OK:
            for i in range(n):
                if created[i]:
                    forget_entry(self.stripe_for(hashes[i]), hashes[i], namespaces[i], data[i], <uint32_t>sizes[i])
        return status

    def allow_all(self, requests):
        """Decide a request bound by several limiters of this storage at once,
        all-or-nothing (SPEC §6 compound limits): every stripe involved is
        locked in index order, each limit is decided without spending, and
        only if all allow is each one charged. A denial by the last limit
        never charges the first.

        ``requests`` is a sequence of ``(limiter, key)`` or ``(limiter, key, cost)``.
        """
        cdef list items = compound_items(requests)
        cdef Py_ssize_t n = len(items)
        cdef Py_ssize_t i, j, locked = 0, stripes_used = 0
        cdef list limiters = []
        cdef _Limiter limiter
        cdef char* block
        cdef const char** data
        cdef Py_ssize_t* sizes
        cdef int64_t* units
        cdef uint64_t* hashes
        cdef double* nows
        cdef const Params** params
        cdef uint32_t* namespaces
        cdef uint32_t* stripe_ids
        cdef Verdict* verdicts
        cdef uint32_t stripe_id
        cdef bint all_allowed = True
        cdef int status = NL_OK
        cdef Bounds reserve, unbounded
        cdef uint8_t* created
        cdef size_t row = (sizeof(char*) + sizeof(Py_ssize_t) + sizeof(int64_t) + sizeof(uint64_t)
                           + sizeof(double) + sizeof(Params*) + 2 * sizeof(uint32_t) + sizeof(Verdict)
                           + sizeof(uint8_t))
        block = <char*>malloc(<size_t>n * row)
        if block == NULL:
            raise MemoryError()
        verdicts = <Verdict*>block
        data = <const char**>(verdicts + n)
        sizes = <Py_ssize_t*>(data + n)
        units = <int64_t*>(sizes + n)
        hashes = <uint64_t*>(units + n)
        nows = <double*>(hashes + n)
        params = <const Params**>(nows + n)
        namespaces = <uint32_t*>(params + n)
        stripe_ids = namespaces + n
        created = <uint8_t*>(stripe_ids + n)
        try:
            for i in range(n):
                candidate, key, cost = items[i]
                if not isinstance(candidate, _Limiter) or (<_Limiter>candidate).store is not self:
                    raise ValidationError("every limiter of a compound request must use this storage")
                limiter = <_Limiter>candidate
                limiters.append(limiter)
                data[i] = key_bytes(key, self.max_key_bytes, &sizes[i])
                units[i] = cost_value(cost, limiter.p.capacity)
                hashes[i] = nl_hash_seeded(limiter.seed, data[i], <size_t>sizes[i]) & self.hash_mask
                params[i] = &limiter.p
                namespaces[i] = limiter.ns
                for j in range(i):
                    if (namespaces[j] == namespaces[i] and sizes[j] == sizes[i]
                            and memcmp(data[j], data[i], <size_t>sizes[i]) == 0):
                        raise ValidationError(DUPLICATE_COMPOUND)
            for i in range(n):
                nows[i] = (<_Limiter>limiters[i]).read_clock()
            # the stripes, sorted and unique: one global lock order, no deadlock
            for i in range(n):
                stripe_id = <uint32_t>((hashes[i] >> 40) & self.stripe_mask)
                j = stripes_used
                while j > 0 and stripe_ids[j - 1] > stripe_id:
                    j -= 1
                if j > 0 and stripe_ids[j - 1] == stripe_id:
                    continue
                memmove(&stripe_ids[j + 1], &stripe_ids[j], (stripes_used - j) * sizeof(uint32_t))
                stripe_ids[j] = stripe_id
                stripes_used += 1
            for j in range(stripes_used):
                status = lock_stripe(&self.stripes[stripe_ids[j]])
                if status != NL_OK:
                    break
                locked += 1
            # Phase 1 may make room in full stripes; phase 2 then never refuses
            # (a compound request can overshoot max_keys by its own few keys).
            reserve = self.bounds
            reserve.reserve_on_peek = True
            unbounded = self.bounds
            unbounded.stripe_cap = 0
            unbounded.idle_after = 0.0
            if status == NL_OK:
                for i in range(n):
                    status = table_decide(self.stripe_for(hashes[i]), &reserve if self.bounded else NULL,
                                          hashes[i], namespaces[i], data[i],
                                          <uint32_t>sizes[i], nows[i], units[i], params[i], False,
                                          &verdicts[i])
                    if status != NL_OK:
                        break
                    all_allowed = all_allowed and verdicts[i].allowed
                if status == NL_OK and not all_allowed:
                    for i in range(n):
                        settle_clock_fault(self.stripe_for(hashes[i]), hashes[i], namespaces[i], data[i],
                                           <uint32_t>sizes[i], nows[i], params[i])
                if status == NL_OK and all_allowed:
                    status = self.prepare_compound(n, hashes, namespaces, data, sizes, nows, units, params,
                                                   created)
                if status == NL_OK and all_allowed:
                    for i in range(n):
                        status = table_decide(self.stripe_for(hashes[i]), &unbounded if self.bounded else NULL,
                                              hashes[i], namespaces[i], data[i],
                                              <uint32_t>sizes[i], nows[i], units[i], params[i], True,
                                              &verdicts[i])
                        if status != NL_OK:  # not after prepare_compound, which made the room
                            break
            while locked > 0:
                locked -= 1
                nl_unlock(&self.stripes[stripe_ids[locked]].lock)
            if status != NL_OK:
                raise_status(status)
            decisions = []
            for i in range(n):
                limiter = <_Limiter>limiters[i]
                decisions.append(make_decision(&verdicts[i], limiter.p.capacity, limiter._rule, limiter.p.window))
        finally:
            free(block)
        return CompoundDecision(decisions)

    # -- the Storage protocol ------------------------------------------------
    def apply(self, key, now, mutate):
        """Run ``mutate(state | None) -> (state, result)`` atomically for ``key``.

        The slow, general seam (SPEC §5) for algorithms written in Python: the
        stripe lock is held while ``mutate`` runs, so it must not call back
        into this storage. A returned state of ``None`` forgets the key.
        """
        cdef Py_ssize_t klen
        cdef const char* data = key_bytes(key, self.max_key_bytes, &klen)
        cdef double t = clock_value(now)
        cdef uint64_t h = nl_hash_seeded(nl_namespace_seed(ALG_APPLY), data, <size_t>klen) & self.hash_mask
        cdef Stripe* s = self.stripe_for(h)
        cdef uint32_t slot
        cdef Py_ssize_t position
        cdef Entry* e
        cdef void* old = NULL
        cdef int status = NL_OK
        if not callable(mutate):
            raise ValidationError("mutate must be callable")
        status = lock_stripe(s)
        if status != NL_OK:
            raise_status(status)
        s.owner = PyThread_get_thread_ident()
        try:
            position = stripe_find(s, h, ALG_APPLY, data, <uint32_t>klen, &slot)
            state = None if position < 0 else <object><PyObject*>s.entries[position].state.obj
            new_state, result = mutate(state)
        except BaseException:
            s.owner = 0
            nl_unlock(&s.lock)
            raise
        # Python may have run: the stripe cannot have changed (re-entry is refused).
        if new_state is None:
            if position >= 0:
                old = stripe_delete(s, slot, <uint32_t>position)
        elif position >= 0:
            e = &s.entries[position]
            old = e.state.obj
            Py_INCREF(new_state)
            e.state.obj = <void*><PyObject*>new_state
            if t > e.updated_at:
                e.updated_at = t
        else:
            e = stripe_insert(s, h, ALG_APPLY, data, <uint32_t>klen, slot, &status)
            if e != NULL:
                Py_INCREF(new_state)
                e.state.obj = <void*><PyObject*>new_state
                e.updated_at = t
        s.owner = 0
        nl_unlock(&s.lock)
        if old != NULL:
            Py_DECREF(<object><PyObject*>old)
        if status != NL_OK:
            raise_status(status)
        return result

    def evict_idle(self, cutoff):
        """Forget keys whose last decision was before ``cutoff``; returns how many.

        One stripe at a time, so deciders wait at most one stripe's scan.
        """
        cdef double limit = check_cutoff(cutoff)
        cdef Py_ssize_t removed = 0
        cdef uint32_t i
        cdef Stripe* s
        cdef ObjectList objects
        cdef int status
        memset(&objects, 0, sizeof(ObjectList))
        for i in range(self.stripe_mask + 1):
            s = &self.stripes[i]
            status = lock_stripe(s)
            if status != NL_OK:
                release_objects(&objects)
                raise_status(status)
            removed += stripe_evict(s, limit, NULL, &objects)
            nl_unlock(&s.lock)
        release_objects(&objects)
        return removed

    def __len__(self):
        cdef Py_ssize_t total = 0
        cdef uint32_t i
        cdef Stripe* s
        for i in range(self.stripe_mask + 1):
            s = &self.stripes[i]
            if lock_stripe(s) != NL_OK:
                raise_status(NL_REENTRANT)
            total += s.count
            nl_unlock(&s.lock)
        return total

    def keys(self):
        """Every key held, as storage keys (see ``storage_key``)."""
        cdef list out = []
        cdef uint32_t i, j
        cdef Stripe* s
        cdef char* buffer
        cdef uint32_t* meta
        cdef size_t used, total, n
        cdef int status
        for i in range(self.stripe_mask + 1):
            s = &self.stripes[i]
            status = lock_stripe(s)
            if status != NL_OK:
                raise_status(status)
            n = s.count
            total = 0
            for j in range(n):
                total += s.entries[j].key_len
            buffer = <char*>malloc(total + 1)
            meta = <uint32_t*>malloc((2 * n + 1) * sizeof(uint32_t))
            if buffer == NULL or meta == NULL:
                nl_unlock(&s.lock)
                free(buffer)
                free(meta)
                raise MemoryError()
            used = 0
            for j in range(n):
                memcpy(buffer + used, entry_key(&s.entries[j]), s.entries[j].key_len)
                meta[2 * j] = s.entries[j].key_len
                meta[2 * j + 1] = s.entries[j].ns
                used += s.entries[j].key_len
            nl_unlock(&s.lock)
            try:
                used = 0
                for j in range(n):
                    key = PyUnicode_DecodeUTF8(buffer + used, meta[2 * j], NULL)
                    used += meta[2 * j]
                    ns = meta[2 * j + 1]
                    if ns == ALG_APPLY:
                        out.append(key)
                    else:
                        algorithm, rule = self._namespace_names[ns >> 3]
                        out.append(storage_key(Algorithm(algorithm), rule, key))
            finally:
                free(buffer)
                free(meta)
        return out

    def stats(self):
        """Counters of the bounded table: keys held and why keys were
        forgotten or refused (see ``max_keys`` / ``evict_idle_after``)."""
        cdef uint64_t at_rest = 0, lru = 0, idle = 0, denied = 0
        cdef Py_ssize_t keys = 0
        cdef uint32_t i
        cdef Stripe* s
        for i in range(self.stripe_mask + 1):
            s = &self.stripes[i]
            if lock_stripe(s) != NL_OK:
                raise_status(NL_REENTRANT)
            keys += s.count
            at_rest += s.evicted_at_rest
            lru += s.evicted_active
            idle += s.evicted_idle
            denied += s.denied_new
            nl_unlock(&s.lock)
        return {"keys": keys, "evicted_at_rest": at_rest, "evicted_active": lru,
                "evicted_idle": idle, "denied_new": denied}

    def _probe_lengths(self):
        """(longest, mean) probe length over every key held: how many index
        slots a lookup of a present key inspects. With a seeded hash this
        stays small whatever keys a caller chooses."""
        cdef uint32_t i, j, mask, home, slot
        cdef uint64_t total = 0, longest = 0, count = 0, length
        cdef Stripe* s
        for i in range(self.stripe_mask + 1):
            s = &self.stripes[i]
            if lock_stripe(s) != NL_OK:
                raise_status(NL_REENTRANT)
            mask = s.index_mask
            for j in range(s.count):
                home = <uint32_t>entry_hash(s, &s.entries[j]) & mask
                slot = home
                while (s.index[slot] & 0xFFFFFF) != j + 1:
                    slot = (slot + 1) & mask
                length = ((slot - home) & mask) + 1
                total += length
                count += 1
                if length > longest:
                    longest = length
            nl_unlock(&s.lock)
        return int(longest), (<double>total / <double>count if count else 0.0)

    @property
    def _retired_index_blocks(self):
        """Replaced index blocks kept for batches in flight (a test probe)."""
        return nl_load_u64_relaxed(&self.readers.retired)

    def memory_bytes(self):
        """C memory held for state: stripes, entry arrays, indexes (those
        retired for batches in flight too), long keys and sliding-log rings
        (malloc's own overhead not included)."""
        cdef size_t total = (<size_t>self.stripe_mask + 2) * sizeof(Stripe)
        cdef uint32_t i, j
        cdef Stripe* s
        cdef Entry* e
        cdef IndexHeader* block
        for i in range(self.stripe_mask + 1):
            s = &self.stripes[i]
            if lock_stripe(s) != NL_OK:
                raise_status(NL_REENTRANT)
            total += <size_t>s.capacity * sizeof(Entry)
            if s.index != NULL:
                total += sizeof(IndexHeader) + (<size_t>s.index_mask + 1) * sizeof(uint32_t)
            block = <IndexHeader*>s.retired
            while block != NULL:
                total += sizeof(IndexHeader) + (<size_t>block.mask + 1) * sizeof(uint32_t)
                block = <IndexHeader*>block.next
            for j in range(s.count):
                e = &s.entries[j]
                if e.key_len > 16:
                    total += e.key_len
                if (e.ns & NS_ALGORITHM_MASK) == ALG_SLIDING_LOG:
                    total += <size_t>(log_ring_size(&e.state.log) + 1) * sizeof(double) if e.state.log.ring != NULL else 0
            nl_unlock(&s.lock)
        return total

    @property
    def stripes(self):
        return self.stripe_mask + 1

    def __repr__(self):
        return f"<native InMemoryStorage keys={len(self)} stripes={self.stripe_mask + 1}>"


# ============================================================== gateway

cdef str H_LIMIT = "X-RateLimit-Limit"
cdef str H_REMAINING = "X-RateLimit-Remaining"
cdef str H_RESET = "X-RateLimit-Reset"
cdef str H_POLICY = "RateLimit-Policy"
cdef str H_RATELIMIT = "RateLimit"


@cython.final
@cython.auto_pickle(False)
cdef class EventCounter:
    """A counter threads bump without a lock (atomic add): for counts taken
    on a hot path, such as a storage's near-cache hits."""

    cdef uint64_t n

    def add(self, uint64_t amount=1):
        nl_add_u64_relaxed(&self.n, amount)

    @property
    def value(self):
        return nl_load_u64_relaxed(&self.n)

    def __repr__(self):
        return f"<EventCounter {self.value}>"


@cython.final
cdef class AdmittedRequests:
    """One gateway rule's admitted requests: counted, and given their
    rate-limit headers, in one C call from the middleware's hot path. The
    counters are atomic, so threads share them without a lock or a shard."""

    cdef uint64_t allowed_count
    cdef uint64_t near_count
    cdef readonly str rule

    def __cinit__(self, str rule not None):
        self.rule = rule

    @property
    def allowed(self):
        return nl_load_u64_relaxed(&self.allowed_count)

    @property
    def near_limit(self):
        return nl_load_u64_relaxed(&self.near_count)

    def count(self, decision, double near):
        """Count an admitted request whose response never came (the handler raised)."""
        nl_add_u64_relaxed(&self.allowed_count, 1)
        if decision.remaining < near:
            nl_add_u64_relaxed(&self.near_count, 1)

    def record(self, decision, headers, str limit_str not None, str policy not None, str r_prefix not None,
               double near, double wall_now):
        """Count an admitted request and set its five rate-limit headers
        (SPEC §3) on ``headers``, exactly as ``RateLimitMiddleware._headers``
        writes them."""
        cdef int64_t left
        cdef double reset
        cdef Decision d
        if type(decision) is Decision:
            d = <Decision>decision
            left = d.remaining
            reset = d.reset_after
        else:
            left = decision.remaining
            reset = decision.reset_after
        # Every rule inside the documented ranges stays below 2**62 s
        # (capacity * window / limit <= (2**32 - 1) * 1e9), so this refuses
        # only a Decision built by hand with nonsense, before anything is set.
        if not (fabs(wall_now) < MAX_TIME_C and 0.0 <= reset < MAX_HEADER_SECONDS):
            raise ValidationError(f"cannot write headers for wall_now={wall_now!r}, reset_after={reset!r}")
        text = f"{left}"
        reset_at = f"{<int64_t>ceil(wall_now + reset)}"
        rate = f"{r_prefix}{text};t={<int64_t>ceil(reset)}"
        if type(headers) is dict:
            PyDict_SetItem(headers, H_LIMIT, limit_str)
            PyDict_SetItem(headers, H_REMAINING, text)
            PyDict_SetItem(headers, H_RESET, reset_at)
            PyDict_SetItem(headers, H_POLICY, policy)
            PyDict_SetItem(headers, H_RATELIMIT, rate)
        else:
            headers[H_LIMIT] = limit_str
            headers[H_REMAINING] = text
            headers[H_RESET] = reset_at
            headers[H_POLICY] = policy
            headers[H_RATELIMIT] = rate
        nl_add_u64_relaxed(&self.allowed_count, 1)  # counted once the headers are written
        if left < near:
            nl_add_u64_relaxed(&self.near_count, 1)

    def __repr__(self):
        return f"<AdmittedRequests {self.rule!r} allowed={self.allowed} near_limit={self.near_limit}>"


# ============================================================== two-tier leases

# The hot window of one key's lease (TwoTierStorage): enough to decide a
# request in C exactly as the storage's Python path would.
ctypedef struct LeaseRecord:
    double last_now                 # the key's own time floor (SPEC §4)
    int64_t window_index            # the window described below; LEASE_NONE: Python decides
    int64_t own                     # this instance's units in it (authoritative while loaded)
    int64_t ceiling                 # own + cost must stay <= ceiling: units pushed + the lease
    int64_t others                  # the other instances' units in it, as last read
    int64_t previous                # fleet units of the window before (sliding), else 0
    int64_t next_ceiling            # a later window's ceiling before any sync of it: ceil(L / N)
    int64_t prev_index              # a window C rolled away from, its units not yet pulled
    int64_t prev_own
    int64_t decisions               # committed here since the storage last pulled
    int64_t want                    # the largest cost refused for want of lease, not budget
    bint prev_pending
    bint committed                  # committed to since take_dirty (this key, not the slot's last)
    bint listed                     # its slot is in the book's dirty list

cdef int64_t LEASE_NONE = INT64_MIN


@cython.final
cdef class LeaseGate:
    """One per TwoTierStorage. While it is closed (the storage's Python code
    holds its lock, or Redis is unreachable) every decision takes the Python
    path; closing waits out a C decision in flight, so the Python side never
    sees a record half-updated."""

    cdef uint8_t lock
    cdef bint is_open
    cdef bint wake_pending
    cdef int64_t early
    cdef int64_t decided
    cdef object wake

    def __cinit__(self, wake):
        if not callable(wake):
            raise ValidationError("wake must be callable")
        self.wake = wake
        self.is_open = False

    def close(self):
        nl_lock_spin(&self.lock)
        self.is_open = False
        nl_unlock(&self.lock)

    def open(self):
        nl_lock_spin(&self.lock)
        self.is_open = True
        nl_unlock(&self.lock)

    def rearm(self):
        """Called by each sync: the next lease to run out wakes the sync again."""
        self.wake_pending = False

    @property
    def early_syncs(self):
        """Requests that found their lease spent while the budget had room."""
        return self.early

    @property
    def decided(self):
        """Requests (and peeks) answered in C, without the Python path."""
        return self.decided


@cython.final
cdef class LeaseBook:
    """Per (TwoTierStorage, limiter config): each key's current-window lease,
    where a native limiter decides a request without leaving C. A new key, a
    new window, a partition or a sync in progress goes to the storage's
    Python path, which loads the record again afterwards. Every method but
    ``decide`` must be called with the gate closed."""

    cdef LeaseGate gate
    cdef dict index                 # key -> slot
    cdef LeaseRecord* records
    cdef Py_ssize_t* dirty          # slots committed to since take_dirty; one entry each
    cdef Py_ssize_t dirty_len
    cdef Py_ssize_t used
    cdef Py_ssize_t allocated
    cdef list free_slots
    cdef list keys                  # slot -> key (None when free)
    cdef list owners                # slot -> what attach was given for it (the storage's track)
    cdef readonly int64_t limit
    cdef readonly double window
    cdef readonly bint sliding
    cdef readonly double sync_interval

    def __cinit__(self, LeaseGate gate not None, limit, window, sliding, sync_interval):
        self.gate = gate
        self.index = {}
        self.free_slots = []
        self.keys = []
        self.owners = []
        self.limit = limit
        self.window = window
        self.sliding = bool(sliding)
        self.sync_interval = sync_interval
        if not (1 <= self.limit and self.window > 0.0 and self.sync_interval > 0.0):
            raise ValidationError("LeaseBook needs limit >= 1, window > 0 and sync_interval > 0")
        if not MAX_TIME_C / self.window < 4.611686018427388e18:  # 2**62: window indexes fit int64
            raise ValidationError(f"LeaseBook window {self.window!r} is too short for int64 window indexes")

    def __dealloc__(self):
        free(self.records)
        free(self.dirty)

    cdef inline void check_closed(self) except *:
        if self.gate.is_open:
            raise RuntimeError("LeaseBook changed while its gate is open")

    cdef inline LeaseRecord* record(self, Py_ssize_t slot) except NULL:
        if not 0 <= slot < self.used:
            raise IndexError(f"lease slot {slot} out of range")
        return &self.records[slot]

    def attach(self, key, owner=None):
        """A slot for ``key`` (empty until ``load``); ``take_dirty`` hands
        ``owner`` back (the storage's own record of the key)."""
        cdef Py_ssize_t slot, size
        cdef LeaseRecord* grown
        cdef Py_ssize_t* grown_dirty
        cdef bint listed = False
        self.check_closed()
        if type(key) is not str:  # lookups run under the gate's spinlock: no Python __eq__
            raise TypeError(f"LeaseBook keys are str, not {type(key).__name__}")
        if key in self.index:
            return self.index[key]
        if self.free_slots:
            slot = self.free_slots.pop()
            listed = self.records[slot].listed  # still in the dirty list: stays there once,
            # reported only if the new key is committed to
            self.keys[slot] = key
            self.owners[slot] = owner
        else:
            if self.used == self.allocated:
                size = self.allocated * 2 + 16
                grown = <LeaseRecord*>realloc(self.records, <size_t>size * sizeof(LeaseRecord))
                if grown == NULL:
                    raise MemoryError()
                self.records = grown
                # the dirty list holds each slot at most once: it never outgrows the records
                grown_dirty = <Py_ssize_t*>realloc(self.dirty, <size_t>size * sizeof(Py_ssize_t))
                if grown_dirty == NULL:
                    raise MemoryError()
                self.dirty = grown_dirty
                self.allocated = size
            slot = self.used
            self.used += 1
            self.keys.append(key)
            self.owners.append(owner)
        memset(&self.records[slot], 0, sizeof(LeaseRecord))
        self.records[slot].window_index = LEASE_NONE
        self.records[slot].listed = listed
        self.index[key] = slot
        return slot

    def detach(self, key):
        self.check_closed()
        slot = self.index.pop(key, None)
        if slot is not None:
            self.records[<Py_ssize_t>slot].window_index = LEASE_NONE
            self.keys[slot] = None
            self.owners[slot] = None
            self.free_slots.append(slot)

    def take_dirty(self):
        """The owners (see ``attach``) of the keys committed to in C since
        the last call, each once."""
        cdef Py_ssize_t i, slot
        self.check_closed()
        out = []
        for i in range(self.dirty_len):
            slot = self.dirty[i]
            self.records[slot].listed = False
            if self.keys[slot] is not None and self.records[slot].committed:
                out.append(self.owners[slot])
            self.records[slot].committed = False
        self.dirty_len = 0
        return out

    def pull(self, Py_ssize_t slot):
        """``(window_index or None, own units, last_now, committed decisions,
        rolled-away window or None, its own units, largest cost refused for
        want of lease)``: what C decided since the last pull. The decision
        count and the wanted cost restart from zero."""
        self.check_closed()
        cdef LeaseRecord* r = self.record(slot)
        cdef int64_t n = r.decisions
        cdef int64_t want = r.want
        cdef bint rolled = r.prev_pending
        r.decisions = 0
        r.want = 0
        r.prev_pending = False
        return (None if r.window_index == LEASE_NONE else r.window_index, r.own, r.last_now, n,
                r.prev_index if rolled else None, r.prev_own if rolled else 0, want)

    def load(self, Py_ssize_t slot, int64_t window_index, int64_t own, int64_t ceiling,
             int64_t others, int64_t previous, double last_now, int64_t next_ceiling):
        self.check_closed()
        cdef LeaseRecord* r = self.record(slot)
        if r.prev_pending:
            raise RuntimeError("LeaseBook.load before the rolled-away window was pulled")
        r.window_index = window_index
        r.own = own
        r.ceiling = ceiling
        r.others = others
        r.previous = previous if self.sliding else 0
        r.last_now = last_now
        r.next_ceiling = next_ceiling

    def __len__(self):
        return len(self.index)

    cdef int decide(self, object key, int64_t cost, double now, bint commit, Verdict* v) except -1:
        """1 when decided here (``v`` filled), 0 when the Python path must.
        Mirrors ``TwoTierStorage._decide`` operation for operation."""
        cdef LeaseGate gate = self.gate
        cdef PyObject* found
        cdef LeaseRecord* r
        cdef int64_t k, current, previous, own, ceiling, others
        cdef double start, weight, estimate, reset_after, retry_after, end, room
        cdef bint fits, ok, rolls = False, wake = False
        nl_lock_spin(&gate.lock)
        if not gate.is_open:
            nl_unlock(&gate.lock)
            return 0
        found = PyDict_GetItem(self.index, key)
        if found == NULL:
            nl_unlock(&gate.lock)
            return 0
        r = &self.records[PyLong_AsSsize_t(<object>found)]
        if r.last_now > now:
            now = r.last_now
        k = nl_floor_i64(now / self.window)
        if k == r.window_index:
            own = r.own
            ceiling = r.ceiling
            others = r.others
            previous = r.previous
        elif k > r.window_index != LEASE_NONE and not r.prev_pending:
            # a later window, not yet synced: nobody's units seen, the default
            # share; the window just left is the sliding estimate's previous
            rolls = True
            own = 0
            ceiling = r.next_ceiling
            others = 0
            previous = r.others + r.own if (self.sliding and k == r.window_index + 1) else 0
        else:
            nl_unlock(&gate.lock)
            return 0
        gate.decided += 1
        if commit:
            r.last_now = now
            r.decisions += 1
            if not r.committed:
                r.committed = True
                if not r.listed:
                    r.listed = True
                    self.dirty[self.dirty_len] = r - self.records
                    self.dirty_len += 1
            if rolls:  # keep the left window's units for the sync until pulled
                r.prev_index = r.window_index
                r.prev_own = r.own
                r.prev_pending = True
                r.window_index = k
                r.own = 0
                r.ceiling = ceiling
                r.others = 0
                r.previous = previous
        start = <double>k * self.window
        current = others + own
        weight = 1.0 - (now - start) / self.window
        estimate = <double>previous * weight + <double>current
        fits = estimate + <double>cost <= <double>self.limit
        ok = fits and own <= ceiling - cost
        if fits and not ok:
            if commit and cost > r.want:
                r.want = cost           # the next sync asks a lease this big (a cost above ceil(L/N))
            gate.early += 1
            if not gate.wake_pending:
                gate.wake_pending = True
                wake = True
        end = start + self.window - now
        reset_after = end if (current > 0 or previous > 0) else 0.0
        if current > 0 and self.sliding:
            reset_after = start + 2 * self.window - now
        v.storage_full = False
        v.delay = 0.0
        v.allowed = ok
        if ok:
            if commit:
                r.own += cost
            v.remaining = <double>self.limit - estimate - <double>cost
            v.retry_after = 0.0
            v.reset_after = end if end > reset_after else reset_after
        else:
            retry_after = end
            if fits:
                if self.sync_interval < retry_after:
                    retry_after = self.sync_interval
            elif self.sliding and previous > 0:
                room = <double>(self.limit - current - cost)
                if room >= 0:
                    retry_after = start + self.window * (1 - room / <double>previous) - now
            v.remaining = <double>self.limit - estimate
            v.retry_after = retry_after if retry_after > 0.0 else 0.0
            v.reset_after = reset_after
        nl_unlock(&gate.lock)
        if wake:
            gate.wake()
        return 1


# ============================================================== limiters

cdef class _Limiter:
    """Shared machinery of the six limiters; subclasses name the algorithm."""

    cdef Params p
    cdef InMemoryStorage store          # None when the storage is not native
    cdef object _storage
    cdef object _clock
    cdef object _config
    cdef object _fallback               # reference limiter over a foreign storage
    cdef object kernel_run              # storage.run_kernel of a KernelStorage (Redis), else None
    cdef LeaseBook book                 # a TwoTierStorage's leases for this config, else None
    cdef bint system_clock
    cdef uint32_t ns
    cdef uint64_t seed
    cdef str _rule
    cdef Py_ssize_t max_key_bytes
    cdef object __weakref__              # the storage tracks which namespaces live limiters use

    algorithm = None

    def __init__(self, limit, window_seconds, storage=None, clock=None, rule="", *, burst=None):
        algorithm = type(self).algorithm
        cfg = LimiterConfig.build(algorithm, limit, window_seconds, burst, rule)
        if clock is None:
            clock = SystemClock()
        elif not callable(getattr(clock, "now", None)):
            raise ValidationError(f"clock must have a now() method, got {type(clock).__name__}")
        if storage is None:
            storage = InMemoryStorage()
        elif not isinstance(storage, Storage):
            raise ValidationError(f"storage must implement Storage, got {type(storage).__name__}")
        self._config = cfg
        self._storage = storage
        self._clock = clock
        self._rule = cfg.rule
        self.system_clock = type(clock) is SystemClock
        self.p.algorithm = ALGORITHM_IDS[algorithm]
        self.p.capacity = cfg.capacity
        self.p.capacity_f = <double>cfg.capacity
        self.p.rate = cfg.rate
        self.p.window = cfg.window_seconds
        self.p.interval_us = cfg.gcra_interval_us
        self.p.tolerance_us = cfg.gcra_tolerance_us
        if isinstance(storage, InMemoryStorage):
            self.store = <InMemoryStorage>storage
            self.ns = self.store.namespace(algorithm, self._rule, &self.p, self)
            self.seed = nl_namespace_seed(self.ns)
            self.max_key_bytes = self.store.max_key_bytes
        else:
            # Any other storage (Redis runs the kernels in Lua; a user's runs
            # them through apply): the reference limiter is the glue.
            self.store = None
            self._fallback = _reference.LIMITERS[algorithm](
                limit, window_seconds, storage, clock, rule, burst=burst
            )
            self.max_key_bytes = getattr(storage, "max_key_bytes", MAX_KEY_BYTES)
            # A storage that runs the kernels itself is called directly for
            # single decisions: the checks stay in C, one Python call remains.
            self.kernel_run = storage.run_kernel if isinstance(storage, KernelStorage) else None
            # A storage that leases budget locally (TwoTierStorage) lets us
            # decide against the lease in C while the lease holds.
            hook = getattr(storage, "lease_book", None) if self.kernel_run is not None else None
            book = hook(cfg) if callable(hook) else None
            if isinstance(book, LeaseBook):
                self.book = <LeaseBook>book

    # -- properties ------------------------------------------------------------
    @property
    def limit(self):
        return self._config.limit

    @property
    def capacity(self):
        return self._config.capacity

    @property
    def window_seconds(self):
        return self._config.window_seconds

    @property
    def burst(self):
        return self._config.burst

    @property
    def rule(self):
        return self._rule

    @property
    def config(self):
        """The validated configuration (what a KernelStorage is given)."""
        return self._config

    @property
    def storage(self):
        return self._storage

    @property
    def clock(self):
        return self._clock

    # -- decisions -----------------------------------------------------------
    cdef inline double read_clock(self) except? -1.0:
        if self.system_clock:
            return nl_wall_now()
        return clock_value(self._clock.now())

    cdef Decision decide(self, object key, object cost, bint commit):
        cdef Verdict v
        cdef Py_ssize_t klen
        cdef const char* data
        cdef uint64_t h
        cdef int64_t units
        cdef double now = 0.0  # set below on either clock path; this quiets -Wmaybe-uninitialized
        cdef int status
        if self.store is None:
            return self.decide_elsewhere(key, cost, commit)
        # The system clock first: its TSC read is ordered (it waits for every
        # earlier instruction), so work placed before it, such as the hash
        # below, would stall it (+3-4 ns measured). It cannot fail, so the
        # order of the checks' errors does not change.
        if self.system_clock:
            now = nl_wall_now()
        data = key_bytes(key, self.max_key_bytes, &klen)
        h = self.store.hash_key(self.seed, data, klen)
        # In a large table the index slot is a cache miss: start it now, so
        # it overlaps the cost check and the stripe lock (a hint: it reads
        # the stripe unlocked, and a stale address is harmless to prefetch).
        prefetch_slot(self.store.stripe_for(h), h)
        units = cost_value(cost, self.p.capacity)
        if not self.system_clock:
            now = clock_value(self._clock.now())
        status = self.store.decide(h, self.ns, data, klen, now, units, &self.p, commit, &v)
        if status != NL_OK:
            raise_status(status)
        return make_decision(&v, self.p.capacity, self._rule, self.p.window)

    cdef Decision decide_elsewhere(self, object key, object cost, bint commit):
        """A storage other than InMemoryStorage: a lease in C (TwoTierStorage),
        the storage's own kernels (KernelStorage), or the reference glue.
        Kept out of ``decide`` so the in-memory path stays compact."""
        cdef Verdict v
        cdef Py_ssize_t klen
        cdef int64_t units
        cdef double now
        if self.kernel_run is None:
            return self.foreign(key, cost, commit)
        key_bytes(key, self.max_key_bytes, &klen)
        units = cost_value(cost, self.p.capacity)
        if self.book is not None and type(key) is str:
            now = self.read_clock()
            if self.book.decide(key, units, now, commit, &v):
                return make_decision(&v, self.p.capacity, self._rule, self.p.window)
            return self.from_verdict(self.kernel_run(self._config, key, units, now, commit))
        return self.from_verdict(self.kernel_run(
            self._config, key, units, None if self.system_clock else self.read_clock(), commit))

    cdef Decision foreign(self, object key, object cost, bint commit):
        d = self._fallback.allow(key, cost) if commit else self._fallback.peek(key, cost)
        return Decision(d.allowed, d.limit, d.remaining, d.retry_after, d.reset_after,
                        d.rule, d.window, d.delay, d.degraded, d.reason)

    def allow(self, key, cost=1):
        """Decide one request and spend its cost if it passes."""
        return self.decide(key, cost, True)

    def peek(self, key, cost=1):
        """What ``allow`` would answer now, spending nothing and storing nothing."""
        return self.decide(key, cost, False)

    def allow_async(self, key, cost=1):
        """``await limiter.allow_async(key)``: awaits an async storage
        (``AsyncRedisStorage``); on any other it answers at once."""
        return decide_async(self, key, cost, True)

    def peek_async(self, key, cost=1):
        """``await limiter.peek_async(key)``: ``peek`` for async code."""
        return decide_async(self, key, cost, False)

    def _decision(self, verdict):
        """A Decision from a storage's KernelVerdict tuple."""
        return self.from_verdict(verdict)

    cdef Decision from_verdict(self, object verdict):
        """``_decision`` without a Python call: a KernelVerdict tuple of
        plain values read in C (anything else takes the general path)."""
        cdef Verdict v
        cdef Py_ssize_t n
        cdef Decision d
        if type(verdict) is not tuple or not 5 <= len(<tuple>verdict) <= 7 or not isfinite(verdict[1]):
            return Decision(verdict[0], self.p.capacity, max(0, floor(verdict[1])), verdict[2], verdict[3],
                            self._rule, self.p.window, verdict[4],
                            verdict[5] if len(verdict) > 5 else False,
                            verdict[6] if len(verdict) > 6 else "")
        n = len(<tuple>verdict)
        v.allowed = bool(verdict[0])
        v.remaining = verdict[1]
        v.retry_after = verdict[2]
        v.reset_after = verdict[3]
        v.delay = verdict[4]
        v.storage_full = False
        d = make_decision(&v, self.p.capacity, self._rule, self.p.window)
        if n > 5:
            d.degraded = bool(verdict[5])
        if n > 6:
            d.reason = str(verdict[6])
        return d

    def allow_many(self, keys, costs=None, *, times=None):
        """Decide a batch in order with the GIL released; every key and cost is
        checked before any is spent. Returns a :class:`BatchResult` of arrays.

        ``times`` (replays) gives each request its own clock reading instead
        of one reading for the batch; per key, time still never runs backwards.

        A batch is a sequence of decisions, not one (``allow_all`` is): if
        memory for a new key's state runs out part-way, ``MemoryError`` is
        raised and the requests before that one stay decided and charged.
        """
        # The batch borrows each key's bytes and decides with the GIL
        # released: it holds its own reference to every key (``held``), so
        # no other thread, clock, cost's __index__ or finalizer that runs
        # meanwhile can free one by emptying the caller's list. The lists are
        # indexed with bounds checks, as such code may also shrink them.
        cdef list key_list = keys if type(keys) is list else list(keys)
        cdef list cost_list = None
        cdef list time_list = None
        cdef double* stamps = NULL
        cdef char* block
        cdef Py_ssize_t n = len(key_list)
        cdef Py_ssize_t i, done = 0, refused = 0, nheld = 0
        cdef const char** data
        cdef Py_ssize_t* sizes
        cdef int64_t* units
        cdef uint64_t* hashes
        cdef PyObject** held
        cdef uint8_t* storage_full
        cdef object key
        cdef dict reasons = None
        cdef array allowed, remaining, retry, reset, delay
        cdef double now
        cdef int status
        if self.store is None:
            r = self._fallback.allow_many(key_list, costs, times=times)
            return BatchResult(Decision, r.limit, r.rule, r.window, r.allowed, r.remaining,
                               r.retry_after, r.reset_after, r.delay, r.degraded, r.reasons)
        if costs is not None:
            cost_list = costs if type(costs) is list else list(costs)
            if len(cost_list) != n:
                raise ValidationError(f"{n} keys but {len(cost_list)} costs")
        if times is not None:
            time_list = times if type(times) is list else list(times)
            if len(time_list) != n:
                raise ValidationError(f"{n} keys but {len(time_list)} times")
        block = <char*>malloc(<size_t>(n if n else 1) * (sizeof(char*) + sizeof(Py_ssize_t)
                                                        + sizeof(int64_t) + sizeof(uint64_t)
                                                        + sizeof(PyObject*) + sizeof(double)
                                                        + sizeof(uint8_t)))
        if block == NULL:
            raise MemoryError()
        data = <const char**>block
        sizes = <Py_ssize_t*>(data + n)
        units = <int64_t*>(sizes + n)
        hashes = <uint64_t*>(units + n)
        held = <PyObject**>(hashes + n)
        stamps = <double*>(held + n)            # used only with ``times``
        storage_full = <uint8_t*>(stamps + n)
        if time_list is None:
            stamps = NULL
        try:
            with cython.boundscheck(True):
                for i in range(n):
                    key = key_list[i]
                    data[i] = key_bytes(key, self.max_key_bytes, &sizes[i])
                    Py_INCREF(key)
                    held[i] = <PyObject*>key
                    nheld = i + 1
                    units[i] = 1 if costs is None else cost_value(cost_list[i], self.p.capacity)
                if time_list is not None:
                    for i in range(n):
                        stamps[i] = clock_value(time_list[i])
            if time_list is not None:
                now = 0.0
            else:
                now = self.read_clock()
            allowed = clone(_U8, n, False)
            remaining = clone(_I64, n, False)
            retry = clone(_F64, n, False)
            reset = clone(_F64, n, False)
            delay = clone(_F64, n, False)
            with nogil:
                status = self.store.decide_batch(
                    self.ns, self.seed, n, data, sizes, units, hashes, now, stamps, &self.p,
                    allowed.data.as_uchars, <int64_t*>remaining.data.as_longlongs, retry.data.as_doubles,
                    reset.data.as_doubles, delay.data.as_doubles, storage_full, &done, &refused)
            if status == NL_OK and refused > 0:
                # which requests a bounded storage refused (no room for a new key)
                reasons = {i: REASON_STORAGE_FULL for i in range(n) if storage_full[i]}
        finally:
            for i in range(nheld):
                Py_DECREF(<object>held[i])
            free(block)
        if status != NL_OK:
            raise_status(status)
        return BatchResult(Decision, self.p.capacity, self._rule, self.p.window,
                           allowed, remaining, retry, reset, delay, refused > 0, reasons)

    def reset(self, key):
        """Forget ``key``: its next request sees a full budget."""
        cdef Py_ssize_t klen
        cdef const char* data
        if self.store is None:
            self._fallback.reset(key)
            return
        data = key_bytes(key, self.max_key_bytes, &klen)
        self.store.forget(self.ns, self.seed, data, klen)

    def state(self, key):
        """A snapshot of ``key``'s state, or ``None`` if the storage holds none."""
        cdef Py_ssize_t klen
        cdef const char* data
        if self.store is None:
            return self._fallback.state(key)
        data = key_bytes(key, self.max_key_bytes, &klen)
        return self.store.snapshot(self.ns, self.seed, data, klen, type(self).algorithm)

    def __repr__(self):
        cfg = self._config
        burst = "" if cfg.burst is None else f", burst={cfg.burst}"
        return f"{type(self).__name__}({cfg.limit}, {cfg.window_seconds!r}, rule={cfg.rule!r}{burst})"


cdef class TokenBucket(_Limiter):
    """Refills ``limit`` tokens per window up to ``burst`` (default ``limit``)."""

    algorithm = Algorithm.TOKEN_BUCKET


cdef class LeakyBucket(_Limiter):
    """A shaper: admitted work queues and drains at the rate; ``delay`` says how long to wait."""

    algorithm = Algorithm.LEAKY_BUCKET


cdef class FixedWindowCounter(_Limiter):
    """``limit`` per aligned window; cheap, but lets 2x through across a boundary."""

    algorithm = Algorithm.FIXED_WINDOW


cdef class SlidingWindowLog(_Limiter):
    """Exact: at most ``limit`` units in any trailing window, O(limit) memory per key."""

    algorithm = Algorithm.SLIDING_LOG


cdef class SlidingWindowCounter(_Limiter):
    """Approximates the sliding log with two counters per key."""

    algorithm = Algorithm.SLIDING_COUNTER


cdef class GCRA(_Limiter):
    """Generic cell rate algorithm: one integer per key, smooth spacing, burst tolerance."""

    algorithm = Algorithm.GCRA


LIMITERS = {
    cls.algorithm: cls
    for cls in (TokenBucket, LeakyBucket, FixedWindowCounter, SlidingWindowLog,
                SlidingWindowCounter, GCRA)
}

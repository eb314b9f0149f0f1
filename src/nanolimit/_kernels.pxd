# cython: language_level=3, cdivision=True
# The six decision kernels: docs/spec.md §4 written literally, in the same order of
# floating-point operations as ``reference.py`` (its ``_<algorithm>``
# functions). ``now`` is already ``max(clock, updated_at)``; the caller stamps
# ``updated_at`` afterwards. Kernels never raise and never touch Python objects.

from libc.stdint cimport int64_t, uint32_t
from libc.stdlib cimport free, malloc

from nanolimit._types cimport (
    ALG_FIXED_WINDOW, ALG_GCRA, ALG_LEAKY_BUCKET, ALG_SLIDING_COUNTER,
    ALG_SLIDING_LOG, ALG_TOKEN_BUCKET, NL_NOMEM, NL_OK, Entry, GcraState,
    LogState, Params, Verdict, WindowState, nl_floordiv, nl_floor_i64,
)


cdef inline void init_state(Entry* e, double now, const Params* p) noexcept nogil:
    """State of a key nobody has seen yet (matches ``reference._new_state``)."""
    cdef int alg = p.algorithm
    e.updated_at = now
    if alg == ALG_TOKEN_BUCKET:
        e.state.bucket.level = p.capacity_f
    elif alg == ALG_LEAKY_BUCKET:
        e.state.bucket.level = 0.0
    elif alg == ALG_GCRA:
        e.state.gcra.tat = nl_floor_i64(now * 1000000.0)
    elif alg == ALG_SLIDING_LOG:
        e.state.log.ring = NULL
        e.state.log.head = 0
        e.state.log.length = 0
    else:
        e.state.window.index = nl_floor_i64(now / p.window)
        e.state.window.count = 0
        e.state.window.previous = 0


# ---------------------------------------------------------------- buckets

cdef inline void token_bucket(Entry* e, double now, int64_t cost, const Params* p,
                              Verdict* v) noexcept nogil:
    cdef double capacity = p.capacity_f
    cdef double rate = p.rate
    cdef double elapsed = now - e.updated_at
    cdef double level = e.state.bucket.level + elapsed * rate
    if level > capacity:
        level = capacity
    v.retry_after = 0.0
    v.delay = 0.0
    v.allowed = level >= <double>cost
    if v.allowed:
        level = level - <double>cost
    else:
        v.retry_after = (<double>cost - level) / rate
    e.state.bucket.level = level
    v.remaining = level
    v.reset_after = (capacity - level) / rate


cdef inline void leaky_bucket(Entry* e, double now, int64_t cost, const Params* p,
                              Verdict* v) noexcept nogil:
    cdef double capacity = p.capacity_f
    cdef double rate = p.rate
    cdef double elapsed = now - e.updated_at
    cdef double level = e.state.bucket.level - elapsed * rate
    cdef double room
    if level < 0.0:
        level = 0.0
    room = capacity - level
    v.delay = 0.0
    v.retry_after = 0.0
    v.allowed = <double>cost <= room
    if v.allowed:
        v.delay = level / rate
        level = level + <double>cost
        v.remaining = capacity - level
    else:
        v.remaining = room
        v.retry_after = (<double>cost - room) / rate
    e.state.bucket.level = level
    v.reset_after = level / rate


# ---------------------------------------------------------------- windows

cdef inline void fixed_window(Entry* e, double now, int64_t cost, const Params* p,
                              Verdict* v) noexcept nogil:
    cdef WindowState* w = &e.state.window
    cdef double window = p.window
    cdef int64_t index = nl_floor_i64(now / window)
    cdef double start
    if index != w.index:
        w.index = index
        w.count = 0
    start = <double>w.index * window
    v.retry_after = 0.0
    v.delay = 0.0
    v.allowed = <int64_t>w.count + cost <= p.capacity
    if v.allowed:
        w.count += <uint32_t>cost
    else:
        v.retry_after = start + window - now
    v.reset_after = start + window - now if w.count > 0 else 0.0
    v.remaining = <double>(p.capacity - <int64_t>w.count)


cdef inline uint32_t log_ring_size(const LogState* lg) noexcept nogil:
    """Slots in the ring, kept in the word just before it (0 without a ring)."""
    if lg.ring == NULL:
        return 0
    return (<const uint32_t*>(lg.ring - 1))[0]


cdef inline void log_free(LogState* lg) noexcept nogil:
    if lg.ring != NULL:
        free(lg.ring - 1)
        lg.ring = NULL


cdef inline double log_at(const LogState* lg, uint32_t i) noexcept nogil:
    """The i-th oldest timestamp."""
    cdef uint32_t size = log_ring_size(lg)
    cdef uint32_t j = lg.head + i
    if j >= size:
        j -= size
    return lg.ring[j]


cdef inline void log_drop_oldest(LogState* lg) noexcept nogil:
    lg.head += 1
    if lg.head == log_ring_size(lg):
        lg.head = 0
    lg.length -= 1


cdef inline int log_reserve(LogState* lg, int64_t needed, int64_t capacity) noexcept nogil:
    """Grow the ring (doubling, at most ``capacity``) so ``needed`` entries fit."""
    cdef int64_t size = log_ring_size(lg)
    cdef double* block
    cdef uint32_t i
    if needed > capacity:
        needed = capacity       # a full ring of ``capacity`` always has room after the expiry
    if needed <= size:
        return NL_OK
    size = 8 if size == 0 else size * 2
    if size < needed:
        size = needed
    if size > capacity:
        size = capacity
    block = <double*>malloc(<size_t>(size + 1) * sizeof(double))
    if block == NULL:
        return NL_NOMEM
    (<uint32_t*>block)[0] = <uint32_t>size
    for i in range(lg.length):
        block[i + 1] = log_at(lg, i)
    log_free(lg)
    lg.ring = block + 1
    lg.head = 0
    return NL_OK


cdef inline int sliding_log(Entry* e, double now, int64_t cost, const Params* p,
                            bint commit, Verdict* v) noexcept nogil:
    """``commit=False`` (peek) may run on a copy of the entry: it only moves
    the copy's head, never writes the shared ring."""
    cdef LogState* lg = &e.state.log
    cdef int64_t capacity = p.capacity
    cdef double window = p.window
    cdef double cutoff
    cdef uint32_t tail, size, expired = 0
    cdef int64_t i
    while lg.length > capacity:          # capacity lowered by a hot reload
        log_drop_oldest(lg)
    cutoff = now - window
    if lg.length > 0 and lg.ring[lg.head] <= cutoff:
        expired = 1
        while expired < lg.length and log_at(lg, expired) <= cutoff:
            expired += 1
    # Room first, then the expiry: an out-of-memory leaves the log as it was.
    if commit and lg.length - expired + cost <= capacity:
        if log_reserve(lg, lg.length + cost, capacity) != NL_OK:
            return NL_NOMEM
    while expired > 0:
        log_drop_oldest(lg)
        expired -= 1
    v.retry_after = 0.0
    v.delay = 0.0
    v.allowed = lg.length + cost <= capacity
    if v.allowed:
        if commit:
            size = log_ring_size(lg)     # room made above
            tail = lg.head + lg.length
            if tail >= size:
                tail -= size
            for i in range(cost):
                lg.ring[tail] = now
                tail += 1
                if tail == size:
                    tail = 0
            lg.length += <uint32_t>cost
            v.remaining = <double>(capacity - lg.length)
        else:
            v.remaining = <double>(capacity - lg.length - cost)
        v.reset_after = now + window - now
    else:
        v.remaining = 0.0
        v.retry_after = log_at(lg, <uint32_t>(lg.length + cost - capacity - 1)) + window - now
        if lg.length > 0:
            v.reset_after = log_at(lg, lg.length - 1) + window - now
        else:
            v.reset_after = 0.0
    return NL_OK


cdef inline void sliding_counter(Entry* e, double now, int64_t cost, const Params* p,
                                 Verdict* v) noexcept nogil:
    cdef WindowState* w = &e.state.window
    cdef double window = p.window
    cdef double capacity = p.capacity_f
    cdef int64_t index = nl_floor_i64(now / window)
    cdef int64_t count, previous, room
    cdef double start, weight, estimate
    if index != w.index:
        w.previous = w.count if index == w.index + 1 else 0
        w.count = 0
        w.index = index
    count = w.count
    previous = w.previous
    start = <double>w.index * window
    weight = 1.0 - (now - start) / window
    estimate = <double>previous * weight + <double>count
    v.retry_after = 0.0
    v.delay = 0.0
    v.allowed = estimate + <double>cost <= capacity
    if v.allowed:
        count += cost
        w.count = <uint32_t>count
        v.remaining = capacity - estimate - <double>cost
    else:
        v.remaining = capacity - estimate
        room = p.capacity - count - cost
        if previous <= 0 or room < 0:
            v.retry_after = start + window - now
        else:
            v.retry_after = start + window * (1.0 - <double>room / <double>previous) - now
    if count > 0:
        v.reset_after = start + 2.0 * window - now
    elif previous > 0:
        v.reset_after = start + window - now
    else:
        v.reset_after = 0.0


# ---------------------------------------------------------------- GCRA

cdef inline void gcra(Entry* e, double now, int64_t cost, const Params* p,
                      Verdict* v) noexcept nogil:
    cdef GcraState* g = &e.state.gcra
    cdef int64_t interval = p.interval_us
    cdef int64_t tolerance = p.tolerance_us
    cdef int64_t now_us = nl_floor_i64(now * 1000000.0)
    cdef int64_t backlog = g.tat - now_us
    if backlog < 0:
        backlog = 0
    v.retry_after = 0.0
    v.delay = 0.0
    v.allowed = backlog + interval * cost <= tolerance
    if v.allowed:
        backlog = backlog + interval * cost
        g.tat = now_us + backlog
    else:
        v.retry_after = <double>(backlog + interval * cost - tolerance) / 1000000.0
    v.remaining = <double>nl_floordiv(tolerance - backlog, interval)
    v.reset_after = <double>backlog / 1000000.0


# ---------------------------------------------------------------- clock faults

cdef inline int clock_rebase(Entry* e, double clock_now, const Params* p, bint commit) noexcept nogil:
    """The key's stamp is more than the clock lead ahead of the clock: take
    the lead as the clock's error and move the state back by it, debt kept
    (matches ``reference._rebase``). ``commit=False`` runs on a copy of the
    entry: a sliding log then gets a ring of its own, which the caller
    frees with ``log_free``."""
    cdef int alg = p.algorithm
    cdef double lead = e.updated_at - clock_now
    cdef LogState* lg = &e.state.log
    cdef double* block
    cdef uint32_t i, size, j
    if alg == ALG_GCRA:
        e.state.gcra.tat = e.state.gcra.tat - (nl_floor_i64(e.updated_at * 1000000.0)
                                               - nl_floor_i64(clock_now * 1000000.0))
    elif alg == ALG_FIXED_WINDOW or alg == ALG_SLIDING_COUNTER:
        e.state.window.index = e.state.window.index - (nl_floor_i64(e.updated_at / p.window)
                                                       - nl_floor_i64(clock_now / p.window))
    elif alg == ALG_SLIDING_LOG and lg.length > 0:
        if not commit:
            block = <double*>malloc(<size_t>(lg.length + 1) * sizeof(double))
            if block == NULL:
                return NL_NOMEM
            (<uint32_t*>block)[0] = lg.length
            for i in range(lg.length):
                block[i + 1] = log_at(lg, i)
            lg.ring = block + 1
            lg.head = 0
        size = log_ring_size(lg)
        j = lg.head
        for i in range(lg.length):
            lg.ring[j] = lg.ring[j] - lead
            j += 1
            if j == size:
                j = 0
    e.updated_at = clock_now
    return NL_OK


cdef inline void add_clock_lead(Verdict* v, double lead) noexcept nogil:
    """Durations are measured from the key's time, which stands ``lead``
    ahead of the clock: a truthful answer adds it (``reference._add_lead``)."""
    if v.retry_after > 0.0:
        v.retry_after = v.retry_after + lead
    if v.reset_after > 0.0:
        v.reset_after = v.reset_after + lead
    if v.delay > 0.0:
        v.delay = v.delay + lead


# ---------------------------------------------------------------- refunds
# ``reference._refund_<algorithm>``, operation for operation: give back what
# an admitted decision made at ``at`` charged. ``now`` is already
# ``max(clock, updated_at)``; the caller stamps ``updated_at`` afterwards.

cdef inline void refund_token_bucket(Entry* e, double now, int64_t cost, const Params* p) noexcept nogil:
    cdef double capacity = p.capacity_f
    cdef double level = e.state.bucket.level + (now - e.updated_at) * p.rate
    if level > capacity:
        level = capacity
    level = level + <double>cost
    if level > capacity:
        level = capacity
    e.state.bucket.level = level


cdef inline void refund_leaky_bucket(Entry* e, double now, int64_t cost, const Params* p) noexcept nogil:
    cdef double level = e.state.bucket.level - (now - e.updated_at) * p.rate
    if level < 0.0:
        level = 0.0
    level = level - <double>cost
    if level < 0.0:
        level = 0.0
    e.state.bucket.level = level


cdef inline void refund_gcra(Entry* e, double now, int64_t cost, const Params* p) noexcept nogil:
    cdef int64_t tat = e.state.gcra.tat - p.interval_us * cost
    cdef int64_t now_us = nl_floor_i64(now * 1000000.0)
    if tat < now_us:
        tat = now_us                # never more room than a fresh key's
    e.state.gcra.tat = tat


cdef inline void refund_fixed_window(Entry* e, double now, int64_t cost, double at,
                                     const Params* p) noexcept nogil:
    cdef WindowState* w = &e.state.window
    cdef int64_t index = nl_floor_i64(now / p.window)
    if index != w.index:
        w.index = index
        w.count = 0
    if nl_floor_i64(at / p.window) == w.index:     # else it expired with its window
        w.count -= <uint32_t>cost if <int64_t>w.count > cost else w.count


cdef inline void refund_sliding_counter(Entry* e, double now, int64_t cost, double at,
                                        const Params* p) noexcept nogil:
    cdef WindowState* w = &e.state.window
    cdef int64_t index = nl_floor_i64(now / p.window)
    cdef int64_t charged
    if index != w.index:
        w.previous = w.count if index == w.index + 1 else 0
        w.count = 0
        w.index = index
    charged = nl_floor_i64(at / p.window)
    if charged == w.index:
        w.count -= <uint32_t>cost if <int64_t>w.count > cost else w.count
    elif charged == w.index - 1:
        w.previous -= <uint32_t>cost if <int64_t>w.previous > cost else w.previous


cdef inline void log_expire(LogState* lg, double now, const Params* p) noexcept nogil:
    """The sliding log kernel's trim and expiry, on their own (a refund's)."""
    cdef double cutoff = now - p.window
    while lg.length > p.capacity:
        log_drop_oldest(lg)
    while lg.length > 0 and lg.ring[lg.head] <= cutoff:
        log_drop_oldest(lg)


cdef inline uint32_t log_run_of(const LogState* lg, double at, int64_t cost,
                                uint32_t* first) noexcept nogil:
    """How many of the stamps equal to ``at`` (at most ``cost``) a refund
    removes, and where their run starts: the log is oldest first, so they
    are contiguous."""
    cdef uint32_t i = 0, run = 0
    while i < lg.length and log_at(lg, i) != at:
        i += 1
    while run < cost and i + run < lg.length and log_at(lg, i + run) == at:
        run += 1
    first[0] = i
    return run


cdef inline void refund_sliding_log(Entry* e, double now, int64_t cost, double at,
                                    const Params* p) noexcept nogil:
    """In place: the later stamps move back over the run removed, so the ring
    stays oldest first (the zone, where a holder may die part-way, copies
    instead: ``zone_refund_log``, ``_core_zone_table.pxi``)."""
    cdef LogState* lg = &e.state.log
    cdef uint32_t first, run, i, size, src, dst
    log_expire(lg, now, p)
    run = log_run_of(lg, at, cost, &first)
    if run == 0:
        return
    if first == 0:
        for i in range(run):
            log_drop_oldest(lg)
        return
    size = log_ring_size(lg)
    for i in range(first, lg.length - run):
        dst = lg.head + i
        if dst >= size:
            dst -= size
        src = lg.head + i + run
        if src >= size:
            src -= size
        lg.ring[dst] = lg.ring[src]
    lg.length -= run


cdef inline void refund_kernel(Entry* e, double now, int64_t cost, double at,
                               const Params* p) noexcept nogil:
    cdef int alg = p.algorithm
    if alg == ALG_TOKEN_BUCKET:
        refund_token_bucket(e, now, cost, p)
    elif alg == ALG_GCRA:
        refund_gcra(e, now, cost, p)
    elif alg == ALG_FIXED_WINDOW:
        refund_fixed_window(e, now, cost, at, p)
    elif alg == ALG_SLIDING_COUNTER:
        refund_sliding_counter(e, now, cost, at, p)
    elif alg == ALG_LEAKY_BUCKET:
        refund_leaky_bucket(e, now, cost, p)
    else:
        refund_sliding_log(e, now, cost, at, p)


# ---------------------------------------------------------------- dispatch

cdef inline int run_kernel(Entry* e, double now, int64_t cost, const Params* p,
                           bint commit, Verdict* v) noexcept nogil:
    cdef int alg = p.algorithm
    if alg == ALG_TOKEN_BUCKET:
        token_bucket(e, now, cost, p, v)
    elif alg == ALG_GCRA:
        gcra(e, now, cost, p, v)
    elif alg == ALG_FIXED_WINDOW:
        fixed_window(e, now, cost, p, v)
    elif alg == ALG_SLIDING_COUNTER:
        sliding_counter(e, now, cost, p, v)
    elif alg == ALG_LEAKY_BUCKET:
        leaky_bucket(e, now, cost, p, v)
    else:
        return sliding_log(e, now, cost, p, commit, v)
    return NL_OK

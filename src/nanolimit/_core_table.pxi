# Included by _core.pyx (one extension module, nanolimit._core): its cimports,
# imports and shared constants are in scope here.
#
# Table operations over one stripe (``_table.pxd``): find or create a key,
# bring it to now, run its kernel. All ``noexcept nogil`` under the stripe
# lock, but ``lock_stripe`` and ``release_objects``.

cdef inline bint room_for_new_key(Stripe* s, const Bounds* b, double now) noexcept nogil:
    """Bounded storages: run the idle sweep, then make room in a full stripe
    (``evict_room_for_new_key``). False means the new key must be refused
    (``on_full="deny_new"``, or no entry could be freed). In a compound's
    first phase the room counts ``b.pending`` and spares ``b.keep``."""
    cdef TableRoom R = table_room(s, b)
    return evict_room_for_new_key(&R, now, b.idle_after, b.pending, b.evict_active) > 0


cdef inline bint peek_finds_room(const Stripe* s, const Bounds* b, double now) noexcept nogil:
    """``room_for_new_key`` for ``peek``: the same answer, nothing changed.
    Only a full ``deny_new`` stripe can refuse."""
    cdef TableRoom R
    if b.stripe_cap == 0 or b.evict_active or s.count < s.cap:
        return True
    R = table_room(<Stripe*>s, b)      # read only: the scan walks copies of the cursor and random state
    return evict_could_make_room(&R, now, b.idle_after > 0.0, now - b.idle_after) > 0


cdef inline void refuse_new_key(Verdict* v) noexcept nogil:
    v.allowed = False
    v.storage_full = True
    v.remaining = 0.0
    v.retry_after = 1.0
    v.reset_after = 0.0
    v.delay = 0.0
    v.at = 0.0                  # a policy answered: no charge to name


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
        v.at = clock_now
        return run_kernel(&scratch, clock_now, cost, p, False, v)
    if b != NULL:
        if not room_for_new_key(s, b, clock_now):
            refuse_new_key(v)
            return NL_OK
        stripe_find(s, h, ns, key, klen, &slot)   # eviction may have moved the probe run
    # Decided on a scratch state first: the key goes in only once its charge
    # has succeeded, so an out-of-memory leaves no key behind.
    init_state(&scratch, clock_now, p)
    v.at = clock_now
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
        return clock_fault_path(e, ns, clock_now, cost, p, commit, v)
    now = e.updated_at if e.updated_at > clock_now else clock_now
    v.at = now
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
    v.at = clock_now
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


# Called through a pointer, so the compiler cannot inline the rare path into
# table_decide: inlined, it made table_decide too big to inline into its hot
# callers (+33 instructions on every allow).
cdef int (*clock_fault_path)(Entry*, uint32_t, double, int64_t, const Params*, bint,
                             Verdict*) noexcept nogil
clock_fault_path = decide_after_clock_fault


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
        clock_fault_path(&s.entries[position], ns, clock_now, 0, p, True, &v)


cdef void table_refund(Stripe* s, uint64_t h, uint32_t ns, const char* key, uint32_t klen,
                       double clock_now, int64_t cost, double at, bint latest,
                       const Params* p) noexcept nogil:
    """Give back what a decision made at ``at`` charged (``latest``: the
    key's last decision, its ``updated_at``). Finds and never inserts: a key
    not held has nothing to give back, and is not made."""
    cdef uint32_t slot
    cdef Py_ssize_t position = stripe_find(s, h, ns, key, klen, &slot)
    cdef Entry* e
    cdef double now
    if position < 0:
        return
    e = &s.entries[position]
    now = e.updated_at if e.updated_at > clock_now else clock_now
    refund_kernel(e, now, cost, e.updated_at if latest else at, p)
    e.updated_at = now


cdef void forget_entry(Stripe* s, uint64_t h, uint32_t ns, const char* key,
                       uint32_t klen) noexcept nogil:
    """Remove a limiter's entry (never an ``apply`` one: no Python object to
    release) that an out-of-memory left half made."""
    cdef uint32_t slot
    cdef Py_ssize_t position = stripe_find(s, h, ns, key, klen, &slot)
    if position >= 0:
        stripe_delete(s, slot, <uint32_t>position)


cdef inline void lock_stripe(Stripe* s) noexcept:
    """Take a stripe lock while holding the GIL: try once, and only if that
    fails release the GIL to wait, so a holder that needs the GIL can finish.
    No stripe lock is ever held while Python code runs (``apply`` runs its
    mutate unlocked), so the holder is never this thread and never waits
    for us: the wait is short and cannot deadlock."""
    if nl_trylock(&s.lock):
        return
    with nogil:
        nl_lock_spin(&s.lock)


cdef inline void release_objects(ObjectList* objects):
    cdef size_t i
    for i in range(objects.count):
        Py_DECREF(<object><PyObject*>objects.items[i])
    free(objects.items)
    objects.items = NULL
    objects.count = 0
    objects.capacity = 0


cdef object entry_snapshot(const Entry* copy, uint32_t ns, object algorithm, double* log):
    """A LimiterState of an entry copied out of a table (``log``: its
    stamps, oldest first, freed here)."""
    cdef uint32_t i
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

# Included by _core.pyx (one extension module, nanolimit._core): its cimports,
# imports and shared constants are in scope here.
#
# The zone's table operations (``_zone.pxd``), as ``_core_table.pxi`` is the
# in-memory table's: find or create a key, bring it to now, run its kernel,
# refund, and decide a compound. All ``noexcept nogil`` under the stripe
# locks that SharedMemoryStorage (``_core_zone.pxi``) takes.

cdef inline int zone_room_for_new_key(Zone* z, uint32_t si, double now,
                                      const ZoneCompound* compound) noexcept nogil:
    """``room_for_new_key`` on the zone (``evict_room_for_new_key``): 1 when
    the stripe has room for a new key (made if need be), 0 when it has
    none, NL_CORRUPT when its count or its cap cannot be. In a compound's
    first phase (``compound``, else NULL) the room counts
    ``compound.pending`` and no key of the compound is forgotten for it."""
    cdef ZoneRoom R = zone_room(z, si, NULL, compound)
    return evict_room_for_new_key(&R, now, z.idle_after, 0 if compound == NULL else compound.pending,
                                  z.evict_active)


cdef inline int zone_could_make_room(Zone* z, uint32_t si, double now) noexcept nogil:
    """``peek_finds_room``'s scan on a full ``deny_new`` zone stripe: the
    answer ``zone_room_for_new_key`` would give (1 or 0), changing nothing;
    NL_CORRUPT when the stripe cannot be read."""
    cdef ZoneRoom R = zone_room(z, si, NULL, NULL)
    return evict_could_make_room(&R, now, z.idle_after > 0.0, now - z.idle_after)


cdef inline Entry* zone_ring_for(Zone* z, uint32_t si, Entry* e, uint32_t* keep, int64_t needed,
                                 int64_t capacity, double now, const ZoneCompound* compound,
                                 int* status) noexcept nogil:
    """Make a sliding log's ring hold ``min(needed, capacity)`` stamps before
    its kernel runs, so the kernel never allocates (its rings are C heap;
    these are the arena's). Grows by doubling, as the in-memory log does.
    When the arena is out of room, an ``evict`` zone forgets one other entry
    of the stripe and tries once more. ``keep`` is the position of ``e`` in
    the stripe (NULL for a scratch entry): eviction never picks it, and
    moves it if the entry it frees was the last; nor does it pick a key of
    ``compound`` (the allow_all being prepared, or NULL). Returns ``e`` where it now
    is, or NULL when there is no room (the caller refuses the request) or,
    with ``status`` set to NL_CORRUPT, when the log or the stripe cannot be
    read."""
    cdef ZoneLog* lg = zone_log(e)
    cdef uint32_t size = 0, new_size, i, j, k
    cdef int64_t want
    cdef int freed = 0
    cdef uint64_t block, old
    cdef double* old_ring
    cdef double* new_ring
    cdef ZoneRoom R
    if not zone_log_valid(z, lg):
        status[0] = NL_CORRUPT
        return NULL
    if needed > capacity:
        needed = capacity
    if lg.ring != 0:
        size = (<uint32_t*>(z.base + lg.ring))[0]
    if needed <= <int64_t>size:
        return e
    want = 8 if size == 0 else <int64_t>size * 2
    if want < needed:
        want = needed
    if want > capacity:
        want = capacity
    block = arena_alloc(z, <uint64_t>want)
    if block == 0 and z.evict_active:
        R = zone_room(z, si, keep, compound)
        freed = evict_make_room(&R, now, True)
        if freed < 0:
            status[0] = freed
            return NULL
        if freed > 0:
            if keep != NULL:
                e = &stripe_entries(z, si)[keep[0]]
                lg = zone_log(e)
            block = arena_alloc(z, <uint64_t>want)
    if block == 0:
        z.stripes[si].denied_arena += 1
        return NULL
    old = lg.ring
    old_ring = zone_ring(z, old)
    new_ring = zone_ring(z, block)
    new_size = (<uint32_t*>(z.base + block))[0]
    if old == 0:
        lg.head = 0             # no ring, no stamps: the head means nothing yet
    # Each stamp keeps its place from the head (head < size <= new_size), so
    # the one store of the ring offset switches the log whole: a holder killed
    # on either side of it leaves a log that reads right (resetting the head
    # too was a second store, and between the two the log read the new ring
    # from the old head: stamps that were not there).
    j = lg.head
    k = lg.head
    for i in range(lg.length):
        new_ring[k] = old_ring[j]
        j += 1
        if j == size:
            j = 0
        k += 1
        if k == new_size:
            k = 0
    nlz_compiler_barrier()
    lg.ring = block             # the entry names the new ring before the old one is freed:
    nlz_compiler_barrier()      # a holder killed between leaks a block, never shares one
    arena_free(z, old)
    return e


cdef int zone_decide(Zone* z, uint32_t si, uint64_t h, uint32_t ns, const char* stored, uint32_t klen,
                     double clock_now, int64_t cost, const Params* p, bint commit, ZoneCompound* reserve,
                     Verdict* v) noexcept nogil:
    """``table_decide`` on the zone: find or create the key, bring it to
    ``now`` (never backwards), decide, stamp. A committed change to a
    present key is bracketed by the stripe's undo copy. NL_CORRUPT, nothing
    decided, when the stripe cannot be read (the caller repairs it)."""
    cdef uint32_t slot, position
    cdef Py_ssize_t found = zone_find(z, si, h, ns, stored, klen, &slot)
    cdef Entry* e
    cdef Entry view
    cdef double now
    cdef int status = NL_OK
    cdef ZoneStripe* s = &z.stripes[si]
    v.storage_full = False
    if found < 0:
        if found == ZONE_FIND_CORRUPT:
            return NL_CORRUPT
        return zone_decide_new(z, si, h, ns, stored, klen, slot, clock_now, cost, p, commit, reserve, v)
    position = <uint32_t>found
    e = &stripe_entries(z, si)[position]
    if e.updated_at - clock_now > MAX_CLOCK_LEAD_C:
        return zone_after_clock_fault(z, si, position, clock_now, cost, p, commit, v)
    now = e.updated_at if e.updated_at > clock_now else clock_now
    v.at = now
    if not commit:
        if not zone_view(z, e, &view):
            return NL_CORRUPT
        status = run_kernel(&view, now, cost, p, False, v)
    elif (ns & NS_ALGORITHM_MASK) == ALG_SLIDING_LOG:
        e = zone_ring_for(z, si, e, &position, <int64_t>e.state.log.length + cost, p.capacity, now, NULL,
                          &status)
        if e == NULL:
            if status != NL_OK:
                return status
            refuse_new_key(v)
            return NL_OK
        zone_view(z, e, &view)
        zone_undo_begin(s, position, e)
        status = run_kernel(&view, now, cost, p, True, v)
        view.updated_at = now
        zone_store_view(e, &view)
        zone_undo_end(s)
    else:
        zone_undo_begin(s, position, e)
        status = run_kernel(e, now, cost, p, True, v)
        e.updated_at = now
        zone_undo_end(s)
    if now > clock_now:
        add_clock_lead(v, now - clock_now)
    return status


cdef int zone_decide_new(Zone* z, uint32_t si, uint64_t h, uint32_t ns, const char* stored, uint32_t klen,
                         uint32_t slot, double clock_now, int64_t cost, const Params* p, bint commit,
                         ZoneCompound* reserve, Verdict* v) noexcept nogil:
    """``zone_decide`` for a key not in the zone: decided on a scratch entry,
    which goes in only once its charge succeeded. ``reserve`` (compound
    phase 1, not committing; else NULL): room is made for the key, counting
    the compound's keys (``zone_room_for_new_key``), and ``reserve.reserved``
    says whether it was."""
    cdef Entry scratch
    cdef Entry view
    cdef int status = NL_OK, room
    cdef ZoneStripe* s = &z.stripes[si]
    v.at = clock_now
    if not commit:
        if reserve != NULL:
            room = zone_room_for_new_key(z, si, clock_now, reserve)
            if room < 0:
                return room
            if room == 0:
                refuse_new_key(v)
                return NL_OK
            reserve.reserved = True
        elif not z.evict_active and s.count >= s.cap:
            room = zone_could_make_room(z, si, clock_now)
            if room < 0:
                return room
            if room == 0:
                refuse_new_key(v)       # what allow would answer, counting nothing
                return NL_OK
        init_state(&scratch, clock_now, p)
        return run_kernel(&scratch, clock_now, cost, p, False, v)
    room = zone_room_for_new_key(z, si, clock_now, NULL)
    if room < 0:
        return room
    if room == 0:
        refuse_new_key(v)
        return NL_OK
    if zone_find(z, si, h, ns, stored, klen, &slot) != -1:     # eviction may have moved the probe run
        return NL_CORRUPT
    memset(&scratch, 0, sizeof(Entry))
    scratch.ns = ns
    init_state(&scratch, clock_now, p)
    if (ns & NS_ALGORITHM_MASK) == ALG_SLIDING_LOG:
        if zone_ring_for(z, si, &scratch, NULL, cost, p.capacity, clock_now, NULL, &status) == NULL:
            if status != NL_OK:
                return status
            refuse_new_key(v)
            return NL_OK
        if zone_find(z, si, h, ns, stored, klen, &slot) != -1:
            arena_free(z, zone_log(&scratch).ring)
            return NL_CORRUPT
        zone_view(z, &scratch, &view)
        status = run_kernel(&view, clock_now, cost, p, True, v)
        zone_store_view(&scratch, &view)
    else:
        status = run_kernel(&scratch, clock_now, cost, p, True, v)
    scratch.updated_at = clock_now
    if status != NL_OK or zone_insert(z, si, h, ns, stored, klen, slot, &scratch) == NULL:
        if (ns & NS_ALGORITHM_MASK) == ALG_SLIDING_LOG:
            arena_free(z, zone_log(&scratch).ring)
        return NL_NOMEM if status == NL_OK else status
    return NL_OK


cdef int zone_after_clock_fault(Zone* z, uint32_t si, uint32_t position, double clock_now, int64_t cost,
                                const Params* p, bint commit, Verdict* v) noexcept nogil:
    """``decide_after_clock_fault`` on the zone: a key stamped more than the
    clock lead ahead of the clock is moved back to it, then decided."""
    cdef Entry* e = &stripe_entries(z, si)[position]
    cdef Entry view
    cdef int status = NL_OK
    cdef ZoneStripe* s = &z.stripes[si]
    v.at = clock_now
    if not commit:
        if not zone_view(z, e, &view):
            return NL_CORRUPT
        status = clock_rebase(&view, clock_now, p, False)
        if status != NL_OK:
            return status
        status = run_kernel(&view, clock_now, cost, p, False, v)
        if (e.ns & NS_ALGORITHM_MASK) == ALG_SLIDING_LOG and e.state.log.length > 0:
            log_free(&view.state.log)       # the private ring clock_rebase gave the copy
        return status
    if (e.ns & NS_ALGORITHM_MASK) == ALG_SLIDING_LOG:
        e = zone_ring_for(z, si, e, &position, <int64_t>e.state.log.length + cost, p.capacity, clock_now,
                          NULL, &status)
        if e == NULL:
            if status != NL_OK:
                return status
            refuse_new_key(v)
            return NL_OK
    zone_view(z, e, &view)
    zone_undo_begin(s, position, e)
    clock_rebase(&view, clock_now, p, True)
    status = run_kernel(&view, clock_now, cost, p, True, v)
    view.updated_at = clock_now
    zone_store_view(e, &view)
    zone_undo_end(s)
    return status


cdef int zone_refund(Zone* z, uint32_t si, uint64_t h, uint32_t ns, const char* stored, uint32_t klen,
                     double clock_now, int64_t cost, double at, bint latest, const Params* p) noexcept nogil:
    """``table_refund`` on the zone: find, never insert; the change is
    bracketed by the stripe's undo copy like a decision's, so a holder
    killed part-way is rolled back by whoever takes its lock over."""
    cdef uint32_t slot, position
    cdef Py_ssize_t found = zone_find(z, si, h, ns, stored, klen, &slot)
    cdef Entry* e
    cdef double now
    cdef ZoneStripe* s = &z.stripes[si]
    if found < 0:
        return NL_CORRUPT if found == ZONE_FIND_CORRUPT else NL_OK
    position = <uint32_t>found
    e = &stripe_entries(z, si)[position]
    now = e.updated_at if e.updated_at > clock_now else clock_now
    if latest:
        at = e.updated_at
    if (ns & NS_ALGORITHM_MASK) == ALG_SLIDING_LOG:
        return zone_refund_log(z, si, position, now, cost, at, p)
    zone_undo_begin(s, position, e)
    refund_kernel(e, now, cost, at, p)
    e.updated_at = now
    zone_undo_end(s)
    return NL_OK


cdef int zone_refund_log(Zone* z, uint32_t si, uint32_t position, double now, int64_t cost, double at,
                         const Params* p) noexcept nogil:
    """A sliding log's refund on the zone. The undo copy restores the entry,
    not its ring, so no stamp it names may be overwritten: expiry and a run
    removed at either end of the log move only the head or the length, and
    a run in the middle is copied around into a fresh arena ring that the
    entry names only once it is whole (as ``zone_ring_for`` grows one). A
    holder killed part-way leaks that ring at worst. NL_NOMEM when the arena
    has no ring to spare: nothing is changed then."""
    cdef Entry* e = &stripe_entries(z, si)[position]
    cdef ZoneStripe* s = &z.stripes[si]
    cdef Entry view
    cdef LogState* lg = &view.state.log
    cdef uint32_t first, run, i, kept = 0
    cdef uint64_t block, old
    cdef double* fresh
    if not zone_view(z, e, &view):
        return NL_CORRUPT
    log_expire(lg, now, p)
    run = log_run_of(lg, at, cost, &first)
    if run > 0 and first > 0 and first + run < lg.length:
        block = arena_alloc(z, log_ring_size(lg))
        if block == 0:
            z.stripes[si].denied_arena += 1
            return NL_NOMEM
        fresh = zone_ring(z, block)
        for i in range(lg.length):
            if i < first or i >= first + run:
                fresh[kept] = log_at(lg, i)
                kept += 1
        old = zone_log(e).ring
        zone_undo_begin(s, position, e)
        zone_log(e).ring = block
        zone_log(e).head = 0
        zone_log(e).length = kept
        e.updated_at = now
        zone_undo_end(s)
        arena_free(z, old)      # after the entry names the new ring: never one ring twice
        return NL_OK
    if run > 0 and first == 0:
        for i in range(run):
            log_drop_oldest(lg)
    elif run > 0:
        lg.length -= run        # the newest stamps: nothing after them moves
    zone_undo_begin(s, position, e)
    view.updated_at = now
    zone_store_view(e, &view)
    zone_undo_end(s)
    return NL_OK


cdef int zone_compound(Zone* z, Py_ssize_t n, const uint64_t* hashes, const uint32_t* namespaces,
                       const char** data, const Py_ssize_t* sizes, const double* nows, const int64_t* units,
                       const Params** params, Verdict* verdicts) noexcept nogil:
    """Phase 1 decides every limit without spending, making room for new
    keys. If all allow, what charging needs is made next, as the in-memory
    ``prepare_compound`` does: every new key's entry, and every sliding
    log's ring. If a ring cannot be had, the new entries go again and the
    request is refused (``storage_full``), nothing charged. Phase 2 then
    charges each limit, which can no longer fail. The room for a new key
    counts the compound's new keys of its stripe given room before it (not
    in yet), and no key of the compound is forgotten for it, nor for a
    ring: all inserted, a stripe holds at most its cap (as the in-memory
    table's ``allow_all``). Where that room cannot be made the key is
    refused as a lone new key is (``storage_full``), so the compound is,
    charging nothing."""
    cdef Py_ssize_t i
    cdef uint32_t si, slot, position
    cdef Py_ssize_t found
    cdef bint all_allowed = True
    cdef int status = NL_OK, undone
    cdef Entry* e
    cdef Entry fresh
    cdef Verdict settled
    cdef Py_ssize_t j
    cdef uint8_t created[16]        # ZONE_COMPOUND_MAX
    cdef uint8_t reserved[16]       # room made in phase 1 for this new key
    cdef ZoneCompound compound
    compound.n = n
    compound.namespaces = namespaces
    compound.data = data
    compound.sizes = sizes
    for i in range(n):
        created[i] = 0
        si = zone_stripe_of(z, hashes[i])
        compound.pending = 0
        for j in range(i):
            if reserved[j] and zone_stripe_of(z, hashes[j]) == si:
                compound.pending += 1
        compound.reserved = False
        status = zone_decide(z, si, hashes[i], namespaces[i], data[i], <uint32_t>sizes[i], nows[i], units[i],
                             params[i], False, &compound, &verdicts[i])
        if status != NL_OK:
            return status
        reserved[i] = compound.reserved
        all_allowed = all_allowed and verdicts[i].allowed
    if all_allowed:
        for i in range(n):
            si = zone_stripe_of(z, hashes[i])
            found = zone_find(z, si, hashes[i], namespaces[i], data[i], <uint32_t>sizes[i], &slot)
            if found == ZONE_FIND_CORRUPT:
                return NL_CORRUPT
            if found < 0:
                memset(&fresh, 0, sizeof(Entry))
                fresh.ns = namespaces[i]
                init_state(&fresh, nows[i], params[i])
                e = zone_insert(z, si, hashes[i], namespaces[i], data[i], <uint32_t>sizes[i], slot, &fresh)
                if e == NULL:           # cannot happen: room was made for it; refuse rather than overrun
                    refuse_new_key(&verdicts[i])
                    all_allowed = False
                    break
                created[i] = 1
                found = z.stripes[si].count - 1
            if (namespaces[i] & NS_ALGORITHM_MASK) != ALG_SLIDING_LOG:
                continue
            position = <uint32_t>found
            e = &stripe_entries(z, si)[position]
            if zone_ring_for(z, si, e, &position, <int64_t>e.state.log.length + units[i],
                             params[i].capacity, nows[i], &compound, &status) == NULL:
                if status != NL_OK:
                    return status
                refuse_new_key(&verdicts[i])
                all_allowed = False
                break
        if not all_allowed:
            for i in range(n):
                if created[i]:
                    si = zone_stripe_of(z, hashes[i])
                    found = zone_find(z, si, hashes[i], namespaces[i], data[i], <uint32_t>sizes[i], &slot)
                    if found == ZONE_FIND_CORRUPT:
                        return NL_CORRUPT
                    if found >= 0:
                        undone = zone_delete(z, si, slot, <uint32_t>found)
                        if undone != NL_OK:
                            return undone
    if not all_allowed:
        for i in range(n):          # a key found stamped ahead is stored moved back (settle_clock_fault)
            si = zone_stripe_of(z, hashes[i])
            found = zone_find(z, si, hashes[i], namespaces[i], data[i], <uint32_t>sizes[i], &slot)
            if found == ZONE_FIND_CORRUPT:
                return NL_CORRUPT
            if found >= 0 and stripe_entries(z, si)[found].updated_at - nows[i] > MAX_CLOCK_LEAD_C:
                status = zone_after_clock_fault(z, si, <uint32_t>found, nows[i], 0, params[i], True, &settled)
                if status == NL_CORRUPT:
                    return status
        return NL_OK
    for i in range(n):
        si = zone_stripe_of(z, hashes[i])
        status = zone_decide(z, si, hashes[i], namespaces[i], data[i], <uint32_t>sizes[i], nows[i], units[i],
                             params[i], True, NULL, &verdicts[i])
        if status != NL_OK:
            break
    return status

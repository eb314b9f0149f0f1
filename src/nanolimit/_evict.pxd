# cython: language_level=3, cdivision=True
# Making room in a full stripe, written once for both tables: the in-memory
# table (_table.pxd) and the shared-memory zone (_zone.pxd). The idle sweep,
# the scan and sample that picks the entry to forget (one at rest first,
# else the one handing back the fewest units), its peek twin that changes
# nothing, and the loop that makes room for a new key.
#
# As _index.pxd is for the probe, a layout is a small struct of what the
# scan reads (``TableRoom``, ``ZoneRoom``) and the scan is fused over it;
# its accessors say where a layout differs: how an entry is read (a zone's
# sliding log is viewed at this process's address of its ring), which
# entries may not go (an ``apply`` key's Python object cannot be released
# here; a compound's own keys; the position a zone's ring is grown for),
# and how one is removed. The zone's stripe is read from a segment any
# process may have left half-written, so its count and cap are checked
# against the stripe's array before they bound a loop, and a log that
# cannot be read is NL_CORRUPT: those checks compile into the zone's
# instances only, and the in-memory table's are the loops they were. No
# function here raises or touches a Python object; all run under the
# stripe's lock.

from libc.stdint cimport int64_t, uint32_t, uint64_t

from nanolimit._kernels cimport log_at
from nanolimit._table cimport (
    NS_ALGORITHM_MASK, Bounds, Stripe, entry_kept, params_for, stripe_remove_position,
)
from nanolimit._types cimport (
    ALG_APPLY, ALG_FIXED_WINDOW, ALG_GCRA, ALG_LEAKY_BUCKET, ALG_SLIDING_LOG, ALG_TOKEN_BUCKET, NL_CORRUPT,
    NL_OK, Entry, LogState, Params, nl_floor_i64,
)
from nanolimit._zone cimport (
    Zone, ZoneCompound, ZoneStripe, stripe_entries, zone_entry_kept, zone_forget_keeping, zone_params, zone_view,
)


cdef enum:
    EVICTION_SCAN = 16              # entries along the cursor looked at per eviction
    EVICTION_SAMPLE = 8             # random entries looked at per eviction
    SWEEP_STEP = 4                  # entries the idle sweep looks at per insert


# ---------------------------------------------------------------- the policy

cdef inline bint entry_at_rest(const Entry* e, const Params* p, double now) noexcept nogil:
    """True when the key's state is back to that of a key never seen, so
    forgetting it changes no decision (docs/spec.md §4, the new-key states)."""
    cdef int alg = e.ns & NS_ALGORITHM_MASK
    cdef double elapsed
    cdef int64_t index
    if p == NULL or alg == ALG_APPLY:
        return False
    if now < e.updated_at:
        now = e.updated_at
    elapsed = now - e.updated_at
    if alg == ALG_TOKEN_BUCKET:
        return e.state.bucket.level + elapsed * p.rate >= p.capacity_f
    if alg == ALG_LEAKY_BUCKET:
        return e.state.bucket.level - elapsed * p.rate <= 0.0
    if alg == ALG_GCRA:
        return e.state.gcra.tat <= nl_floor_i64(now * 1000000.0)
    if alg == ALG_SLIDING_LOG:
        return e.state.log.length == 0 or log_at(&e.state.log, e.state.log.length - 1) <= now - p.window
    index = nl_floor_i64(now / p.window)
    if alg == ALG_FIXED_WINDOW:
        return e.state.window.count == 0 or index != e.state.window.index
    # sliding counter: both the current and the previous window must be empty
    if e.state.window.count == 0 and e.state.window.previous == 0:
        return True
    return index >= e.state.window.index + 2 or (index == e.state.window.index + 1 and e.state.window.count == 0)


cdef inline uint32_t log_live(const LogState* lg, double cutoff) noexcept nogil:
    """Stamps newer than ``cutoff`` (the log is oldest first: a binary search)."""
    cdef uint32_t lo = 0, hi = lg.length, mid
    while lo < hi:
        mid = lo + (hi - lo) // 2
        if log_at(lg, mid) <= cutoff:
            lo = mid + 1
        else:
            hi = mid
    return lg.length - lo


cdef inline double entry_given_back(const Entry* e, const Params* p, double now,
                                    bint* in_debt) noexcept nogil:
    """Units that forgetting the key would hand back at ``now`` (what it has
    spent and not yet recovered), and whether it is in debt: it could not
    pass a request of cost 1 now. Choosing the victim by this, not by when
    it would be at rest, is what keeps a flood of fresh keys from buying an
    exhausted key its budget back (matches ``reference._given_back``)."""
    cdef int alg = e.ns & NS_ALGORITHM_MASK
    cdef double elapsed, level, spent, weight
    cdef int64_t index, backlog, count, previous
    if now < e.updated_at:
        now = e.updated_at
    elapsed = now - e.updated_at
    if alg == ALG_TOKEN_BUCKET:
        level = e.state.bucket.level + elapsed * p.rate
        if level > p.capacity_f:
            level = p.capacity_f
        in_debt[0] = level < 1.0
        return p.capacity_f - level
    if alg == ALG_LEAKY_BUCKET:
        level = e.state.bucket.level - elapsed * p.rate
        if level < 0.0:
            level = 0.0
        in_debt[0] = p.capacity_f - level < 1.0
        return level
    if alg == ALG_GCRA:
        backlog = e.state.gcra.tat - nl_floor_i64(now * 1000000.0)
        if backlog < 0:
            backlog = 0
        in_debt[0] = backlog + p.interval_us > p.tolerance_us
        return <double>backlog / <double>p.interval_us
    if alg == ALG_SLIDING_LOG:
        count = log_live(&e.state.log, now - p.window)
        in_debt[0] = count + 1 > p.capacity
        return <double>count
    index = nl_floor_i64(now / p.window)
    if alg == ALG_FIXED_WINDOW:
        count = e.state.window.count if index == e.state.window.index else 0
        in_debt[0] = count + 1 > p.capacity
        return <double>count
    # sliding counter: the estimate after rolling to ``now``'s window
    count = 0
    previous = 0
    if index == e.state.window.index:
        count = e.state.window.count
        previous = e.state.window.previous
    elif index == e.state.window.index + 1:
        previous = e.state.window.count
    weight = 1.0 - (now - <double>index * p.window) / p.window
    spent = <double>previous * weight + <double>count
    in_debt[0] = spent + 1.0 > p.capacity_f
    return spent


cdef inline uint32_t xorshift32(uint32_t x) noexcept nogil:
    x ^= x << 13
    x ^= x >> 17
    x ^= x << 5
    return x


cdef inline uint32_t eviction_candidate(uint32_t i, uint32_t* cursor, uint32_t* random,
                                        uint32_t count) noexcept nogil:
    """The ``i``-th entry an eviction looks at (of ``EVICTION_SCAN +
    EVICTION_SAMPLE``): along the cursor, then at random. One sequence for
    both tables, and for ``peek``, which walks it on copies of the cursor
    and the random state to answer as ``allow`` would."""
    cdef uint32_t position
    if i < <uint32_t>EVICTION_SCAN:
        if cursor[0] >= count:
            cursor[0] = 0
        position = cursor[0]
        cursor[0] += 1
        return position
    random[0] = xorshift32(random[0])
    return random[0] % count


# ---------------------------------------------------------------- the layouts

ctypedef struct TableRoom:          # an in-memory stripe: the process's own heap
    Stripe* s
    const Bounds* b                 # its storage's bounds: the parameters and the compound's keys

ctypedef struct ZoneRoom:           # a zone stripe: in the segment, checked before use
    Zone* z
    ZoneStripe* s
    Entry* entries
    uint32_t si
    uint32_t* keep                  # a position never to pick, followed when its entry moves (NULL: none)
    const ZoneCompound* compound    # the allow_all being decided (NULL: none)

ctypedef fused RoomLayout:
    TableRoom
    ZoneRoom


cdef inline TableRoom table_room(Stripe* s, const Bounds* b) noexcept nogil:
    cdef TableRoom R
    R.s = s
    R.b = b
    return R


cdef inline ZoneRoom zone_room(Zone* z, uint32_t si, uint32_t* keep, const ZoneCompound* compound) noexcept nogil:
    cdef ZoneRoom R
    R.z = z
    R.s = &z.stripes[si]
    R.entries = stripe_entries(z, si)
    R.si = si
    R.keep = keep
    R.compound = compound
    return R


# ---------------------------------------------------------------- the layout's accessors

cdef inline Entry* room_entries(const RoomLayout* R) noexcept nogil:
    if RoomLayout is ZoneRoom:
        return R.entries
    else:
        return R.s.entries


cdef inline bint room_count_ok(const RoomLayout* R) noexcept nogil:
    """Whether the stripe's count is within its array (the zone's may not be)."""
    if RoomLayout is ZoneRoom:
        return R.s.count <= R.z.stripe_entries
    else:
        return True


cdef inline bint room_cap_ok(const RoomLayout* R) noexcept nogil:
    if RoomLayout is ZoneRoom:
        return R.s.cap <= R.z.stripe_entries
    else:
        return True


cdef inline bint room_bounded(const RoomLayout* R) noexcept nogil:
    """Whether the stripe has a cap to keep (a zone's always has)."""
    if RoomLayout is ZoneRoom:
        return True
    else:
        return R.b.stripe_cap != 0


cdef inline bint room_evictable(const RoomLayout* R, const Entry* e) noexcept nogil:
    """Whether the entry may be forgotten here: an in-memory ``apply``
    key's Python object could not be released under the lock (a zone holds
    none)."""
    if RoomLayout is ZoneRoom:
        return True
    else:
        return e.ns != ALG_APPLY


cdef inline bint room_kept(const RoomLayout* R, uint32_t position, const Entry* e) noexcept nogil:
    """Whether the entry is one never to pick: a key of the compound being
    decided (``entry_kept``), or the zone's ``keep`` position."""
    if RoomLayout is ZoneRoom:
        return (R.keep != NULL and position == R.keep[0]) or zone_entry_kept(e, R.compound)
    else:
        return entry_kept(e, R.b.keep)


cdef inline const Entry* room_view(const RoomLayout* R, const Entry* e, Entry* view) noexcept nogil:
    """The entry as the policy reads it: itself in memory; in a zone a copy
    with its log's ring at this process's address (``zone_view``), NULL
    when the log cannot be read."""
    if RoomLayout is ZoneRoom:
        return view if zone_view(R.z, e, view) else NULL
    else:
        return e


cdef inline const Params* room_params(const RoomLayout* R, uint32_t ns) noexcept nogil:
    if RoomLayout is ZoneRoom:
        return zone_params(R.z, ns)
    else:
        return params_for(R.b.chunks, ns)


cdef inline int room_remove(const RoomLayout* R, uint32_t position) noexcept nogil:
    """Forget the entry at ``position`` (the last entry moves into it; the
    zone's ``keep`` follows it). NL_CORRUPT when the zone's stripe cannot
    be read."""
    if RoomLayout is ZoneRoom:
        return zone_forget_keeping(R.z, R.si, position, R.keep)
    else:
        stripe_remove_position(R.s, position)
        return NL_OK


# ---------------------------------------------------------------- the scans

cdef inline int idle_and_at_rest(const RoomLayout* R, const Entry* e, double cutoff, double now) noexcept nogil:
    """Whether the idle sweep may forget ``e``: untouched since ``cutoff``
    and at rest at ``now``. A key idle but still in debt (a spent 5-a-day
    key, idle for ``evict_idle_after``) stays: forgotten, it would be
    handed a fresh budget. 1 or 0, or NL_CORRUPT."""
    cdef Entry view
    if not (e.updated_at < cutoff and room_evictable(R, e)):
        return 0
    e = room_view(R, e, &view)
    if e == NULL:
        return NL_CORRUPT
    return 1 if entry_at_rest(e, room_params(R, e.ns), now) else 0


cdef inline int evict_sweep_idle(const RoomLayout* R, double cutoff, double now) noexcept nogil:
    """A few steps of the incremental idle sweep: O(1) per insert, and over
    many inserts it visits every entry, with no timer thread. A key never
    to pick (``room_kept``), or still in debt, is stepped over. NL_OK, or
    NL_CORRUPT."""
    cdef int step, status, forgettable
    cdef const Entry* e
    if not room_count_ok(R):
        return NL_CORRUPT
    for step in range(SWEEP_STEP):
        if R.s.count == 0:
            return NL_OK
        if R.s.sweep >= R.s.count:
            R.s.sweep = 0
        e = &room_entries(R)[R.s.sweep]
        forgettable = idle_and_at_rest(R, e, cutoff, now)
        if forgettable == NL_CORRUPT:
            return NL_CORRUPT
        if forgettable and not room_kept(R, R.s.sweep, e):
            status = room_remove(R, R.s.sweep)     # the last entry moved here: look again
            if status != NL_OK:
                return status
            R.s.evicted_idle += 1
        else:
            R.s.sweep += 1
    return NL_OK


cdef inline int evict_could_make_room(const RoomLayout* R, double now, bint sweep_idle,
                                      double idle_cutoff) noexcept nogil:
    """Whether a new key's ``allow`` on this full ``deny_new`` stripe would
    find room, changing nothing (``peek``): the idle sweep's steps and then
    ``evict_make_room``'s scan and sample (from a copy of the stripe's
    random state), visited as they would be. Exact when the stripe holds
    ``cap`` keys, which no stripe holds more of. 1 or 0, or NL_CORRUPT."""
    cdef uint32_t i, position, cursor = R.s.sweep, x = R.s.random
    cdef const Entry* e
    cdef Entry view
    cdef int forgettable
    if not room_count_ok(R):
        return NL_CORRUPT
    if R.s.count == 0:
        return 1
    if sweep_idle:
        for i in range(<uint32_t>SWEEP_STEP):
            if cursor >= R.s.count:
                cursor = 0
            forgettable = idle_and_at_rest(R, &room_entries(R)[cursor], idle_cutoff, now)
            if forgettable != 0:
                return forgettable      # 1, or NL_CORRUPT
            cursor += 1
    for i in range(<uint32_t>(EVICTION_SCAN + EVICTION_SAMPLE)):
        position = eviction_candidate(i, &cursor, &x, R.s.count)     # copies: nothing advances
        e = room_view(R, &room_entries(R)[position], &view)
        if e == NULL:
            return NL_CORRUPT
        if room_evictable(R, e) and entry_at_rest(e, room_params(R, e.ns), now):
            return 1
    return 0


cdef inline int evict_make_room(const RoomLayout* R, double now, bint evict_active) noexcept nogil:
    """Free one entry of a full stripe. First an entry at rest (forgetting it
    changes no decision), looked for along the sweep cursor and in a random
    sample; else, when allowed, of those looked at and not in debt, the one
    whose forgetting hands back the fewest units, the least recently used
    among equals. A key in debt (a denied attacker's) is never forgotten to
    make room: when every key looked at is in debt, nothing is freed and the
    new key is refused. Nor is a key never to pick (``room_kept``: the
    compound being decided): those are looked at and passed over, so a
    stripe holding only the compound's own keys frees nothing. O(1) per
    call (a compound's keys: O(its size) more per entry looked at). 1 when
    an entry was freed, 0 when none was, NL_CORRUPT when the stripe cannot
    be read."""
    cdef uint32_t i, position, victim = 0
    cdef double fewest = 0.0, oldest = 0.0, given
    cdef bint have_victim = False, in_debt
    cdef int status
    cdef const Entry* e
    cdef Entry view
    cdef const Params* p
    if not room_count_ok(R):
        return NL_CORRUPT
    if R.s.count == 0:
        return 0                    # only a compound's own new keys want the room
    for i in range(<uint32_t>(EVICTION_SCAN + EVICTION_SAMPLE)):
        position = eviction_candidate(i, &R.s.sweep, &R.s.random, R.s.count)
        e = &room_entries(R)[position]
        if not room_evictable(R, e) or room_kept(R, position, e):
            continue
        e = room_view(R, e, &view)
        if e == NULL:
            return NL_CORRUPT
        p = room_params(R, e.ns)
        if entry_at_rest(e, p, now):
            status = room_remove(R, position)
            if status != NL_OK:
                return status
            if R.s.sweep > position:
                R.s.sweep = position        # the entry moved into it is not looked at yet
            R.s.evicted_at_rest += 1
            return 1
        if p == NULL:
            continue
        given = entry_given_back(e, p, now, &in_debt)
        if in_debt:
            continue
        if (not have_victim or given < fewest
                or (given == fewest and e.updated_at < oldest)):
            victim = position
            fewest = given
            oldest = e.updated_at
            have_victim = True
    if evict_active and have_victim:
        status = room_remove(R, victim)
        if status != NL_OK:
            return status
        R.s.evicted_active += 1
        return 1
    return 0


cdef inline int evict_room_for_new_key(const RoomLayout* R, double now, double idle_after, uint64_t pending,
                                       bint evict_active) noexcept nogil:
    """Run the idle sweep (``idle_after`` > 0), then make room in a full
    stripe. 1 when the new key has room, 0 when it must be refused
    (``deny_new``, or no entry could be freed), NL_CORRUPT when the zone's
    count or cap cannot be. In a compound's first phase the room counts
    the compound's new keys of this stripe already given room and not in
    yet (``pending``), and no key of the compound is forgotten for it:
    committing then writes them all and the stripe stays within its cap
    (docs/spec.md §5)."""
    cdef int status
    if not room_count_ok(R) or not room_cap_ok(R):
        return NL_CORRUPT
    if idle_after > 0.0:
        status = evict_sweep_idle(R, now - idle_after, now)
        if status != NL_OK:
            return status
    if not room_bounded(R):
        return 1
    # a loop, not one eviction: a compound's second new key of the stripe
    # wants room for two, recounted after each forget
    while <uint64_t>R.s.count + pending >= R.s.cap:
        status = evict_make_room(R, now, evict_active)
        if status < 0:
            return status
        if status == 0:
            R.s.denied_new += 1
            return 0
    return 1

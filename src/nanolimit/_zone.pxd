# cython: language_level=3, cdivision=True
# The shared-memory zone's layout and its table operations (docs/shared_memory.md).
#
# One segment, no pointers in it (every process maps it at its own address):
#
#   ZoneHeader | ZoneNamespace[ZONE_NAMESPACES] | ZoneStripe[stripes]
#   | Entry[stripes * stripe_entries] | uint32 index[stripes * index_slots]
#   | ZoneArena header + blocks (sliding-log rings)
#
# Capacity is fixed at creation, so a stripe's entry array and index never
# move or grow: a batch may read an index slot without the lock (to pick
# what to prefetch) and only ever reads a slot of the same array. An entry
# is the in-memory table's 48-byte Entry; what the in-memory entry keeps
# behind pointers is kept here by value or as an offset:
#
#   - a key of at most 16 bytes is stored inline; a longer one as its
#     SipHash-2-4-128 digest under the zone's secret (key_len says which);
#   - a sliding log's ring is an arena block, its offset from the segment
#     base in the place of the ring pointer (``ZoneLog``).
#
# Every function here runs under the stripe's lock and neither raises nor
# touches a Python object.
#
# Nothing read from the segment is trusted before it is checked: the header
# is checked against the layout at attach (_core_zone.pxi), and here every
# probe is bounded by the index's size, every position an index slot names
# is checked against the stripe's array, a count against the array before
# it bounds a loop, and a ring offset, size, head and length against the
# arena before the ring is read. What fails a check is NL_CORRUPT (or
# ZONE_FIND_CORRUPT from zone_find): the caller repairs the stripe under its
# lock (zone_repair_stripe), releases it, and raises.

from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy, memset

from nanolimit._index cimport (
    INDEX_CORRUPT, NO_SLOT, SLOT_POSITION_MASK, ZoneIndex, home_slot, index_entry_hash, index_find,
    index_remove_slot, index_slot_naming, slot_value, stored_len, zone_keyed_seed,
)
from nanolimit._kernels cimport clock_rebase, init_state, log_ring_size, run_kernel
from nanolimit._table cimport NS_ALGORITHM_MASK
from nanolimit._types cimport (
    ALG_SLIDING_LOG, INLINE_KEY_BYTES, NL_CORRUPT, NL_NOMEM, NL_OK, Entry, Params, Verdict, ZoneLog, nl_hash, nl_key_equal,
    nl_mum, nl_prefetch, nl_load_u32_relaxed,
)


cdef extern from "_zone.h" nogil:
    bint nlz_supported()
    int NLZ_EFOREIGN
    int nlz_open(const char* name, int create, uint64_t size, uint64_t token, void** base, uint64_t* mapped,
                 uint64_t* ident)
    uint64_t nlz_pid_namespace()
    int nlz_unmap(void* base, uint64_t size)
    int nlz_unlink(const char* name)
    int nlz_unlink_if(const char* name, uint64_t ident)
    double nlz_monotonic()
    uint64_t nlz_self_token()
    void nlz_refresh_identity()
    bint nlz_token_alive(uint64_t token)
    uint32_t nlz_pid()
    bint nlz_trylock(uint64_t* lock)
    int nlz_lock(uint64_t* lock)
    int nlz_lock_slow(uint64_t* lock)
    int nlz_lock_timed(uint64_t* lock, double seconds)
    void nlz_unlock(uint64_t* lock)
    uint64_t nlz_lock_owner(const uint64_t* lock)
    void nlz_store_u32_release(uint32_t* p, uint32_t v)
    void nlz_store_u64_release(uint64_t* p, uint64_t v)
    uint64_t nlz_load_u64_acquire(const uint64_t* p)
    void nlz_compiler_barrier()
    void nlz_siphash128(uint64_t k0, uint64_t k1, const char* data, size_t len, char* out)


cdef enum:
    ZONE_LAYOUT_VERSION = 2         # 2: a stripe's array holds its cap, no compound slack
    ZONE_HEADER_BYTES = 4096
    ZONE_NAMESPACES = 1024          # (algorithm, rule) pairs a zone can hold
    ZONE_RULE_BYTES = 184           # a rule name's UTF-8 bytes, at most
    ZONE_NAME_BYTES = 200           # the zone's own name
    ZONE_PROCESSES = 128            # attached processes remembered (stale detection)
    ARENA_CLASSES = 48              # block sizes 2**6 .. 2**47 bytes
    ARENA_MIN_CLASS = 6
    ARENA_HEADER_BYTES = 512
    ZONE_COMPOUND_MAX = 16          # limits in one allow_all
    ON_FULL_EVICT = 0
    ON_FULL_DENY_NEW = 1
    ZONE_FIND_CORRUPT = INDEX_CORRUPT   # zone_find: the probe met what cannot be (garbage slots)


ctypedef struct ZoneHeader:
    uint64_t magic                  # published last, with a release store
    uint32_t layout_version
    uint32_t header_bytes
    uint64_t creator_token          # written first: a creator that died mid-setup is told apart
    double created_at
    uint64_t total_bytes
    uint64_t max_keys
    uint32_t stripes
    uint32_t stripe_entries         # entries per stripe array (the largest stripe cap)
    uint32_t index_slots            # index slots per stripe (a power of two)
    uint32_t max_key_bytes
    uint32_t on_full
    uint32_t namespace_count
    double idle_after               # evict_idle_after; 0: off
    uint64_t arena_bytes
    uint64_t k0                     # the zone's hash secrets (every process hashes alike)
    uint64_t s1
    uint64_t s2
    uint64_t sip0                   # SipHash key for long keys
    uint64_t sip1
    uint64_t namespaces_offset
    uint64_t stripes_offset
    uint64_t entries_offset
    uint64_t index_offset
    uint64_t arena_offset
    uint64_t registry_lock          # namespaces and processes
    uint64_t lock_recoveries        # locks taken over from dead owners (all kinds)
    uint32_t name_len
    uint32_t unrecorded             # attached processes the full registry could not record
    char name[200]
    uint64_t processes[128]         # tokens of attached processes; 0: free
    uint64_t pid_namespace          # the creator's PID namespace (Linux); 0: none to compare


ctypedef struct ZoneNamespace:      # 256 bytes
    uint32_t used                   # published last
    uint32_t algorithm
    uint32_t name_len
    uint32_t _pad
    Params p                        # the latest parameters of the rule (for "at rest")
    char name[184]


ctypedef struct ZoneStripe:         # 128 bytes, two cache lines: stripes never share one
    # the first line is all a decision on a present key writes: processes
    # deciding distinct keys of one stripe pass one line between them, not two
    uint64_t lock                   # 0, or the owner's token (_zone.h)
    uint32_t undo_valid             # 1 while ``undo`` holds the entry being decided
    uint32_t undo_position
    Entry undo                      # the entry as it was before the decision in flight
    # the second: what inserts, evictions and repairs write
    uint32_t count                  # live entries, dense in entries[0:count]
    uint32_t cap                    # most entries this stripe may hold
    uint32_t sweep                  # idle-sweep and eviction cursor
    uint32_t random                 # xorshift state for eviction sampling
    uint64_t evicted_at_rest
    uint64_t evicted_active
    uint64_t evicted_idle
    uint64_t denied_new
    uint64_t denied_arena           # refused: no arena block for a sliding log's ring
    uint64_t recoveries             # taken over from a dead owner and repaired


ctypedef struct ZoneArena:          # ARENA_HEADER_BYTES, then the blocks
    uint64_t lock
    uint64_t top                    # next unused byte, an offset from the segment base
    uint64_t end                    # one past the arena's last byte (offset)
    uint64_t used                   # bytes in live blocks
    uint64_t failures               # allocations refused
    uint64_t free_heads[48]         # per class: offset of the first free block, 0: none


ctypedef struct ZoneCompound:       # the allow_all being decided: a call's own, never the zone's
    Py_ssize_t n                    # (threads of a process share the Zone)
    const uint32_t* namespaces
    const char** data               # the keys as stored (a long key's digest)
    const Py_ssize_t* sizes
    uint32_t pending                # phase 1: new keys of this stripe given room, not in yet
    bint reserved                   # phase 1, out: room was made for this (new) key


ctypedef struct Zone:               # one process's view: addresses of the parts
    char* base
    ZoneHeader* header
    ZoneNamespace* namespaces
    ZoneStripe* stripes
    Entry* entries
    uint32_t* index
    ZoneArena* arena
    uint32_t stripe_mask
    uint32_t stripe_entries
    uint32_t index_mask
    uint32_t max_key_bytes
    uint64_t k0
    uint64_t s1
    uint64_t s2
    uint64_t sip0
    uint64_t sip1
    bint evict_active
    double idle_after
    uint64_t arena_lo               # the arena's first block and its end (offsets): the bounds
    uint64_t arena_hi               # every ring and free block is checked against, kept here, not read
    uint64_t max_keys               # from the segment (where a bad byte could move them)


# ---------------------------------------------------------------- keys and hashes

cdef inline uint64_t zone_seed(const Zone* z, uint32_t ns) noexcept nogil:
    return zone_keyed_seed(z.k0, z.s1, ns)


cdef inline const char* zone_key(const Zone* z, const char* key, uint32_t klen, char* digest) noexcept nogil:
    """The bytes stored for a key: itself up to 16 bytes, else its digest."""
    if klen <= INLINE_KEY_BYTES:
        return key
    nlz_siphash128(z.sip0, z.sip1, key, klen, digest)
    return digest


cdef inline uint64_t zone_hash(const Zone* z, uint64_t seed, const char* stored, uint32_t klen) noexcept nogil:
    return nl_hash(seed, z.s1, z.s2, stored, stored_len(klen))


cdef inline uint64_t zone_entry_hash(const Zone* z, const Entry* e) noexcept nogil:
    cdef ZoneIndex L
    L.k0, L.s1, L.s2 = z.k0, z.s1, z.s2
    return index_entry_hash(&L, e)


cdef inline uint32_t zone_stripe_of(const Zone* z, uint64_t h) noexcept nogil:
    return <uint32_t>((h >> 40) & z.stripe_mask)


cdef inline Entry* stripe_entries(const Zone* z, uint32_t si) noexcept nogil:
    return z.entries + <size_t>si * z.stripe_entries


cdef inline uint32_t* stripe_index(const Zone* z, uint32_t si) noexcept nogil:
    return z.index + <size_t>si * (<size_t>z.index_mask + 1)


cdef inline ZoneIndex zone_index(const Zone* z, uint32_t si) noexcept nogil:
    """Stripe ``si``'s index as _index.pxd's loops read it: bounded by the
    index's size, its positions checked against the stripe's array."""
    cdef ZoneIndex L
    L.slots = stripe_index(z, si)
    L.entries = stripe_entries(z, si)
    L.mask = z.index_mask
    L.bound = z.stripe_entries
    L.k0, L.s1, L.s2 = z.k0, z.s1, z.s2
    return L


cdef inline const Params* zone_params(const Zone* z, uint32_t ns) noexcept nogil:
    cdef uint32_t ident = ns >> 3
    cdef const ZoneNamespace* record
    if ident == 0 or ident > <uint32_t>ZONE_NAMESPACES:
        return NULL
    record = &z.namespaces[ident - 1]
    if not record.used or record.algorithm != (ns & NS_ALGORITHM_MASK):
        return NULL
    return &record.p


# ---------------------------------------------------------------- probing

cdef inline Py_ssize_t zone_find(const Zone* z, uint32_t si, uint64_t h, uint32_t ns,
                                 const char* stored, uint32_t klen, uint32_t* slot_out) noexcept nogil:
    """Position of the key's entry in its stripe, or -1; ``slot_out`` gets
    the key's index slot, or the empty slot that ended the probe.
    ZONE_FIND_CORRUPT when a slot names a position outside the stripe's
    array or no slot of the index is empty (it is never over 3/4 full):
    a probe visits each slot once at most (``index_find``)."""
    cdef ZoneIndex L = zone_index(z, si)
    return index_find(&L, h, ns, stored, klen, slot_out)


cdef inline void zone_prefetch_slot(const Zone* z, uint64_t h) noexcept nogil:
    nl_prefetch(&stripe_index(z, zone_stripe_of(z, h))[home_slot(h, z.index_mask)])


cdef inline void zone_prefetch_entry(const Zone* z, uint64_t h) noexcept nogil:
    """Start loading the entry the key's home slot names (an unlocked read of
    a slot that never moves; a stale position is only prefetched)."""
    cdef uint32_t si = zone_stripe_of(z, h)
    cdef uint32_t v = nl_load_u32_relaxed(&stripe_index(z, si)[home_slot(h, z.index_mask)])
    cdef uint32_t position
    cdef const Entry* e
    if v == 0:
        return
    position = (v & SLOT_POSITION_MASK) - 1
    if position < z.stripe_entries:
        e = &stripe_entries(z, si)[position]
        nl_prefetch(e)
        nl_prefetch(<const char*>(e + 1) - 1)


cdef inline bint zone_remove_slot(const Zone* z, uint32_t si, uint32_t hole) noexcept nogil:
    """Backward-shift deletion (``index_remove_slot``); False, the index
    part-shifted, when it meets a slot naming no entry of the stripe or no
    empty slot (the caller repairs the stripe)."""
    cdef ZoneIndex L = zone_index(z, si)
    return index_remove_slot(&L, hole)


cdef inline uint32_t zone_slot_naming(const Zone* z, uint32_t si, uint64_t h, uint32_t position) noexcept nogil:
    """The index slot that names ``position`` (its entry's hash ``h``), or
    0xFFFFFFFF (NO_SLOT) when none does within one lap of the index."""
    cdef ZoneIndex L = zone_index(z, si)
    return index_slot_naming(&L, h, position)


# ---------------------------------------------------------------- the arena

cdef inline uint32_t arena_class(uint64_t nbytes) noexcept nogil:
    cdef uint32_t k = ARENA_MIN_CLASS
    while (<uint64_t>1 << k) < nbytes:
        k += 1
    return k


cdef inline uint32_t arena_room(uint32_t k) noexcept nogil:
    """The ring slots of a block of class ``k`` (its size word)."""
    cdef uint64_t room = ((<uint64_t>1 << k) // 8) - 1
    return <uint32_t>room if room <= 0xFFFFFFFFU else 0xFFFFFFFFU


cdef inline bint arena_holds(const Zone* z, uint64_t offset, uint64_t size) noexcept nogil:
    """Whether ``size`` bytes at ``offset`` are a place of the arena a block
    can be (64-aligned, inside its bounds, clear of its header)."""
    return (offset >= z.arena_lo and offset <= z.arena_hi and size <= z.arena_hi - offset
            and (offset & 63) == 0)


cdef inline double* zone_ring(const Zone* z, uint64_t offset) noexcept nogil:
    """The ring of an arena block: the slots after its size word."""
    if offset == 0:
        return NULL
    return <double*>(z.base + offset) + 1


cdef inline uint64_t arena_alloc(Zone* z, uint64_t slots) noexcept nogil:
    """A ring block of at least ``slots`` slots (offset; 0 when the arena is
    out of room). Under the arena lock, taken inside a stripe lock (never the
    other order). A holder killed here loses at most this block: each step
    is one store that leaves the free list whole. A free-list link or a top
    that names no place of the arena is never followed: the list is cut
    there (its blocks leaked), and a bad top allocates nothing."""
    cdef ZoneArena* a = z.arena
    cdef uint32_t k = arena_class((slots + 1) * 8)
    cdef uint64_t offset = 0, size, top, following
    if k >= <uint32_t>ARENA_CLASSES:
        return 0
    size = <uint64_t>1 << k
    if nlz_lock(&a.lock):
        z.header.lock_recoveries += 1
    offset = a.free_heads[k]
    if offset != 0:
        if arena_holds(z, offset, size):
            following = (<uint64_t*>(z.base + offset))[0]
            a.free_heads[k] = following if following == 0 or arena_holds(z, following, size) else 0
        else:
            a.free_heads[k] = 0
            offset = 0
    if offset == 0:
        top = a.top
        if arena_holds(z, top, size):
            offset = top
            a.top = top + size
    if offset != 0:
        a.used += size
    else:
        a.failures += 1
    nlz_unlock(&a.lock)
    if offset != 0:
        (<uint32_t*>(z.base + offset))[0] = arena_room(k)
        (<uint32_t*>(z.base + offset))[1] = k
    return offset


cdef inline void arena_free(Zone* z, uint64_t offset) noexcept nogil:
    cdef ZoneArena* a = z.arena
    cdef uint32_t k
    if offset == 0 or not arena_holds(z, offset, 64):
        return                      # names no block of the arena: never followed
    k = (<uint32_t*>(z.base + offset))[1]
    if k < <uint32_t>ARENA_MIN_CLASS or k >= <uint32_t>ARENA_CLASSES or not arena_holds(z, offset, <uint64_t>1 << k):
        return                      # not a block header: never put it on a list
    if nlz_lock(&a.lock):
        z.header.lock_recoveries += 1
    (<uint64_t*>(z.base + offset))[0] = a.free_heads[k]
    a.free_heads[k] = offset
    a.used -= <uint64_t>1 << k
    nlz_unlock(&a.lock)


cdef inline bint zone_log_valid(const Zone* z, const ZoneLog* lg) noexcept nogil:
    """Whether a sliding log's ring may be read: no ring and no stamps, or a
    block of the arena whose header is a block's (its class and size word
    agree), with the head and the length inside it. Checked before a ring
    is read, every time: a few compares, on the sliding log's path only."""
    cdef uint64_t ring = lg.ring
    cdef uint32_t k, size
    if ring == 0:
        return lg.length == 0
    if not arena_holds(z, ring, 64):
        return False
    k = (<const uint32_t*>(z.base + ring))[1]
    if k < <uint32_t>ARENA_MIN_CLASS or k >= <uint32_t>ARENA_CLASSES or not arena_holds(z, ring, <uint64_t>1 << k):
        return False
    size = (<const uint32_t*>(z.base + ring))[0]
    return size == arena_room(k) and lg.length <= size and lg.head < size


# ---------------------------------------------------------------- views

cdef inline ZoneLog* zone_log(Entry* e) noexcept nogil:
    return &e.state.zone_log


cdef inline bint zone_view(const Zone* z, const Entry* e, Entry* out) noexcept nogil:
    """A copy of the entry the kernels can run on: a sliding log's ring
    offset turned into this process's address of the ring. False when the
    log fails ``zone_log_valid``: the copy is then an empty log, and the
    caller reports the stripe corrupt."""
    out[0] = e[0]
    if (e.ns & NS_ALGORITHM_MASK) == ALG_SLIDING_LOG:
        if not zone_log_valid(z, &e.state.zone_log):
            out.state.log.ring = NULL
            out.state.log.head = 0
            out.state.log.length = 0
            return False
        out.state.log.ring = zone_ring(z, e.state.zone_log.ring)
    return True


cdef inline void zone_store_view(Entry* e, const Entry* view) noexcept nogil:
    """Write back what a kernel changed on a view: the ring stays where it is."""
    cdef uint64_t ring
    if (e.ns & NS_ALGORITHM_MASK) == ALG_SLIDING_LOG:
        ring = zone_log(e).ring
        e.state = view.state
        zone_log(e).ring = ring
    else:
        e.state = view.state
    e.updated_at = view.updated_at


# ---------------------------------------------------------------- entries

cdef inline int zone_delete(Zone* z, uint32_t si, uint32_t slot, uint32_t position) noexcept nogil:
    """Remove an entry: the last entry moves into its place, then the count
    drops, then its ring goes back to the arena. A holder killed part-way
    leaves at worst a duplicate of the moved entry (repair drops it) or a
    leaked ring, never a ring used twice. NL_CORRUPT, the stripe left for
    repair, when the count or the index cannot be."""
    cdef ZoneStripe* s = &z.stripes[si]
    cdef Entry* entries = stripe_entries(z, si)
    cdef uint32_t* index = stripe_index(z, si)
    cdef uint32_t count = s.count
    cdef uint32_t last, i
    cdef uint64_t h, ring = 0
    if count == 0 or count > z.stripe_entries or position >= count:
        return NL_CORRUPT
    last = count - 1
    if (entries[position].ns & NS_ALGORITHM_MASK) == ALG_SLIDING_LOG:
        ring = zone_log(&entries[position]).ring
    if not zone_remove_slot(z, si, slot):
        return NL_CORRUPT
    if position != last:
        entries[position] = entries[last]
        h = zone_entry_hash(z, &entries[position])
        i = zone_slot_naming(z, si, h, last)
        if i == 0xFFFFFFFFU:
            return NL_CORRUPT
        index[i] = slot_value(h, position)
    nlz_compiler_barrier()
    s.count = last
    nlz_compiler_barrier()
    arena_free(z, ring)
    return NL_OK


cdef inline int zone_remove_position(Zone* z, uint32_t si, uint32_t position) noexcept nogil:
    cdef uint32_t slot
    if position >= z.stripes[si].count or position >= z.stripe_entries:
        return NL_CORRUPT
    slot = zone_slot_naming(z, si, zone_entry_hash(z, &stripe_entries(z, si)[position]), position)
    if slot == 0xFFFFFFFFU:
        return NL_CORRUPT
    return zone_delete(z, si, slot, position)


cdef inline Entry* zone_insert(Zone* z, uint32_t si, uint64_t h, uint32_t ns, const char* stored,
                               uint32_t klen, uint32_t slot, const Entry* state) noexcept nogil:
    """Append a key known to be absent (``slot``: where its probe ended),
    with ``state``'s state; NULL when the stripe's array is full. The entry
    is whole before the index names it and before the count takes it in."""
    cdef ZoneStripe* s = &z.stripes[si]
    cdef uint32_t position = s.count
    cdef Entry* e
    if position >= z.stripe_entries:
        return NULL
    e = &stripe_entries(z, si)[position]
    memset(e, 0, sizeof(Entry))
    e.ns = ns
    e.key_len = klen
    memcpy(e.key.short_key, stored, stored_len(klen))
    e.state = state.state
    e.updated_at = state.updated_at
    nlz_compiler_barrier()
    stripe_index(z, si)[slot] = slot_value(h, position)
    nlz_compiler_barrier()
    s.count = position + 1
    return e


cdef inline int zone_forget_keeping(Zone* z, uint32_t si, uint32_t position, uint32_t* keep) noexcept nogil:
    """Remove the entry at ``position``; ``keep`` follows the entry it names
    when that one is the last and moves into the hole."""
    if keep != NULL and keep[0] == z.stripes[si].count - 1:
        keep[0] = position
    return zone_remove_position(z, si, position)


cdef inline bint zone_entry_kept(const Entry* e, const ZoneCompound* compound) noexcept nogil:
    """Whether the entry is a key of the compound being decided (or NULL:
    none): making room for one of its keys never forgets another of them,
    or the commit would write it back and the stripe end over its cap
    (``entry_kept``). Only the entry's first ``stored_len`` bytes are read,
    whatever its key_len says."""
    cdef Py_ssize_t i
    if compound == NULL:
        return False
    for i in range(compound.n):
        if (compound.namespaces[i] == e.ns and <uint32_t>compound.sizes[i] == e.key_len
                and nl_key_equal(e.key.short_key, compound.data[i], stored_len(e.key_len))):
            return True
    return False


cdef inline void zone_undo_begin(ZoneStripe* s, uint32_t position, const Entry* e) noexcept nogil:
    """Keep the entry as it is before changing it: a holder killed while it
    decides is rolled back by whoever takes its lock over."""
    s.undo = e[0]
    s.undo_position = position
    nlz_store_u32_release(&s.undo_valid, 1)
    nlz_compiler_barrier()


cdef inline void zone_undo_end(ZoneStripe* s) noexcept nogil:
    nlz_compiler_barrier()
    nlz_store_u32_release(&s.undo_valid, 0)


# ---------------------------------------------------------------- repair

cdef inline bint zone_entry_valid(const Zone* z, Entry* e) noexcept nogil:
    """Whether an entry can be trusted: its namespace registered, its key
    length possible, its ring (a sliding log's) a block of the arena that
    holds its head and length."""
    if zone_params(z, e.ns) == NULL or e.key_len == 0 or e.key_len > z.max_key_bytes:
        return False
    if (e.ns & NS_ALGORITHM_MASK) != ALG_SLIDING_LOG:
        return True
    return zone_log_valid(z, zone_log(e))


cdef inline uint32_t zone_stripe_cap(const Zone* z, uint32_t si) noexcept nogil:
    """The most entries stripe ``si`` may hold, as the creator set it."""
    cdef uint64_t stripes = <uint64_t>z.stripe_mask + 1
    return <uint32_t>(z.max_keys // stripes + (1 if si < z.max_keys % stripes else 0))


cdef inline void zone_repair_stripe(Zone* z, uint32_t si) noexcept nogil:
    """Make a stripe whole again after its lock was taken over from a dead
    holder, or after a check found it corrupt: roll back the decision in
    flight (its undo copy), drop entries that cannot be trusted and
    duplicates a half-done move left, and rebuild the index from the
    entries. The holder's request was never answered, so rolling it back
    loses nothing that was promised."""
    cdef ZoneStripe* s = &z.stripes[si]
    cdef Entry* entries = stripe_entries(z, si)
    cdef uint32_t* index = stripe_index(z, si)
    cdef uint32_t j, slot
    cdef uint64_t h
    if s.count > z.stripe_entries:
        s.count = z.stripe_entries
    s.cap = zone_stripe_cap(z, si)
    if s.undo_valid and s.undo_position < s.count:
        entries[s.undo_position] = s.undo
    s.undo_valid = 0
    j = 0
    while j < s.count:
        if not zone_entry_valid(z, &entries[j]):
            entries[j] = entries[s.count - 1]
            s.count -= 1
        else:
            j += 1
    memset(index, 0, (<size_t>z.index_mask + 1) * sizeof(uint32_t))
    j = 0
    while j < s.count:
        h = zone_entry_hash(z, &entries[j])
        if zone_find(z, si, h, entries[j].ns, entries[j].key.short_key, entries[j].key_len, &slot) != -1:
            entries[j] = entries[s.count - 1]     # a copy of a kept entry: its ring is the kept one's
            s.count -= 1
        else:
            index[slot] = slot_value(h, j)
            j += 1
    if s.sweep > s.count:
        s.sweep = 0
    s.recoveries += 1

# cython: language_level=3, cdivision=True
# The open-addressing index of a stripe, written once for both tables: the
# in-memory table (_table.pxd) and the shared-memory zone (_zone.pxd). A
# slot holds an 8-bit fingerprint of the key's hash and its entry's
# position + 1; 0 is empty. Linear probing, backward-shift deletion (no
# tombstones).
#
# The two layouts differ in where the slots and entries are, how an entry's
# key is stored and hashed, and in trust: the zone's index is read from a
# segment any process may have left half-written, so there every probe is
# bounded by the index's size (each slot visited once at most) and every
# position a slot names is checked against the stripe's array before it is
# followed. A layout is a small struct of what the loops read
# (``TableIndex``, ``ZoneIndex``), and the loops are fused over it: the
# zone's checks are compiled into the zone's instances only, so the
# in-memory table's probes are the loops they were (its index is private
# to the process and its invariants hold). No function here raises or
# touches a Python object.

from libc.stdint cimport uint32_t, uint64_t

from nanolimit._types cimport INLINE_KEY_BYTES, Entry, nl_hash, nl_hash_seeded, nl_key_equal, nl_mum, nl_namespace_seed


cdef enum:
    SLOT_POSITION_MASK = 0xFFFFFF
    INDEX_CORRUPT = -2              # index_find: the probe met what cannot be (the zone only)
    NO_SLOT = 0xFFFFFFFF            # index_slot_naming: no slot names the position (the zone only)


ctypedef struct TableIndex:         # an in-memory stripe's index: the process's own heap
    uint32_t* slots
    const Entry* entries
    uint32_t mask                   # slots - 1
    uint64_t hash_mask              # all ones, but for the collision test hook

ctypedef struct ZoneIndex:          # a zone stripe's index: in the segment, checked before use
    uint32_t* slots
    const Entry* entries
    uint32_t mask                   # slots - 1
    uint32_t bound                  # entries the stripe's array holds: a position must be below it
    uint64_t k0                     # the zone's hash secrets
    uint64_t s1
    uint64_t s2

ctypedef fused IndexLayout:
    TableIndex
    ZoneIndex


# ---------------------------------------------------------------- slots and keys

cdef inline uint32_t slot_value(uint64_t h, uint32_t position) noexcept nogil:
    return ((<uint32_t>(h >> 32) & 0xFF) << 24) | (position + 1)


cdef inline uint32_t home_slot(uint64_t h, uint32_t mask) noexcept nogil:
    return <uint32_t>h & mask


cdef inline const char* entry_key(const Entry* e) noexcept nogil:
    """An in-memory entry's key: inline up to 16 bytes, else on the heap."""
    if e.key_len <= INLINE_KEY_BYTES:
        return e.key.short_key
    return e.key.long_key


cdef inline uint32_t stored_len(uint32_t klen) noexcept nogil:
    """The bytes a zone entry stores for a key of ``klen`` bytes: the key up
    to 16 bytes, else its 16-byte digest."""
    return klen if klen <= INLINE_KEY_BYTES else INLINE_KEY_BYTES


cdef inline uint64_t zone_keyed_seed(uint64_t k0, uint64_t s1, uint32_t ns) noexcept nogil:
    """A namespace's hash seed under a zone's secrets (``nl_namespace_seed``
    under the process's)."""
    return nl_mum(k0 ^ <uint64_t>ns, s1 ^ 0x9E3779B97F4A7C15ULL)


# ---------------------------------------------------------------- the layout's accessors

cdef inline uint64_t index_entry_hash(const IndexLayout* L, const Entry* e) noexcept nogil:
    """Recompute an entry's hash (it is not stored, to keep entries at 48 bytes)."""
    if IndexLayout is ZoneIndex:
        return nl_hash(zone_keyed_seed(L.k0, L.s1, e.ns), L.s1, L.s2, e.key.short_key, stored_len(e.key_len))
    else:
        return nl_hash_seeded(nl_namespace_seed(e.ns), entry_key(e), e.key_len) & L.hash_mask


cdef inline bint index_entry_is(const IndexLayout* L, const Entry* e, uint32_t ns, const char* key,
                                uint32_t klen) noexcept nogil:
    """Whether the entry holds the key (``key`` as the layout stores it: a
    zone's long key is its digest, of which only 16 bytes are compared)."""
    if IndexLayout is ZoneIndex:
        return e.ns == ns and e.key_len == klen and nl_key_equal(e.key.short_key, key, stored_len(klen))
    else:
        return e.ns == ns and e.key_len == klen and nl_key_equal(entry_key(e), key, klen)


cdef inline bint index_position_ok(const IndexLayout* L, uint32_t position) noexcept nogil:
    """Whether a position a slot names is one of the stripe's array."""
    if IndexLayout is ZoneIndex:
        return position < L.bound
    else:
        return True


# ---------------------------------------------------------------- the loops

cdef inline Py_ssize_t index_find(const IndexLayout* L, uint64_t h, uint32_t ns, const char* key,
                                  uint32_t klen, uint32_t* slot_out) noexcept nogil:
    """Position of the key's entry, or -1; ``slot_out`` gets the key's index
    slot, or the empty slot that ended the probe (where it would go). The
    zone's: INDEX_CORRUPT when a slot names a position outside the stripe's
    array or no slot of the index is empty (it is never over 3/4 full): a
    probe visits each slot once at most."""
    cdef uint32_t mask = L.mask
    cdef uint32_t fingerprint = <uint32_t>(h >> 32) & 0xFF
    cdef uint32_t i = home_slot(h, mask)
    cdef uint32_t v, position
    cdef uint32_t steps = mask
    cdef const Entry* e
    while True:
        v = L.slots[i]
        if v == 0:
            slot_out[0] = i
            return -1
        if (v >> 24) == fingerprint:
            position = (v & SLOT_POSITION_MASK) - 1
            if not index_position_ok(L, position):
                return INDEX_CORRUPT
            e = &L.entries[position]
            if index_entry_is(L, e, ns, key, klen):
                slot_out[0] = i
                return position
        if IndexLayout is ZoneIndex:
            if steps == 0:
                return INDEX_CORRUPT
            steps -= 1
        i = (i + 1) & mask


cdef inline uint32_t index_slot_naming(const IndexLayout* L, uint64_t h, uint32_t position) noexcept nogil:
    """The index slot that names ``position`` (its entry's hash ``h``). The
    in-memory table's always exists; the zone's: NO_SLOT when none does
    within one lap of the index."""
    cdef uint32_t mask = L.mask
    cdef uint32_t i = home_slot(h, mask)
    cdef uint32_t steps
    if IndexLayout is ZoneIndex:
        for steps in range(mask + 1):
            if (L.slots[i] & SLOT_POSITION_MASK) == position + 1:
                return i
            i = (i + 1) & mask
        return NO_SLOT
    else:
        while (L.slots[i] & SLOT_POSITION_MASK) != position + 1:
            i = (i + 1) & mask
        return i


cdef inline bint index_remove_slot(const IndexLayout* L, uint32_t hole) noexcept nogil:
    """Backward-shift deletion: pull later members of the probe run into the
    hole so every remaining key stays reachable from its home slot. The
    zone's: False, the index part-shifted, when it meets a slot naming no
    entry of the stripe or no empty slot within a lap (the caller repairs
    the stripe); the in-memory table's is always True."""
    cdef uint32_t mask = L.mask
    cdef uint32_t j = hole
    cdef uint32_t v, home, position
    cdef uint32_t steps = mask
    while True:
        if IndexLayout is ZoneIndex:
            if steps == 0:
                return False
            steps -= 1
        j = (j + 1) & mask
        v = L.slots[j]
        if v == 0:
            L.slots[hole] = 0
            return True
        position = (v & SLOT_POSITION_MASK) - 1
        if not index_position_ok(L, position):
            return False
        home = home_slot(index_entry_hash(L, &L.entries[position]), mask)
        if (j > hole and (home <= hole or home > j)) or (j < hole and home <= hole and home > j):
            L.slots[hole] = v
            hole = j

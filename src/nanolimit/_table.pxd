# cython: language_level=3, cdivision=True
# One stripe of the striped hash table: a dense array of 48-byte entries plus
# an open-addressing index of uint32 slots (linear probing, backward-shift
# deletion, so there are no tombstones: the loops are _index.pxd's, shared
# with the zone, over this layout's ``TableIndex``). A slot holds an 8-bit
# fingerprint of the hash and the entry's position + 1; 0 is empty. No function here raises
# or touches a Python object, and every one runs under the stripe's lock but
# the prefetch hints and the batch readers' epoch (prefetch_slot,
# prefetch_entry, batch_join, batch_leave), which read without it.

from libc.stdint cimport uint8_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memcmp, memcpy, memset

from nanolimit._index cimport (
    SLOT_POSITION_MASK, TableIndex, entry_key, home_slot, index_entry_hash, index_find, index_remove_slot,
    index_slot_naming, slot_value,
)
from nanolimit._kernels cimport log_free
from nanolimit._types cimport (
    ALG_APPLY, Params, ALG_SLIDING_LOG, INLINE_KEY_BYTES, NL_NOMEM, NL_OK,
    NL_TABLE_FULL, Entry, nl_add_u64_relaxed, nl_fence, nl_fetch_add_u64, nl_hash_seeded,
    nl_key_equal, nl_load_pointer_acquire, nl_load_pointer_relaxed, nl_load_u32_relaxed,
    nl_load_u64_seq, nl_namespace_seed, nl_prefetch, nl_store_pointer_release,
)


# allow_many batches read other stripes' index slots without their locks (to
# pick what to prefetch), so a replaced index cannot be freed while one of
# them may hold it. A batch joins under the current epoch's parity; a block
# replaced while batches run is retired with the epoch of that moment; a
# block retired before epoch e is freed once no batch of parity e - 1 is
# left, and the epoch only moves on from e when that holds. Every batch is
# finite, so blocks are freed even while batches keep overlapping.
ctypedef struct BatchReaders:
    uint64_t epoch
    uint64_t active[2]              # batches in flight, by the parity of the epoch they joined
    uint64_t retired                # blocks retired and not yet freed

ctypedef struct Stripe:
    uint8_t lock
    uint8_t _pad0[7]
    uint32_t* index
    Entry* entries
    uint32_t index_mask             # index size - 1 (index is NULL until first insert)
    uint32_t count                  # live entries, dense in entries[0:count]
    uint32_t capacity               # entries allocated
    uint32_t random                 # xorshift state for eviction sampling
    uint32_t sweep                  # idle-sweep cursor into entries
    uint32_t cap                    # most entries this stripe may hold (bounded tables)
    uint64_t evicted_at_rest        # forgotten with no effect on any decision
    uint64_t evicted_active            # forgotten to make room (on_full="evict")
    uint64_t evicted_idle           # forgotten by the evict_idle_after sweep
    uint64_t denied_new             # new keys refused (on_full="deny_new")
    uint64_t hash_mask              # all ones, but for the collision test hook
    BatchReaders* readers           # the storage's batches that read indexes unlocked
    void* retired                   # replaced index blocks such a batch may still read
    uint8_t _pad2[24]               # 128 bytes: stripes never share a cache line

# An index block: this header, then the slots (``Stripe.index`` points at the
# slots). The mask travels with the block, so a reader without the lock
# never pairs one block with another block's size.
ctypedef struct IndexHeader:
    void* next                      # the stripe's retired list
    uint64_t epoch                  # when it was retired
    uint32_t mask
    uint8_t _pad[12]

ctypedef struct CompoundKeys:       # the keys of the allow_all being decided
    Py_ssize_t n
    const uint32_t* namespaces
    const char** data
    const Py_ssize_t* sizes

ctypedef struct Bounds:             # how a bounded storage limits its stripes
    uint32_t stripe_cap             # nonzero: each stripe holds at most its own ``cap``
    bint evict_active               # on_full="evict" (else "deny_new")
    bint reserve_on_peek            # compound phase 1: make room before committing
    uint32_t pending                # compound phase 1: new keys of the stripe given room, not in yet
    double idle_after               # evict_idle_after seconds; 0: off
    Params** chunks                 # per-namespace parameters (for "at rest")
    const CompoundKeys* keep        # compound phase 1: never forget these (NULL: none)

ctypedef struct ObjectList:         # Python objects to release after unlocking
    void** items
    size_t count
    size_t capacity


cdef enum:
    MAX_STRIPE_ENTRIES = 0xFFFFFE
    MIN_INDEX_SIZE = 16
    NS_ALGORITHM_MASK = 7           # a namespace id carries its algorithm in the low bits


cdef inline TableIndex table_index(const Stripe* s) noexcept nogil:
    """The stripe's index as _index.pxd's loops read it."""
    cdef TableIndex L
    L.slots = s.index
    L.entries = s.entries
    L.mask = s.index_mask
    L.hash_mask = s.hash_mask
    return L


cdef inline uint64_t entry_hash(const Stripe* s, const Entry* e) noexcept nogil:
    """Recompute an entry's hash (it is not stored, to keep entries at 48 bytes)."""
    cdef TableIndex L = table_index(s)
    return index_entry_hash(&L, e)


cdef inline Py_ssize_t stripe_find(const Stripe* s, uint64_t h, uint32_t ns,
                                   const char* key, uint32_t klen,
                                   uint32_t* slot_out) noexcept nogil:
    """Position of the key's entry, or -1. ``slot_out`` gets the key's index
    slot, or the empty slot that ended the probe (where it would go)."""
    cdef TableIndex L
    if s.index == NULL:
        slot_out[0] = 0
        return -1
    L = table_index(s)
    return index_find(&L, h, ns, key, klen, slot_out)


cdef inline void prefetch_slot(const Stripe* s, uint64_t h) noexcept nogil:
    """Start loading the key's home index slot (unlocked read: a hint only)."""
    cdef const uint32_t* index = <const uint32_t*>nl_load_pointer_relaxed(<const void* const*>&s.index)
    if index != NULL:
        nl_prefetch(&index[home_slot(h, nl_load_u32_relaxed(&s.index_mask))])


cdef inline IndexHeader* index_header(const uint32_t* index) noexcept nogil:
    return (<IndexHeader*>index) - 1


cdef inline void prefetch_entry(const Stripe* s, uint64_t h) noexcept nogil:
    """Start loading the entry the key's probe run points at: the first slot
    whose fingerprint matches, both cache lines of it (an entry is 48 bytes,
    so half of them straddle a line). Reads the slots without the lock: only
    a batch that joined ``Stripe.readers`` (``batch_join``) may call it,
    since an index it reads is then retired, not freed, when replaced. The
    block's own mask bounds the reads; a stale entry address is only
    prefetched, which cannot fault."""
    cdef const uint32_t* index = <const uint32_t*>nl_load_pointer_acquire(<const void* const*>&s.index)
    cdef const Entry* entries = <const Entry*>nl_load_pointer_relaxed(<const void* const*>&s.entries)
    cdef uint32_t mask, i, v, probes
    cdef uint32_t fingerprint = <uint32_t>(h >> 32) & 0xFF
    cdef const Entry* e
    if index == NULL or entries == NULL:
        return
    mask = index_header(index).mask
    i = home_slot(h, mask)
    for probes in range(4):
        v = nl_load_u32_relaxed(&index[i])
        if v == 0:
            return
        if (v >> 24) == fingerprint:
            e = &entries[(v & SLOT_POSITION_MASK) - 1]
            nl_prefetch(e)
            nl_prefetch(<const char*>(e + 1) - 1)
            return
        i = (i + 1) & mask


cdef inline uint32_t* index_alloc(uint32_t size) noexcept nogil:
    """A zeroed index block of ``size`` slots (a power of two)."""
    cdef IndexHeader* block = <IndexHeader*>calloc(1, sizeof(IndexHeader) + <size_t>size * sizeof(uint32_t))
    if block == NULL:
        return NULL
    block.mask = size - 1
    return <uint32_t*>(block + 1)


cdef inline uint64_t batch_join(BatchReaders* r) noexcept nogil:
    """Count a batch in before its first unlocked read; returns its epoch.
    The epoch is read again after the count is visible: a batch counted
    under an epoch that has moved on counts itself again under the new one."""
    cdef uint64_t epoch
    while True:
        epoch = nl_load_u64_seq(&r.epoch)
        nl_fetch_add_u64(&r.active[epoch & 1], 1)
        nl_fence()
        if nl_load_u64_seq(&r.epoch) == epoch:
            return epoch
        nl_fetch_add_u64(&r.active[epoch & 1], <uint64_t>-1)


cdef inline void batch_leave(BatchReaders* r, uint64_t epoch) noexcept nogil:
    nl_fetch_add_u64(&r.active[epoch & 1], <uint64_t>-1)


cdef inline void stripe_reclaim(Stripe* s, uint64_t before) noexcept nogil:
    """Free the retired index blocks retired before epoch ``before``. The
    caller holds the lock, and has seen no batch of parity ``before - 1``
    after reading ``before`` as the epoch (or owns the storage outright)."""
    cdef IndexHeader* block = <IndexHeader*>s.retired
    cdef IndexHeader* after
    cdef void** link = &s.retired
    while block != NULL:
        after = <IndexHeader*>block.next
        if block.epoch < before:
            link[0] = after
            free(block)
            if s.readers != NULL:
                nl_add_u64_relaxed(&s.readers.retired, <uint64_t>-1)
        else:
            link = &block.next
        block = after


cdef inline void index_release(Stripe* s, uint32_t* index) noexcept nogil:
    """An index the stripe no longer points at (the caller holds the lock):
    freed now if no batch is in flight, else retired with the current epoch.
    The fence pairs with the one a batch takes after counting itself in:
    either the batch sees the new index, or this sees the batch."""
    cdef IndexHeader* block
    cdef BatchReaders* r = s.readers
    if index == NULL:
        return
    block = index_header(index)
    nl_fence()
    if r == NULL or (nl_load_u64_seq(&r.active[0]) == 0 and nl_load_u64_seq(&r.active[1]) == 0):
        free(block)
        stripe_reclaim(s, <uint64_t>-1)  # no batch in flight: none can hold an older one
        return
    block.epoch = nl_load_u64_seq(&r.epoch)
    block.next = s.retired
    s.retired = block
    nl_add_u64_relaxed(&r.retired, 1)


cdef inline uint32_t index_size_for(uint32_t count) noexcept nogil:
    """The smallest power of two that keeps the load at or below 3/4."""
    cdef uint64_t size = MIN_INDEX_SIZE
    while <uint64_t>count * 4 > size * 3:
        size *= 2
    return <uint32_t>size


cdef inline void index_fill_into(Stripe* s, uint32_t* index) noexcept nogil:
    """Slot every entry into an empty ``index`` of ``s.index_mask + 1`` slots."""
    cdef uint32_t mask = s.index_mask
    cdef uint32_t j, i
    cdef uint64_t h
    for j in range(s.count):
        h = entry_hash(s, &s.entries[j])
        i = home_slot(h, mask)
        while index[i] != 0:
            i = (i + 1) & mask
        index[i] = slot_value(h, j)


cdef inline void index_fill(Stripe* s) noexcept nogil:
    index_fill_into(s, s.index)


cdef inline int stripe_rebuild_index(Stripe* s, uint32_t size) noexcept nogil:
    """Rebuild the index at ``size`` slots. On allocation failure the old index
    is rebuilt in place when it is big enough, so the stripe stays consistent."""
    cdef uint32_t* fresh = index_alloc(size)
    cdef uint32_t* old = s.index
    if fresh == NULL:
        if s.index != NULL and index_size_for(s.count) <= s.index_mask + 1:
            memset(s.index, 0, (<size_t>s.index_mask + 1) * sizeof(uint32_t))
            index_fill(s)
        return NL_NOMEM
    s.index_mask = size - 1
    index_fill_into(s, fresh)
    nl_store_pointer_release(<void**>&s.index, fresh)
    index_release(s, old)
    return NL_OK


cdef inline Entry* stripe_insert(Stripe* s, uint64_t h, uint32_t ns, const char* key,
                                 uint32_t klen, uint32_t slot, int* status) noexcept nogil:
    """Append a new entry for a key known to be absent; ``slot`` is the empty
    slot ``stripe_find`` returned. The caller initialises the state."""
    cdef uint32_t position = s.count
    cdef uint32_t grown
    cdef Entry* entries
    cdef Entry* e
    cdef char* long_key = NULL
    if s.count >= MAX_STRIPE_ENTRIES:
        status[0] = NL_TABLE_FULL
        return NULL
    if s.index == NULL or (<uint64_t>s.count + 1) * 4 > (<uint64_t>s.index_mask + 1) * 3:
        if stripe_rebuild_index(s, index_size_for(s.count + 1)) != NL_OK:
            status[0] = NL_NOMEM
            return NULL
        stripe_find(s, h, ns, key, klen, &slot)
    if s.count == s.capacity:
        grown = 8 if s.capacity < 8 else s.capacity + s.capacity // 2
        if grown > MAX_STRIPE_ENTRIES:
            grown = MAX_STRIPE_ENTRIES
        entries = <Entry*>realloc(s.entries, <size_t>grown * sizeof(Entry))
        if entries == NULL:
            status[0] = NL_NOMEM
            return NULL
        s.entries = entries
        s.capacity = grown
    if klen > INLINE_KEY_BYTES:
        long_key = <char*>malloc(klen)
        if long_key == NULL:
            status[0] = NL_NOMEM
            return NULL
        memcpy(long_key, key, klen)
    e = &s.entries[position]
    memset(e, 0, sizeof(Entry))
    e.ns = ns
    e.key_len = klen
    if long_key != NULL:
        e.key.long_key = long_key
    else:
        memcpy(e.key.short_key, key, klen)
    s.index[slot] = slot_value(h, position)
    s.count += 1
    status[0] = NL_OK
    return e


cdef inline void* entry_release(Entry* e) noexcept nogil:
    """Free what the entry owns in C; hand back its Python object, if any."""
    cdef void* obj = NULL
    if e.key_len > INLINE_KEY_BYTES:
        free(e.key.long_key)
        e.key.long_key = NULL
    if (e.ns & NS_ALGORITHM_MASK) == ALG_SLIDING_LOG:
        log_free(&e.state.log)
    elif e.ns == ALG_APPLY:
        obj = e.state.obj
        e.state.obj = NULL
    return obj


cdef inline void* stripe_delete(Stripe* s, uint32_t slot, uint32_t position) noexcept nogil:
    """Remove the entry at ``position`` (found at index ``slot``); the last
    entry moves into its place. Returns the entry's Python object, if any."""
    cdef void* obj = entry_release(&s.entries[position])
    cdef uint32_t last = s.count - 1
    cdef TableIndex L = table_index(s)
    cdef uint64_t h
    index_remove_slot(&L, slot)
    if position != last:
        s.entries[position] = s.entries[last]
        h = index_entry_hash(&L, &s.entries[position])
        s.index[index_slot_naming(&L, h, last)] = slot_value(h, position)
    s.count = last
    return obj


cdef inline int objects_push(ObjectList* out, void* obj) noexcept nogil:
    cdef size_t grown
    cdef void** items
    if out.count == out.capacity:
        grown = 16 if out.capacity == 0 else out.capacity * 2
        items = <void**>realloc(out.items, grown * sizeof(void*))
        if items == NULL:
            return NL_NOMEM
        out.items = items
        out.capacity = grown
    out.items[out.count] = obj
    out.count += 1
    return NL_OK


cdef inline void stripe_shrink(Stripe* s) noexcept nogil:
    """Give memory back after mass eviction; a failed shrink changes nothing."""
    cdef uint32_t target
    cdef Entry* entries
    if s.capacity > 64 and s.count < s.capacity // 4:
        target = s.count + s.count // 2
        if target < 8:
            target = 8
        entries = <Entry*>realloc(s.entries, <size_t>target * sizeof(Entry))
        if entries != NULL:
            s.entries = entries
            s.capacity = target


cdef inline Py_ssize_t stripe_evict(Stripe* s, double cutoff, const uint8_t* only_namespaces,
                                    ObjectList* out) noexcept nogil:
    """Drop entries last touched before ``cutoff``, and only limiters' entries
    of the namespace ids flagged in ``only_namespaces`` unless it is NULL;
    compacts and reindexes. An ``apply`` key whose mutate is running
    (``ApplyState.busy``) is being touched, so it is never idle."""
    cdef uint32_t i, kept = 0
    cdef Py_ssize_t removed = 0
    cdef Entry* e
    cdef bint drop
    for i in range(s.count):
        e = &s.entries[i]
        if only_namespaces != NULL and (e.ns == ALG_APPLY or not only_namespaces[e.ns >> 3]):
            drop = False
        else:
            drop = e.updated_at < cutoff and not (e.ns == ALG_APPLY and e.state.apply.busy)
        if drop and (e.ns != ALG_APPLY or objects_push(out, e.state.obj) == NL_OK):
            entry_release(e)
            removed += 1
        else:
            if kept != i:
                s.entries[kept] = s.entries[i]
            kept += 1
    if removed:
        s.count = kept
        stripe_shrink(s)
        stripe_rebuild_index(s, index_size_for(s.count))
    return removed


cdef inline void stripe_clear(Stripe* s, ObjectList* out) noexcept nogil:
    """Free everything; Python objects go to ``out`` (or leak if it cannot grow)."""
    cdef uint32_t i
    cdef void* obj
    cdef uint32_t* index = s.index
    for i in range(s.count):
        obj = entry_release(&s.entries[i])
        if obj != NULL:
            objects_push(out, obj)
    free(s.entries)
    s.entries = NULL
    s.index = NULL
    index_release(s, index)
    stripe_reclaim(s, <uint64_t>-1)     # the storage is going: no batch is left
    s.count = 0
    s.capacity = 0
    s.index_mask = 0


# ---------------------------------------------------------------- bounded memory
# (which entry to forget, and when: _evict.pxd, written once for both tables)

cdef enum:
    NAMESPACE_CHUNK = 256           # namespaces per params chunk; 256 chunks at most


cdef inline const Params* params_for(Params** chunks, uint32_t ns) noexcept nogil:
    """The latest parameters registered for a namespace (NULL if none):
    chunks are never moved or freed while the storage lives, so a reader
    under a stripe lock never sees freed memory."""
    cdef uint32_t ident = ns >> 3
    cdef Params* chunk
    if chunks == NULL or ident >= NAMESPACE_CHUNK * NAMESPACE_CHUNK:
        return NULL
    chunk = chunks[ident // NAMESPACE_CHUNK]
    if chunk == NULL or chunk[ident % NAMESPACE_CHUNK].capacity == 0:
        return NULL
    return &chunk[ident % NAMESPACE_CHUNK]


cdef inline uint32_t slot_of(const Stripe* s, uint32_t position) noexcept nogil:
    """The index slot pointing at ``position`` (it always exists)."""
    cdef TableIndex L = table_index(s)
    return index_slot_naming(&L, index_entry_hash(&L, &s.entries[position]), position)


cdef inline void stripe_remove_position(Stripe* s, uint32_t position) noexcept nogil:
    """Drop a built-in limiter's entry (never an ``apply`` one: its Python
    object could not be released here)."""
    stripe_delete(s, slot_of(s, position), position)


cdef inline bint entry_kept(const Entry* e, const CompoundKeys* keep) noexcept nogil:
    """Whether the entry is one of the keys of the compound being decided
    (``keep``, or NULL for none): making room for one of its new keys never
    forgets another of its keys, or the commit would write it back and the
    stripe would end over its cap."""
    cdef Py_ssize_t i
    if keep == NULL:
        return False
    for i in range(keep.n):
        if (keep.namespaces[i] == e.ns and <uint32_t>keep.sizes[i] == e.key_len
                and nl_key_equal(entry_key(e), keep.data[i], e.key_len)):
            return True
    return False

# Included by _core.pyx (one extension module, nanolimit._core): its cimports,
# imports and shared constants are in scope here.
#
# Two-tier leases (TwoTierStorage): the gate and each key's lease record,
# where a native limiter decides a request without leaving C.

# The hot window of one key's lease (TwoTierStorage): enough to decide a
# request in C exactly as the storage's Python path would. 256 bytes, the
# records 64-byte aligned: the first cache line holds all a decision in the
# current window reads and writes (one line per decision), the second what a
# window roll, a refusal for want of lease or the key index reads, the third
# the sync's state of the current window, the fourth of the window before.
ctypedef struct LeaseRecord:
    double last_now                 # the key's own time floor (docs/spec.md §4)
    int64_t window_index            # the window described below; LEASE_NONE: Python decides
    int64_t own                     # this instance's units in it (authoritative while loaded)
    int64_t ceiling                 # own + cost must stay <= ceiling: units pushed + the lease
    int64_t others                  # the other instances' units in it, as last read
    int64_t previous                # fleet units of the window before (sliding), else 0
    int64_t decisions               # committed here since the storage last pulled
    uint8_t prev_pending            # (flags, 0 or 1) a rolled-away window is not yet pulled
    uint8_t committed               # committed to since take_dirty (this key, not the slot's last)
    uint8_t listed                  # its slot is in the book's dirty list
    uint8_t attached                # a key holds the slot
    # A fast record: the sync plans and applies this key in C (plan_step,
    # apply), and the s_ fields, not the storage's dicts, hold window
    # s_index's sync state (LEASE_NONE: absent from the dict); pull hands them over.
    uint8_t fast
    uint8_t past_changed            # a fast record: C changed window prev_index's p_ state since load
    uint8_t _pad[2]
    # -- line 2
    int64_t next_ceiling            # a later window's ceiling before any sync of it: ceil(L / N)
    int64_t prev_index              # a window C rolled away from, its units not yet pulled (or, a
    int64_t prev_own                # fast record's, window s_index - 1 and its units)
    int64_t want                    # the largest cost refused for want of lease, not budget
    uint32_t gen                    # bumped by attach and detach: a sync's answer finds its key
    uint32_t key_len                # the key's UTF-8 bytes (key_data: in the key's str, which
    const char* key_data            # the book's ``keys`` list keeps alive)
    uint64_t key_hash               # LeaseBook.hash of them: where the key index holds the slot
    double touched                  # monotonic time of the last decision folded by plan_step
    # -- line 3
    int64_t s_index
    int64_t s_pushed
    int64_t s_acked
    int64_t s_seen_total
    int64_t s_seen_own
    int64_t s_lease
    int64_t s_claimed               # the default share claimed in window s_index + 1
    int64_t s_want                  # the largest cost refused for want of lease, to ask for
    # -- line 4: a fast record's window s_index - 1 (prev_index), as the dicts would hold it:
    # sent while its units are unpushed, a sliding key's while its total is read fewer
    # than SETTLE_READS times (past_open)
    int64_t p_pushed
    int64_t p_acked
    int64_t p_seen_total
    int64_t p_seen_own
    int64_t p_lease
    int64_t p_claimed               # the default share claimed in window s_index
    int64_t p_settled               # its total read since it ended (the dicts' settled)
    int64_t _pad4

# The book's key index: open addressing, linear probing, backward-shift
# deletion (no tombstones), at most 3/4 full. An entry names a slot (its
# record) and holds the key's str, so a caller passing the very str that
# was attached (the common case) is matched without reading any key bytes.
ctypedef struct LeaseKey:
    uint32_t tag                    # the key hash's high 32 bits
    uint32_t slot                   # the record's slot + 1; 0: empty
    PyObject* key                   # borrowed: the book's ``keys`` list holds it

cdef Py_ssize_t LEASE_MAX_SLOTS = 0xFFFFFFFE    # slot + 1 fits the index's uint32


cdef int64_t LEASE_NONE = INT64_MIN
cdef Py_ssize_t RECONCILE_KEYS = 128  # keys per reconcile call (two_tier RECONCILE_CHUNK)
cdef int64_t SETTLE_READS = 3         # two_tier SETTLE_READS


cdef inline int64_t or_zero(int64_t v) noexcept nogil:
    return 0 if v == LEASE_NONE else v


cdef inline bint fast_rolls(LeaseRecord* r, int64_t k) noexcept nogil:
    """Whether C may move a fast record into window ``k`` (later than its
    own) and keep syncing it: what the Python plan would still send of the
    windows it leaves behind is at most the one just left, and only when
    ``k`` follows it (then it becomes the window before). Two windows or
    more behind, no estimate reads a window, so once its units are pushed
    nothing of it is sent again (_FleetSync._prune)."""
    if or_zero(r.p_pushed) != r.prev_own:
        return False                # the window before has units to push
    return k == r.window_index + 1 or r.own == or_zero(r.s_pushed)


cdef inline bint past_open(LeaseRecord* r, bint sliding) noexcept nogil:
    """A fast record's window s_index - 1 still goes with every sync (as
    _FleetSync._plan sends it): until our units there are pushed, and a
    sliding key's until its total, the estimate's previous window, has been
    read SETTLE_READS times."""
    if or_zero(r.p_pushed) != r.prev_own:
        return True
    return sliding and r.p_settled < SETTLE_READS

# One (key, window) of a sync planned in C: what is sent, and where the
# answer goes (the slot, while it still holds the same key: gen).
ctypedef struct SyncItem:
    Py_ssize_t slot
    uint32_t gen
    int64_t window_index
    int64_t value                   # our cumulative units in the window
    int64_t ms                      # the hash's expiry
    int64_t want
    int64_t held                    # the ceiling in use
    int64_t claim                   # the next window's default share to claim; 0: none
    double prev                     # a sliding current window: the previous window's weighted units
    double weight                   # ... and that weight
    int64_t before                  # ... where that window is in the same call (1-based; 0: not there)
    bint current                    # the key's current window (a lease is granted), else its previous

# A growable byte buffer, filled without the GIL (len < 0: out of memory).
ctypedef struct SyncBuf:
    char* data
    Py_ssize_t len
    Py_ssize_t cap


cdef bint buf_put(SyncBuf* b, const char* s, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t size
    cdef char* grown
    if b.len < 0:
        return False
    if b.len + n > b.cap:
        size = (b.len + n) * 2 + 4096
        grown = <char*>realloc(b.data, <size_t>size)
        if grown == NULL:
            b.len = -1
            return False
        b.data = grown
        b.cap = size
    memcpy(b.data + b.len, s, <size_t>n)
    b.len += n
    return True


cdef int fmt_i64(char* out, int64_t v) noexcept nogil:
    # decimal, as Python's str(int); snprintf cost ~3x more per key in the plan
    cdef char tmp[24]
    cdef int n = 0, i
    cdef uint64_t u = <uint64_t>v
    if v < 0:
        u = <uint64_t>0 - u
    while True:
        tmp[n] = <char>(48 + <int>(u % 10))
        n += 1
        u //= 10
        if u == 0:
            break
    i = 0
    if v < 0:
        out[0] = 45
        i = 1
    while n > 0:
        n -= 1
        out[i] = tmp[n]
        i += 1
    return i


cdef bint buf_int(SyncBuf* b, int64_t v) noexcept nogil:
    cdef char tmp[24]
    return buf_put(b, tmp, fmt_i64(tmp, v))


cdef bint buf_bulk_head(SyncBuf* b, Py_ssize_t n) noexcept nogil:
    # RESP: the length line of a bulk string
    cdef char tmp[32]
    cdef int m
    tmp[0] = 36
    m = 1 + fmt_i64(tmp + 1, n)
    tmp[m] = 13
    tmp[m + 1] = 10
    return buf_put(b, tmp, m + 2)


cdef bint buf_bulk_int(SyncBuf* b, int64_t v) noexcept nogil:
    cdef char tmp[24]
    cdef int n = fmt_i64(tmp, v)
    return buf_bulk_head(b, n) and buf_put(b, tmp, n) and buf_put(b, "\r\n", 2)


cdef bint buf_f64(SyncBuf* b, double v) noexcept nogil:
    # one of the reconcile spec's fields: an IEEE double, little-endian
    # whatever this host's order (the script reads '<d')
    cdef uint64_t bits
    cdef char tmp[8]
    cdef int i
    memcpy(&bits, &v, 8)
    for i in range(8):
        tmp[i] = <char>((bits >> (8 * i)) & 0xFF)
    return buf_put(b, tmp, 8)


cdef bint buf_key(SyncBuf* b, const char* base, Py_ssize_t base_len, int64_t k) noexcept nogil:
    # RESP bulk string of the window's hash key: base + decimal k
    cdef char tmp[24]
    cdef int n = fmt_i64(tmp, k)
    return (buf_bulk_head(b, base_len + n) and buf_put(b, base, base_len) and buf_put(b, tmp, n)
            and buf_put(b, "\r\n", 2))


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
    cdef LeaseKey* kindex           # key -> slot (see LeaseKey); NULL until the first attach
    cdef size_t kmask               # its entries - 1
    cdef Py_ssize_t kcount          # keys attached
    cdef uint64_t seed              # the key hash's seed (under the per-process secrets)
    cdef LeaseRecord* records       # 64-byte aligned, in records_block
    cdef void* records_block
    cdef Py_ssize_t* dirty          # slots committed to since take_dirty; one entry each
    cdef Py_ssize_t dirty_len
    cdef Py_ssize_t used
    cdef Py_ssize_t allocated
    cdef list free_slots
    cdef list keys                  # slot -> key (None when free)
    cdef list owners                # slot -> what attach was given for it (the storage's track)
    cdef char** bases               # slot -> the Redis key prefix of its window hashes (malloc'd)
    cdef Py_ssize_t* base_lens
    # the sync planned in C (plan_begin, plan_step, take_commands, apply)
    cdef Py_ssize_t* cand           # the slots it covers, then those it leaves to Python
    cdef Py_ssize_t cand_len
    cdef Py_ssize_t cand_pos
    cdef Py_ssize_t py_len
    cdef SyncItem* items
    cdef Py_ssize_t items_len
    cdef Py_ssize_t keys_len        # keys among the items (a sliding key's full sync: two items)
    cdef Py_ssize_t chunk_start     # the first item of the chunk being filled
    cdef Py_ssize_t* chunk_ends     # per command: its items end here ...
    cdef Py_ssize_t* cmd_ends       # ... and its bytes in out
    cdef Py_ssize_t n_chunks
    cdef SyncBuf out
    cdef SyncBuf words
    cdef bint plan_full
    cdef int64_t plan_share
    cdef double plan_wall
    cdef double plan_mono
    cdef double plan_idle
    cdef int64_t plan_spread        # a key with room in its lease waits its turn: 1 of this many syncs
    cdef int64_t plan_turn          # this sync's turn among them
    cdef readonly int64_t deferred  # keys plan_step left for a later sync (their turn had not come)
    cdef bytes plan_head            # RESP: EVALSHA and the sha
    cdef bytes plan_mid             # RESP: the instance id and N
    cdef bytes plan_tail            # RESP: the reserved members
    cdef Py_ssize_t plan_tail_count
    cdef const char* head_p         # into the bytes above, which the book keeps alive
    cdef const char* mid_p
    cdef const char* tail_p
    cdef Py_ssize_t head_n, mid_n, tail_n
    cdef readonly int64_t folded    # decisions plan_step folded (the storage adds them to its count)
    cdef readonly int64_t limit
    cdef readonly double window
    cdef readonly bint sliding
    cdef readonly double sync_interval

    def __cinit__(self, LeaseGate gate not None, limit, window, sliding, sync_interval):
        self.gate = gate
        self.seed = nl_namespace_seed(0x1EA5E)
        self.free_slots = []
        self.keys = []
        self.owners = []
        self.limit = limit
        self.window = window
        self.sliding = bool(sliding)
        self.sync_interval = sync_interval
        if sizeof(LeaseRecord) % 64 != 0:   # the layout above: whole cache lines
            raise SystemError(f"LeaseRecord is {sizeof(LeaseRecord)} bytes, not whole cache lines")
        if not (1 <= self.limit and self.window > 0.0 and self.sync_interval > 0.0):
            raise ValidationError("LeaseBook needs limit >= 1, window > 0 and sync_interval > 0")
        if not MAX_TIME_C / self.window < 4.611686018427388e18:  # 2**62: window indexes fit int64
            raise ValidationError(f"LeaseBook window {self.window!r} is too short for int64 window indexes")

    def __dealloc__(self):
        cdef Py_ssize_t i
        if self.bases != NULL:
            for i in range(self.used):
                free(self.bases[i])
        free(self.bases)
        free(self.base_lens)
        free(self.records_block)
        free(self.kindex)
        free(self.dirty)
        self.plan_free()

    cdef inline void check_closed(self) except *:
        if self.gate.is_open:
            raise RuntimeError("LeaseBook changed while its gate is open")

    cdef inline LeaseRecord* record(self, Py_ssize_t slot) except NULL:
        if not 0 <= slot < self.used:
            raise IndexError(f"lease slot {slot} out of range")
        return &self.records[slot]

    cdef inline uint64_t hash(self, const char* data, Py_ssize_t n) noexcept nogil:
        """The key index's hash of a key's UTF-8: the in-memory table's seeded
        hash (per-process secrets), so keys chosen offline cannot collide on
        purpose."""
        return nl_hash_seeded(self.seed, data, <size_t>n)

    cdef inline Py_ssize_t find(self, object key, const char* data, Py_ssize_t klen,
                                uint64_t h) noexcept nogil:
        """The slot of ``key`` (its UTF-8 ``data``, ``klen`` bytes; ``h``:
        ``hash`` of them), or -1. Reads no Python object but a str's
        bytes: safe under the gate's spinlock."""
        cdef LeaseKey* table = self.kindex
        cdef size_t i
        cdef uint32_t tag = <uint32_t>(h >> 32)
        cdef LeaseRecord* r
        if table == NULL:
            return -1
        i = <size_t>h & self.kmask
        while table[i].slot != 0:
            if table[i].tag == tag:
                r = &self.records[table[i].slot - 1]
                if (table[i].key == <PyObject*>key
                        or (r.key_len == klen and memcmp(r.key_data, data, <size_t>klen) == 0)):
                    return table[i].slot - 1
            i = (i + 1) & self.kmask
        return -1

    cdef inline void prefetch(self, uint64_t h) noexcept nogil:
        """Start loading the key's home index entry (a hint: read unlocked,
        and a stale address is harmless to prefetch)."""
        cdef const LeaseKey* table = <const LeaseKey*>nl_load_pointer_relaxed(<const void* const*>&self.kindex)
        if table != NULL:
            nl_prefetch(&table[<size_t>h & self.kmask])

    cdef int index_grow(self) except -1:
        """Double the key index (or make the first), rehashing every entry."""
        cdef size_t size = (self.kmask + 1) * 2 if self.kindex != NULL else 16
        cdef LeaseKey* table = <LeaseKey*>calloc(size, sizeof(LeaseKey))
        cdef size_t i, j
        if table == NULL:
            raise MemoryError()
        if self.kindex != NULL:
            for i in range(self.kmask + 1):
                if self.kindex[i].slot != 0:
                    j = <size_t>self.records[self.kindex[i].slot - 1].key_hash & (size - 1)
                    while table[j].slot != 0:
                        j = (j + 1) & (size - 1)
                    table[j] = self.kindex[i]
            free(self.kindex)
        self.kindex = table
        self.kmask = size - 1
        return 0

    cdef void index_remove(self, Py_ssize_t slot) noexcept nogil:
        """Take ``slot``'s entry out of the key index (backward-shift deletion:
        every later member of its probe run stays reachable from its home)."""
        cdef LeaseKey* table = self.kindex
        cdef size_t mask = self.kmask
        cdef size_t hole = <size_t>self.records[slot].key_hash & mask
        cdef size_t j, home
        while table[hole].slot != <uint32_t>(slot + 1):
            hole = (hole + 1) & mask
        j = hole
        while True:
            j = (j + 1) & mask
            if table[j].slot == 0:
                break
            home = <size_t>self.records[table[j].slot - 1].key_hash & mask
            # j's entry may fill the hole unless its home lies cyclically in (hole, j]
            if (j > hole and (home <= hole or home > j)) or (j < hole and home <= hole and home > j):
                table[hole] = table[j]
                hole = j
        table[hole].slot = 0
        table[hole].tag = 0
        table[hole].key = NULL

    def attach(self, key, owner=None, bytes base=b""):
        """A slot for ``key`` (empty until ``load``); ``take_dirty`` hands
        ``owner`` back (the storage's own record of the key). ``base``: the
        encoded prefix of the key's window hashes, for the sync planned in C."""
        cdef Py_ssize_t slot, size, klen, found
        cdef const char* data
        cdef uint64_t h
        cdef size_t i
        cdef void* block
        cdef LeaseRecord* grown
        cdef Py_ssize_t* grown_dirty
        cdef char** grown_bases
        cdef Py_ssize_t* grown_lens
        cdef char* copy
        cdef bint listed = False
        cdef uint32_t gen = 0
        self.check_closed()
        if type(key) is not str:  # lookups run under the gate's spinlock: no Python __eq__
            raise TypeError(f"LeaseBook keys are str, not {type(key).__name__}")
        try:
            data = PyUnicode_AsUTF8AndSize(key, &klen)   # cached in the str: valid while it lives
        except UnicodeEncodeError:
            raise ValidationError("LeaseBook keys encode to UTF-8 (no lone surrogate)") from None
        if klen > 0xFFFFFFFF:
            raise ValidationError("LeaseBook keys are under 4 GiB of UTF-8")
        h = self.hash(data, klen)
        found = self.find(key, data, klen, h)
        if found >= 0:
            return found
        if (self.kcount + 1) * 4 > <Py_ssize_t>(self.kmask + 1) * 3 or self.kindex == NULL:
            self.index_grow()
        if self.free_slots:
            slot = self.free_slots.pop()
            gen = self.records[slot].gen
            listed = self.records[slot].listed  # still in the dirty list: stays there once,
            # reported only if the new key is committed to
            self.keys[slot] = key
            self.owners[slot] = owner
        else:
            if self.used == LEASE_MAX_SLOTS:
                raise MemoryError("LeaseBook: 4,294,967,294 keys")
            if self.used == self.allocated:
                size = min(self.allocated * 2 + 16, LEASE_MAX_SLOTS)
                # aligned by hand (realloc keeps no alignment): one record, whole cache lines
                block = malloc(<size_t>size * sizeof(LeaseRecord) + 63)
                if block == NULL:
                    raise MemoryError()
                grown = <LeaseRecord*>((<uintptr_t>block + 63) & ~(<uintptr_t>63))
                if self.used:
                    memcpy(grown, self.records, <size_t>self.used * sizeof(LeaseRecord))
                free(self.records_block)
                self.records_block = block
                self.records = grown
                # the dirty list holds each slot at most once: it never outgrows the records
                grown_dirty = <Py_ssize_t*>realloc(self.dirty, <size_t>size * sizeof(Py_ssize_t))
                if grown_dirty == NULL:
                    raise MemoryError()
                self.dirty = grown_dirty
                grown_bases = <char**>realloc(self.bases, <size_t>size * sizeof(char*))
                if grown_bases == NULL:
                    raise MemoryError()
                self.bases = grown_bases
                grown_lens = <Py_ssize_t*>realloc(self.base_lens, <size_t>size * sizeof(Py_ssize_t))
                if grown_lens == NULL:
                    raise MemoryError()
                self.base_lens = grown_lens
                self.allocated = size
            self.bases[self.used] = NULL
            slot = self.used
            self.used += 1
            self.keys.append(key)
            self.owners.append(owner)
        copy = <char*>malloc(<size_t>len(base) + 1)
        if copy == NULL:
            raise MemoryError()
        memcpy(copy, PyBytes_AS_STRING(base), <size_t>len(base))
        free(self.bases[slot])
        self.bases[slot] = copy
        self.base_lens[slot] = len(base)
        memset(&self.records[slot], 0, sizeof(LeaseRecord))
        self.records[slot].window_index = LEASE_NONE
        self.records[slot].listed = listed
        self.records[slot].attached = True
        self.records[slot].gen = gen + 1
        self.records[slot].key_data = data
        self.records[slot].key_len = <uint32_t>klen
        self.records[slot].key_hash = h
        i = <size_t>h & self.kmask
        while self.kindex[i].slot != 0:
            i = (i + 1) & self.kmask
        self.kindex[i].tag = <uint32_t>(h >> 32)
        self.kindex[i].slot = <uint32_t>(slot + 1)
        self.kindex[i].key = <PyObject*>key
        self.kcount += 1
        return slot

    def detach(self, key):
        cdef Py_ssize_t klen, slot
        cdef const char* data
        self.check_closed()
        if type(key) is not str:
            return
        try:
            data = PyUnicode_AsUTF8AndSize(key, &klen)
        except UnicodeEncodeError:
            return                  # never attached: attach refuses such a key
        slot = self.find(key, data, klen, self.hash(data, klen))
        if slot >= 0:
            self.index_remove(slot)
            self.kcount -= 1
            self.records[slot].window_index = LEASE_NONE
            self.records[slot].attached = False
            self.records[slot].fast = False
            self.records[slot].gen += 1
            self.records[slot].key_data = NULL
            self.records[slot].key_len = 0
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

    def pull(self, Py_ssize_t slot, bint writing=True):
        """``(window_index or None, own units, last_now, committed decisions,
        rolled-away window or None, its own units, largest cost refused for
        want of lease, sync state)``: what C decided since the last pull. The
        decision count and the wanted cost restart from zero. ``sync state``
        is None, or for a fast record ``(window, pushed, acked, seen total,
        seen own, lease, claimed in the next window, wanted cost, touched,
        the window before)`` (LEASE_NONE: absent), the window before being
        None or, when C changed it since ``load`` (rolled into the next
        window, or synced it), ``(window, units, pushed, acked, seen total,
        seen own, lease, claimed in the window after, settled)``; the
        caller's dicts take it over when ``writing`` (the record is no
        longer fast until ``load`` says so)."""
        self.check_closed()
        cdef LeaseRecord* r = self.record(slot)
        cdef int64_t n = r.decisions
        cdef int64_t want = r.want
        cdef bint rolled = r.prev_pending
        sync = None
        if r.fast:
            if r.window_index == r.s_index:   # the wanted cost is C's to keep (as _pull's max)
                if want > r.s_want:
                    r.s_want = want
                want = 0
            past = None
            if r.past_changed:
                past = (r.prev_index, r.prev_own, r.p_pushed, r.p_acked, r.p_seen_total, r.p_seen_own,
                        r.p_lease, r.p_claimed, r.p_settled)
            sync = (r.s_index, r.s_pushed, r.s_acked, r.s_seen_total, r.s_seen_own, r.s_lease,
                    r.s_claimed, r.s_want, r.touched, past)
            if writing:
                r.fast = False
                r.past_changed = False
        r.want = 0
        r.decisions = 0
        r.prev_pending = False
        return (None if r.window_index == LEASE_NONE else r.window_index, r.own, r.last_now, n,
                r.prev_index if rolled else None, r.prev_own if rolled else 0, want, sync)

    def load(self, Py_ssize_t slot, int64_t window_index, int64_t own, int64_t ceiling,
             int64_t others, int64_t previous, double last_now, int64_t next_ceiling, sync=None):
        """``sync``: None, or ``(pushed, acked, seen total, seen own, lease,
        claimed in the next window, wanted cost, touched, the window before)``
        of window ``window_index`` (LEASE_NONE: absent), the window before as
        ``(units, pushed, acked, seen total, seen own, lease, claimed in
        window_index, settled)``: the record is then fast, the sync plans and
        applies both windows in C (and C rolls it into the next one) and
        holds that state until ``pull``."""
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
        if sync is None:
            r.fast = False
            return
        (r.s_pushed, r.s_acked, r.s_seen_total, r.s_seen_own, r.s_lease, r.s_claimed, r.s_want,
         r.touched, past) = sync
        (r.prev_own, r.p_pushed, r.p_acked, r.p_seen_total, r.p_seen_own, r.p_lease, r.p_claimed,
         r.p_settled) = past
        r.prev_index = window_index - 1
        r.past_changed = False
        r.s_index = window_index
        r.fast = True

    def mark_dirty(self, Py_ssize_t slot):
        """The key was committed to in Python: the next plan covers it."""
        self.check_closed()
        cdef LeaseRecord* r = self.record(slot)
        if not r.committed:
            r.committed = True
            if not r.listed:
                r.listed = True
                self.dirty[self.dirty_len] = slot
                self.dirty_len += 1

    # -- the sync planned in C -------------------------------------------------------
    # plan_begin takes the slots a sync covers; plan_step, a few hundred at a
    # time under the gate's spinlock with the GIL released, writes the fast
    # records' reconcile calls (RESP, RECONCILE_CHUNK keys each) and hands the
    # others back for the Python plan; apply writes one call's answers into
    # the records. The storage holds its lock (not the gate) around each step.
    cdef void plan_free(self) noexcept:
        free(self.cand)
        free(self.items)
        free(self.chunk_ends)
        free(self.cmd_ends)
        free(self.out.data)
        free(self.words.data)
        self.cand = NULL
        self.items = NULL
        self.chunk_ends = NULL
        self.cmd_ends = NULL
        memset(&self.out, 0, sizeof(SyncBuf))
        memset(&self.words, 0, sizeof(SyncBuf))
        self.cand_len = self.cand_pos = self.py_len = self.items_len = self.chunk_start = self.n_chunks = 0
        self.keys_len = 0

    def plan_begin(self, bint full, int64_t share, double wall, double mono, double idle_after,
                   bytes head not None, bytes mid not None, bytes tail not None, Py_ssize_t tail_count,
                   int64_t spread=1, int64_t turn=0):
        """Start a sync: every key (``full``) or those committed to since the
        last one. ``share``: our default share; ``wall``, ``mono``: the
        clocks at the sync's start; ``idle_after``: a full sync leaves keys
        idle for longer to Python (which may drop them); ``head``, ``mid``,
        ``tail``: the RESP words around each call's keys and specs.
        ``spread`` (a power of two; 1: none): a key that has room in its
        lease (see ``waits_its_turn``) is sent only in its turn, one sync of
        ``spread``, ``turn`` being this one's; it stays dirty meanwhile."""
        cdef Py_ssize_t i, slot, n = 0
        self.check_closed()
        self.plan_free()
        self.cand = <Py_ssize_t*>malloc(<size_t>(self.used + 1) * sizeof(Py_ssize_t))
        # two items a slot at most (a sliding key's full sync), a call closed
        # a key early at most to keep a key's two windows together
        self.items = <SyncItem*>malloc(<size_t>(2 * self.used + 1) * sizeof(SyncItem))
        self.chunk_ends = <Py_ssize_t*>malloc(
            <size_t>(2 * self.used // (RECONCILE_KEYS - 1) + 2) * sizeof(Py_ssize_t))
        self.cmd_ends = <Py_ssize_t*>malloc(
            <size_t>(2 * self.used // (RECONCILE_KEYS - 1) + 2) * sizeof(Py_ssize_t))
        if self.cand == NULL or self.items == NULL or self.chunk_ends == NULL or self.cmd_ends == NULL:
            self.plan_free()
            raise MemoryError()
        if full:
            for slot in range(self.used):
                if self.records[slot].attached:
                    self.cand[n] = slot
                    n += 1
        for i in range(self.dirty_len):
            slot = self.dirty[i]
            self.records[slot].listed = False
            if not full and self.records[slot].attached and self.records[slot].committed:
                self.cand[n] = slot
                n += 1
            self.records[slot].committed = False
        self.dirty_len = 0
        self.cand_len = n
        self.plan_full = full
        self.plan_share = share
        self.plan_wall = wall
        self.plan_mono = mono
        self.plan_idle = idle_after
        self.plan_spread = spread if spread >= 1 else 1
        self.plan_turn = turn & (self.plan_spread - 1)
        self.deferred = 0
        self.plan_head = head
        self.plan_mid = mid
        self.plan_tail = tail
        self.plan_tail_count = tail_count
        self.head_p, self.head_n = PyBytes_AS_STRING(head), PyBytes_GET_SIZE(head)
        self.mid_p, self.mid_n = PyBytes_AS_STRING(mid), PyBytes_GET_SIZE(mid)
        self.tail_p, self.tail_n = PyBytes_AS_STRING(tail), PyBytes_GET_SIZE(tail)
        self.folded = 0

    @property
    def planning(self):
        """Slots left for plan_step."""
        return self.cand_len - self.cand_pos

    @property
    def pending(self):
        """Slots committed to since the last plan (what a background sync covers)."""
        return self.dirty_len

    cdef inline bint waits_its_turn(self, LeaseRecord* r) noexcept nogil:
        """A key this sync may leave for a later one: it synced in this window
        and was granted a lease there, less than half of which is spent,
        asks for no larger one, has claimed the next window (or admitted
        nothing to claim it for), and this is not its turn. Redis holds its
        count and its whole ceiling meanwhile, so the bound is the same; what
        waits is the fleet's view of its count and a smaller lease's return."""
        if self.plan_spread <= 1 or r.s_acked == LEASE_NONE or r.s_lease == LEASE_NONE:
            return False
        if r.want or r.s_want or (r.own and r.s_claimed != self.plan_share) or not self.plan_share:
            return False
        if 2 * (r.own - r.s_acked) > r.s_lease:
            return False
        return <int64_t>((r.key_hash >> 56) & <uint64_t>(self.plan_spread - 1)) != self.plan_turn

    cdef inline int64_t expiry_ms(self, LeaseRecord* r, int64_t k) noexcept nogil:
        """Window ``k``'s hash expiry, as _FleetSync._plan says (_expiry_ms):
        alive until the window can no longer matter; negative, refreshed on
        every sync, for a window of an injected clock."""
        cdef double x
        cdef int64_t ms
        if fabs(r.last_now - self.plan_wall) < 86400.0:
            x = <double>(k + 2) * self.window - self.plan_wall
            return <int64_t>ceil((x if x > 0.0 else 0.0) * 1000) + 1000
        ms = <int64_t>ceil(2 * self.window * 1000) + 1000
        return -(ms if ms > 3600000 else 3600000)

    def plan_step(self, Py_ssize_t budget):
        """Plan up to ``budget`` more slots; the owners of those left to the
        Python plan (not fast, rolled over, or possibly idle in a full sync).
        A sliding key sends its current window with the previous window's
        weighted units. The window before goes too, first and in the same
        call (as the Python plan sends it): until it is settled (see
        ``past_open``), and in a full sync while it holds units of ours or
        the key is sliding."""
        cdef LeaseGate gate = self.gate
        cdef Py_ssize_t slot, first = self.py_len, n = 0, before
        cdef LeaseRecord* r
        cdef SyncItem* it
        cdef int64_t k, unleased
        cdef double weight
        cdef bint failed = False, pair, settling, resend
        cdef bint full = self.plan_full
        with nogil:
            nl_lock_spin(&gate.lock)
            while self.cand_pos < self.cand_len and n < budget:
                slot = self.cand[self.cand_pos]
                self.cand_pos += 1
                n += 1
                r = &self.records[slot]
                if not r.attached:
                    continue
                if not r.fast or r.prev_pending or r.s_index != r.window_index:
                    self.cand[self.py_len] = slot   # behind cand_pos: a free place
                    self.py_len += 1
                    continue
                if r.decisions:
                    self.folded += r.decisions
                    r.decisions = 0
                    r.touched = self.plan_mono
                if full and self.plan_mono - r.touched > self.plan_idle:
                    self.cand[self.py_len] = slot
                    self.py_len += 1
                    continue
                settling = past_open(r, self.sliding)
                resend = full and (self.sliding or r.prev_own > 0)  # a full sync sends it again
                pair = settling or resend
                # a key sending its window before waits no turn, unless that is only
                # a full sync's re-read of a sliding key's settled one (_FleetSync._plan)
                if not settling and not (resend and not self.sliding) and self.waits_its_turn(r):
                    self.deferred += 1
                    r.committed = True     # its units go with a later sync
                    if not r.listed:
                        r.listed = True
                        self.dirty[self.dirty_len] = slot
                        self.dirty_len += 1
                    continue
                k = r.window_index
                before = 0
                if pair:
                    if self.items_len - self.chunk_start > RECONCILE_KEYS - 2:
                        failed = failed or not self.close_chunk()   # the two windows in one call
                    it = &self.items[self.items_len]
                    self.items_len += 1
                    before = self.items_len - self.chunk_start
                    it.slot = slot
                    it.gen = r.gen
                    it.window_index = k - 1
                    it.value = r.prev_own
                    it.ms = self.expiry_ms(r, k - 1)
                    it.want = it.held = it.claim = it.before = 0
                    it.prev = it.weight = 0.0
                    it.current = False
                it = &self.items[self.items_len]
                self.items_len += 1
                self.keys_len += 1
                it.slot = slot
                it.gen = r.gen
                it.window_index = k
                it.value = r.own
                it.current = True
                it.prev = it.weight = 0.0
                it.before = 0
                if self.sliding:   # _FleetSync._previous_weighted, operation for operation
                    weight = 1.0 - (r.last_now - <double>k * self.window) / self.window
                    weight = 1.0 if weight > 1.0 else (0.0 if weight < 0.0 else weight)
                    it.weight = weight
                    it.prev = <double>r.previous * weight
                    if weight > 0.0:
                        it.before = before
                # the wanted cost as _pull folds it; the answer clears it (_FleetSync._sync)
                it.want = r.s_want if r.s_want > r.want else r.want
                r.s_want = it.want
                r.want = 0
                it.ms = self.expiry_ms(r, k)
                unleased = self.plan_share      # _FleetSync._unleased: no more than our claim there
                if r.p_claimed != LEASE_NONE and r.p_claimed < unleased:
                    unleased = r.p_claimed
                it.held = (0 if r.s_acked == LEASE_NONE else r.s_acked) + (
                    unleased if r.s_lease == LEASE_NONE else r.s_lease)
                it.claim = 0
                if it.value and r.s_claimed != self.plan_share and self.plan_share:
                    it.claim = self.plan_share
                if self.items_len - self.chunk_start >= RECONCILE_KEYS:
                    failed = failed or not self.close_chunk()
            if self.cand_pos == self.cand_len and self.items_len > self.chunk_start:
                failed = failed or not self.close_chunk()
            nl_unlock(&gate.lock)
        if failed:
            raise MemoryError()
        return [self.owners[self.cand[i]] for i in range(first, self.py_len)]

    cdef bint close_chunk(self) noexcept nogil:
        """One reconcile call for items [chunk_start, items_len), in RESP."""
        cdef SyncBuf* out = &self.out
        cdef SyncBuf* w = &self.words
        cdef Py_ssize_t i, size = self.items_len - self.chunk_start, claims = 0
        cdef SyncItem* it
        cdef bint ok
        w.len = 0
        for i in range(self.chunk_start, self.items_len):
            it = &self.items[i]
            if it.claim:
                claims += 1
            # count, limit, previous, expiry, current, wanted; before, weight, held, claim at, claim
            buf_f64(w, <double>it.value)
            buf_f64(w, <double>self.limit)
            buf_f64(w, it.prev)
            buf_f64(w, <double>it.ms)
            buf_f64(w, 1.0 if it.current else 0.0)
            buf_f64(w, <double>it.want)
            buf_f64(w, <double>it.before)
            buf_f64(w, it.weight)
            buf_f64(w, <double>it.held)
            buf_f64(w, <double>(size + claims) if it.claim else 0.0)
            buf_f64(w, <double>it.claim)
        ok = (buf_put(out, "*", 1) and buf_int(out, 6 + size + claims + self.plan_tail_count)
              and buf_put(out, "\r\n", 2)
              and buf_put(out, self.head_p, self.head_n)
              and buf_bulk_int(out, size + claims))
        for i in range(self.chunk_start, self.items_len):
            it = &self.items[i]
            ok = ok and buf_key(out, self.bases[it.slot], self.base_lens[it.slot], it.window_index)
        for i in range(self.chunk_start, self.items_len):
            it = &self.items[i]
            if it.claim:
                ok = ok and buf_key(out, self.bases[it.slot], self.base_lens[it.slot], it.window_index + 1)
        ok = (ok and buf_put(out, self.mid_p, self.mid_n)
              and w.len >= 0 and buf_bulk_head(out, w.len) and buf_put(out, w.data, w.len)
              and buf_put(out, "\r\n", 2)
              and buf_put(out, self.tail_p, self.tail_n))
        self.chunk_ends[self.n_chunks] = self.items_len
        self.cmd_ends[self.n_chunks] = out.len
        self.n_chunks += 1
        self.chunk_start = self.items_len
        return ok

    def take_commands(self):
        """The planned reconcile calls, RESP-encoded, one bytes each."""
        cdef Py_ssize_t i, at = 0
        out = []
        for i in range(self.n_chunks):
            out.append(PyBytes_FromStringAndSize(self.out.data + at, self.cmd_ends[i] - at))
            at = self.cmd_ends[i]
        return out

    @property
    def planned_keys(self):
        """Keys this sync planned in C (a sliding key's full sync sends two windows)."""
        return self.keys_len

    def apply(self, Py_ssize_t chunk, reply, bint rejoined):
        """Write call ``chunk``'s answers (count, lease, claimed per key) into
        the records: ``(units pushed, [answers for records no longer fast])``,
        each of those ``(owner, window, value, total, lease, claimed, claim,
        current)`` for the Python apply. A slot that changed keys meanwhile
        is skipped. A sliding key's previous window (a full sync's) gives its
        fleet total to the estimate."""
        cdef LeaseGate gate = self.gate
        cdef Py_ssize_t i, j, lo, hi, n_left = 0
        cdef SyncItem* it
        cdef LeaseRecord* r
        cdef int64_t pushed = 0, total, lease, acked
        cdef bint claimed
        cdef int64_t* answers
        cdef Py_ssize_t* left
        if not 0 <= chunk < self.n_chunks:
            raise IndexError(f"no planned call {chunk}")
        lo = 0 if chunk == 0 else self.chunk_ends[chunk - 1]
        hi = self.chunk_ends[chunk]
        if len(reply) != 3 * (hi - lo):
            raise ValueError(f"reconcile answered {len(reply)} words for {hi - lo} keys")
        answers = <int64_t*>malloc(<size_t>(3 * (hi - lo) + 1) * sizeof(int64_t))
        left = <Py_ssize_t*>malloc(<size_t>(hi - lo + 1) * sizeof(Py_ssize_t))
        if answers == NULL or left == NULL:
            free(answers)
            free(left)
            raise MemoryError()
        try:
            for j in range(3 * (hi - lo)):
                answers[j] = int(reply[j])
            with nogil:
                nl_lock_spin(&gate.lock)
                for i in range(lo, hi):
                    it = &self.items[i]
                    r = &self.records[it.slot]
                    if not r.attached or r.gen != it.gen:
                        continue            # forgotten or evicted during the round trip
                    j = 3 * (i - lo)
                    total = answers[j]
                    if r.fast and r.prev_index == it.window_index and r.s_index == it.window_index + 1:
                        # _settle of the window before: a past window read again, or
                        # the current one C rolled away from during the round trip
                        acked = or_zero(r.p_acked)
                        if it.value > acked:
                            pushed += it.value - acked
                        r.p_pushed = r.p_acked = r.p_seen_own = it.value
                        r.p_seen_total = total
                        if it.current:
                            r.p_lease = 0 if rejoined else answers[j + 1]
                            if it.claim and answers[j + 2] != 0:
                                r.p_claimed = it.claim
                        else:
                            r.p_settled += 1
                        r.past_changed = True
                        if self.sliding:    # _fleet(k - 1): the others as read, plus ours now
                            r.previous = total - it.value + r.prev_own
                        continue
                    if not r.fast or r.s_index != it.window_index or not it.current:
                        left[n_left] = i    # the Python side took the key over
                        n_left += 1
                        continue
                    lease = answers[j + 1]
                    claimed = answers[j + 2] != 0
                    acked = 0 if r.s_acked == LEASE_NONE else r.s_acked
                    if it.value > acked:
                        pushed += it.value - acked
                    r.s_pushed = it.value
                    r.s_acked = it.value
                    r.s_seen_total = total
                    r.s_seen_own = it.value
                    r.s_lease = 0 if rejoined else lease
                    if it.claim and claimed:
                        r.s_claimed = it.claim
                        if r.next_ceiling > it.claim:   # _load: the claim bounds the next window
                            r.next_ceiling = it.claim
                    r.s_want = 0                # asked for with this sync
                    if r.window_index == it.window_index and not r.prev_pending:
                        r.ceiling = r.s_pushed + r.s_lease   # _load: pushed + the lease
                        r.others = r.s_seen_total - r.s_seen_own
                        r.s_want = r.want       # refused during the round trip: asked next time
                        r.want = 0
                nl_unlock(&gate.lock)
            rest = []
            for j in range(n_left):
                it = &self.items[left[j]]
                i = 3 * (left[j] - lo)
                rest.append((self.owners[it.slot], it.window_index, it.value, answers[i], answers[i + 1],
                             answers[i + 2], it.claim, it.current))
        finally:
            free(answers)
            free(left)
        return pushed, rest

    def __len__(self):
        return self.kcount


cdef inline int lease_decide(LeaseBook book, object key, const char* data, Py_ssize_t klen, uint64_t h,
                            int64_t cost, double now, bint commit, Verdict* v) except -1:
    """``LeaseBook``'s decision: 1 when decided here (``v`` filled), 0 when
    the Python path must. A function, not a method: its one caller
    (``_Limiter.decide_leased``) gets it inlined, no call in between.
    ``data``, ``klen``: the key's UTF-8; ``h``: ``book.hash`` of it.
    Mirrors ``TwoTierStorage._decide`` operation for operation."""
    cdef LeaseGate gate = book.gate
    cdef Py_ssize_t found
    cdef LeaseRecord* r
    cdef int64_t k, current, previous, own, ceiling, others
    cdef double start, weight, estimate, reset_after, retry_after, end, room
    cdef bint fits, ok, rolls = False, wake = False
    nl_lock_spin(&gate.lock)
    if not gate.is_open:
        nl_unlock(&gate.lock)
        return 0
    found = book.find(key, data, klen, h)
    if found < 0:
        nl_unlock(&gate.lock)
        return 0
    r = &book.records[found]
    if r.last_now > now:
        now = r.last_now
    k = nl_floor_i64(now / book.window)
    if k == r.window_index:
        own = r.own
        ceiling = r.ceiling
        others = r.others
        previous = r.previous
    elif k > r.window_index != LEASE_NONE and not r.prev_pending and (not r.fast or fast_rolls(r, k)):
        # a later window, not yet synced: nobody's units seen, the default
        # share; the window just left is the sliding estimate's previous. A
        # fast record moves into it whole (fast_rolls), else the Python path
        # decides
        rolls = True
        own = 0
        ceiling = r.next_ceiling
        others = 0
        previous = r.others + r.own if (book.sliding and k == r.window_index + 1) else 0
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
                book.dirty[book.dirty_len] = r - book.records
                book.dirty_len += 1
        if rolls:  # keep the left window's units for the sync until pulled
            r.prev_index = r.window_index
            r.prev_own = r.own
            r.want = 0              # a cost refused in the window left asks nothing of this one
            if r.fast and k == r.window_index + 1:   # the window left becomes the one before
                r.p_pushed, r.p_acked, r.p_seen_total = r.s_pushed, r.s_acked, r.s_seen_total
                r.p_seen_own, r.p_lease, r.p_claimed = r.s_seen_own, r.s_lease, r.s_claimed
                r.p_settled = 0
            elif r.fast:            # windows skipped: the one before, k - 1, saw none of our units
                r.prev_index = k - 1
                r.prev_own = 0
                r.p_pushed = r.p_acked = r.p_seen_total = r.p_seen_own = LEASE_NONE
                r.p_lease = r.p_claimed = LEASE_NONE
                r.p_settled = 0
            if r.fast:
                r.past_changed = True
                r.s_index = k
                r.s_pushed = r.s_acked = r.s_seen_total = r.s_seen_own = LEASE_NONE
                r.s_lease = r.s_claimed = LEASE_NONE
                r.s_want = 0
            else:
                r.prev_pending = True
            r.window_index = k
            r.own = 0
            r.ceiling = ceiling
            r.others = 0
            r.previous = previous
    start = <double>k * book.window
    current = others + own
    weight = 1.0 - (now - start) / book.window
    estimate = <double>previous * weight + <double>current
    fits = estimate + <double>cost <= <double>book.limit
    ok = fits and own <= ceiling - cost
    if fits and not ok:
        if commit and cost > r.want:
            r.want = cost           # the next sync asks a lease this big (a cost above ceil(L/N))
        gate.early += 1
        if not gate.wake_pending:
            gate.wake_pending = True
            wake = True
    end = start + book.window - now
    reset_after = end if (current > 0 or previous > 0) else 0.0
    if current > 0 and book.sliding:
        reset_after = start + 2 * book.window - now
    v.storage_full = False
    v.delay = 0.0
    v.at = now                      # the key's time, as TwoTierStorage._judge says it
    v.allowed = ok
    if ok:
        if commit:
            r.own += cost
        v.remaining = <double>book.limit - estimate - <double>cost
        v.retry_after = 0.0
        v.reset_after = end if end > reset_after else reset_after
    else:
        retry_after = end
        if fits:
            if book.sync_interval < retry_after:
                retry_after = book.sync_interval
        elif book.sliding and previous > 0:
            room = <double>(book.limit - current - cost)
            if room >= 0:
                retry_after = start + book.window * (1 - room / <double>previous) - now
        v.remaining = <double>book.limit - estimate
        v.retry_after = retry_after if retry_after > 0.0 else 0.0
        v.reset_after = reset_after
    nl_unlock(&gate.lock)
    if wake:
        gate.wake()
    return 1

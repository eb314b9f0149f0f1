# Included by _core.pyx (one extension module, nanolimit._core): its cimports,
# imports and shared constants are in scope here.
#
# SharedMemoryStorage: the striped table in a named shared-memory segment,
# one budget for every process of a host (docs/shared_memory.md). The
# layout and its index are in ``_zone.pxd``, the nogil table operations in
# ``_core_zone_table.pxi``.

cdef uint64_t ZONE_MAGIC = 0x314E4F5A4C4E414EULL        # "NANLZON1"
cdef uint64_t ZONE_RETIRED = 0x444552495445524EULL      # unlinked or reset: attach again
cdef Py_ssize_t ZONE_MAX_KEYS = 1 << 30
cdef double ZONE_ATTACH_SECONDS = 5.0     # for a creator that died before it wrote its token
cdef double ZONE_SETUP_SECONDS = 120.0    # for a live creator to reserve and set up the segment
cdef double ZONE_LOCK_SECONDS = 5.0       # for a live holder of a zone's registry lock (lifecycle only)
cdef double ZONE_RETIRED_GRACE = 0.1      # for a retired zone's unlinker to remove its name itself
cdef dict ZONE_ALGORITHMS = {number: algorithm for algorithm, number in ALGORITHM_IDS.items()}
cdef str ZONE_NAME_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-"

nlz_refresh_identity()
_ZONES = weakref.WeakSet()      # this process's zones, registered again in a forked child
_UNRECORDED = set()             # (pid, segment ident): counted in a full registry's ``unrecorded``


def _zone_after_fork():
    """In a forked child (gunicorn --preload, multiprocessing's fork): a new
    identity for the locks, and the inherited zones registered under it.
    Each zone's namespace lock is made anew: a parent thread that held it at
    the fork does not exist here, so the inherited one would never be let go."""
    nlz_refresh_identity()
    for zone in list(_ZONES):
        (<SharedMemoryStorage>zone)._namespace_lock = threading.Lock()
        (<SharedMemoryStorage>zone).register_process()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_zone_after_fork)


def _zone_segment_name(name):
    """The POSIX name of a zone: short enough for macOS (31 characters)."""
    import hashlib
    return "/nlz-" + hashlib.blake2b(name.encode(), digest_size=10).hexdigest()


def _check_zone_name(name):
    if not isinstance(name, str):
        raise ValidationError(f"a shared-memory zone's name must be a str, got {type(name).__name__}")
    if not 1 <= len(name) <= ZONE_NAME_BYTES or any(c not in ZONE_NAME_CHARS for c in name):
        raise ValidationError(
            f"a shared-memory zone's name is 1 to {ZONE_NAME_BYTES} characters of A-Z a-z 0-9 _ . -, "
            f"got {name!r}")
    return name


def _zone_error(err, segment, size):
    """An OS error of a segment, said in terms an operator can act on."""
    if err == NLZ_EFOREIGN:
        try:
            st = os.stat(f"/dev/shm{segment}")
            found = f"owned by uid {st.st_uid} with mode {st.st_mode & 0o777:04o}"
        except OSError:
            found = "owned by another user or open to others"
        return ValidationError(
            f"shared-memory zone {segment} is {found}; this process (uid {os.geteuid()}) attaches only "
            "to a segment of its own user with mode 0600, since any other could read or set its budgets: "
            "remove the name (as its owner or root) and run again, or choose another name")
    if err == errno_module.ENOSPC or err == errno_module.ENOMEM:
        try:
            st = os.statvfs("/dev/shm")
            room = f"/dev/shm has {st.f_bavail * st.f_frsize:,} bytes free of {st.f_blocks * st.f_frsize:,}"
        except OSError:
            room = "/dev/shm could not be read"
        return ValidationError(
            f"no room for a shared-memory zone of {size:,} bytes ({segment}): {room}; lower max_keys or "
            "arena_bytes, or give the container a larger /dev/shm (docker run --shm-size)")
    return OSError(err, f"shared-memory zone {segment}: {os.strerror(err)}")


def _attach_zone(name, options):
    """Unpickling a zone (a spawned worker given it): attach by name."""
    return SharedMemoryStorage(name, **options)


@cython.final
cdef class SharedMemoryStorage:
    """Per-key state in a named shared-memory segment that every process of
    the host maps: ``gunicorn -w N`` and ``uvicorn --workers N`` enforce one
    budget instead of N. The first process creates the segment and the
    others attach by name, with the same parameters. Capacity (``max_keys``)
    is fixed at creation; a full stripe follows ``on_full`` as
    ``InMemoryStorage`` does. Decisions take one cross-process stripe lock,
    which a waiter takes over from a holder that died, rolling back the
    decision it had in flight. See docs/shared_memory.md for the lifecycle.
    """

    cdef Zone z
    cdef uint64_t mapped_bytes
    cdef uint64_t ident                    # the segment's identity (nlz_open): its name is unlinked only
                                           # while it names this segment (nlz_unlink_if)
    cdef bint is_closed
    cdef bint is_created
    cdef readonly str name
    cdef readonly str segment_name
    cdef readonly Py_ssize_t max_key_bytes
    cdef readonly object max_keys
    cdef readonly str on_full
    cdef readonly object evict_idle_after
    cdef readonly object arena_bytes
    cdef dict _options
    cdef dict _namespace_ids               # (algorithm value, rule) -> ns, this process's cache
    cdef object _namespace_lock
    cdef object __weakref__

    def __cinit__(self, name, *, max_keys, stripes=64, on_full="evict", evict_idle_after=None,
                  max_key_bytes=MAX_KEY_BYTES, arena_bytes=None, if_stale="reuse", _attach_only=False):
        self.name = _check_zone_name(name)
        if isinstance(max_keys, bool) or not isinstance(max_keys, int) or not 1 <= max_keys <= ZONE_MAX_KEYS:
            raise ValidationError(
                f"max_keys of a shared-memory zone must be an int in [1, {ZONE_MAX_KEYS:,}] (its capacity "
                f"is fixed at creation), got {max_keys!r}")
        stripes, self.max_key_bytes, max_keys, on_full, evict_idle_after = check_storage_options(
            stripes, max_key_bytes, max_keys, on_full, evict_idle_after)
        if -(-max_keys // stripes) > MAX_STRIPE_ENTRIES:
            wanted = stripes
            while -(-max_keys // wanted) > MAX_STRIPE_ENTRIES:
                wanted *= 2
            raise ValidationError(
                f"max_keys={max_keys:,} over stripes={stripes} puts {-(-max_keys // stripes):,} keys in a stripe, "
                f"past the {MAX_STRIPE_ENTRIES:,} one can index: use stripes={wanted} or more")
        if arena_bytes is None:
            arena_bytes = max(1 << 20, 4 * max_keys)
        elif isinstance(arena_bytes, bool) or not isinstance(arena_bytes, int) or not 0 <= arena_bytes <= 1 << 40:
            raise ValidationError(f"arena_bytes must be an int in [0, 2**40], got {arena_bytes!r}")
        if if_stale not in ("reuse", "reset"):
            raise ValidationError(f"if_stale must be 'reuse' or 'reset', got {if_stale!r}")
        self.max_keys, self.on_full, self.evict_idle_after = max_keys, on_full, evict_idle_after
        self.arena_bytes = arena_bytes
        self.segment_name = _zone_segment_name(self.name)
        self._options = {"max_keys": max_keys, "stripes": stripes, "on_full": on_full,
                         "evict_idle_after": evict_idle_after, "max_key_bytes": self.max_key_bytes,
                         "arena_bytes": arena_bytes, "if_stale": if_stale}
        self._namespace_ids = {}
        self._namespace_lock = threading.Lock()
        if not nlz_supported():
            raise ValidationError(
                "SharedMemoryStorage needs POSIX shared memory (Linux, macOS, the BSDs); this platform "
                "has none: use RedisStorage to share limits between processes here")
        zone_open(self, stripes, if_stale == "reset", _attach_only)
        _ZONES.add(self)

    def __dealloc__(self):
        if self.z.base != NULL:
            nlz_unmap(self.z.base, self.mapped_bytes)
            self.z.base = NULL

    # -- creating and attaching ----------------------------------------------
    cdef object layout(self, uint32_t stripes):
        """Offsets and sizes of the parts for these parameters."""
        cdef uint64_t max_keys = self.max_keys
        cdef uint64_t per_stripe = (max_keys + stripes - 1) // stripes   # the largest cap: never over it
        cdef uint64_t slots = 16
        while per_stripe * 4 > slots * 3:
            slots *= 2
        namespaces = ZONE_HEADER_BYTES
        stripes_at = namespaces + ZONE_NAMESPACES * sizeof(ZoneNamespace)
        entries_at = stripes_at + stripes * sizeof(ZoneStripe)
        index_at = entries_at + stripes * per_stripe * sizeof(Entry)
        arena_at = (index_at + stripes * slots * sizeof(uint32_t) + 63) // 64 * 64
        total = arena_at + ARENA_HEADER_BYTES + (self.arena_bytes + 63) // 64 * 64
        return per_stripe, slots, namespaces, stripes_at, entries_at, index_at, arena_at, total

    cdef void initialise(self, char* base, uint32_t stripes, uint64_t per_stripe, uint64_t slots,
                         uint64_t namespaces, uint64_t stripes_at, uint64_t entries_at, uint64_t index_at,
                         uint64_t arena_at, uint64_t total) except *:
        """Set up a segment this process created (it is all zeros): the
        creator's token first, the magic last."""
        cdef ZoneHeader* h = <ZoneHeader*>base
        cdef ZoneStripe* s
        cdef uint32_t i
        cdef bytes name = self.name.encode()
        cdef bytes secret = os.urandom(40)
        nlz_store_u64_release(&h.creator_token, nlz_self_token())
        h.layout_version = ZONE_LAYOUT_VERSION
        h.header_bytes = ZONE_HEADER_BYTES
        h.created_at = nl_wall_now()
        h.total_bytes = total
        h.max_keys = self.max_keys
        h.stripes = stripes
        h.stripe_entries = <uint32_t>per_stripe
        h.index_slots = <uint32_t>slots
        h.max_key_bytes = <uint32_t>self.max_key_bytes
        h.on_full = ON_FULL_EVICT if self.on_full == "evict" else ON_FULL_DENY_NEW
        h.idle_after = 0.0 if self.evict_idle_after is None else self.evict_idle_after
        h.arena_bytes = self.arena_bytes
        h.k0 = int.from_bytes(secret[:8], "little")
        h.s1 = int.from_bytes(secret[8:16], "little") | 1
        h.s2 = int.from_bytes(secret[16:24], "little") | 1
        h.sip0 = int.from_bytes(secret[24:32], "little")
        h.sip1 = int.from_bytes(secret[32:40], "little")
        h.namespaces_offset = namespaces
        h.stripes_offset = stripes_at
        h.entries_offset = entries_at
        h.index_offset = index_at
        h.arena_offset = arena_at
        h.name_len = <uint32_t>len(name)
        memcpy(h.name, <const char*>name, len(name))
        h.pid_namespace = nlz_pid_namespace()
        self.bind(base)
        for i in range(stripes):
            s = &self.z.stripes[i]
            s.cap = <uint32_t>(self.max_keys // stripes + (1 if i < self.max_keys % stripes else 0))
            s.random = <uint32_t>(nl_mum(h.k0 ^ i, <uint64_t>i + 1) | 1)
        self.z.arena.top = arena_at + ARENA_HEADER_BYTES
        self.z.arena.end = total
        h.processes[0] = nlz_self_token()
        nlz_store_u64_release(&h.magic, ZONE_MAGIC)

    cdef void bind(self, char* base) noexcept:
        """This process's view of a mapped zone."""
        cdef ZoneHeader* h = <ZoneHeader*>base
        self.z.base = base
        self.z.header = h
        self.z.namespaces = <ZoneNamespace*>(base + h.namespaces_offset)
        self.z.stripes = <ZoneStripe*>(base + h.stripes_offset)
        self.z.entries = <Entry*>(base + h.entries_offset)
        self.z.index = <uint32_t*>(base + h.index_offset)
        self.z.arena = <ZoneArena*>(base + h.arena_offset)
        self.z.stripe_mask = h.stripes - 1
        self.z.stripe_entries = h.stripe_entries
        self.z.index_mask = h.index_slots - 1
        self.z.max_key_bytes = h.max_key_bytes
        self.z.k0, self.z.s1, self.z.s2, self.z.sip0, self.z.sip1 = h.k0, h.s1, h.s2, h.sip0, h.sip1
        self.z.evict_active = h.on_full == ON_FULL_EVICT
        self.z.idle_after = h.idle_after
        self.z.arena_lo = h.arena_offset + ARENA_HEADER_BYTES
        self.z.arena_hi = h.total_bytes
        self.z.max_keys = h.max_keys

    cdef bint join(self, bint reset_stale) except *:
        """Register this process in the zone. A zone no live process is
        attached to is stale (its run crashed or ended without unlinking):
        kept and repaired, or with ``reset_stale`` retired and unlinked
        (False: the caller creates it again)."""
        cdef ZoneHeader* h = self.z.header
        cdef uint32_t i
        cdef bint live = False
        self.lock_registry("attaching")
        try:
            if nlz_load_u64_acquire(&h.magic) != ZONE_MAGIC:
                return False                          # retired while we waited: attach again
            for i in range(<uint32_t>ZONE_PROCESSES):
                if h.processes[i] == nlz_self_token():
                    live = True     # another object of this process is attached and deciding
                elif h.processes[i] != 0:
                    if nlz_token_alive(h.processes[i]):
                        live = True
                    else:
                        h.processes[i] = 0
            if h.unrecorded:
                live = True         # a process the full registry could not record may be deciding
            if not live and reset_stale:
                nlz_store_u64_release(&h.magic, ZONE_RETIRED)
                nlz_unlink_if(self.segment_name.encode(), self.ident)
                return False
            self.add_process()
        finally:
            nlz_unlock(&h.registry_lock)
        if not live:
            self.repair_abandoned()
        return True

    cdef void lock_registry(self, str doing) except *:
        """Take the registry lock (namespaces and processes): taken over from
        a dead holder, and waited on for ZONE_LOCK_SECONDS at most for a
        live one (``doing`` says what for, in the error)."""
        cdef int got
        if nlz_trylock(&self.z.header.registry_lock):
            return
        with nogil:
            got = nlz_lock_timed(&self.z.header.registry_lock, ZONE_LOCK_SECONDS)
        if got < 0:
            raise ValidationError(
                f"shared-memory zone {self.name!r}: {doing} waited {ZONE_LOCK_SECONDS:g} s on its registry "
                f"lock, held by pid {nlz_lock_owner(&self.z.header.registry_lock) >> 32}, which is alive "
                "(stopped?)")
        if got == 1:
            self.z.header.lock_recoveries += 1

    cdef void add_process(self) except *:
        """Record this process (the caller holds the registry lock); the
        slot of a dead one is reused. With every slot live the process is
        counted in ``unrecorded`` instead, until it closes: while that count
        is not 0 no attacher can take the zone for stale (the recorded
        processes all gone, an unrecorded one may still be deciding)."""
        cdef ZoneHeader* h = self.z.header
        cdef uint32_t i
        cdef int free_slot = -1
        for i in range(<uint32_t>ZONE_PROCESSES):
            if h.processes[i] == nlz_self_token():
                return
            if free_slot < 0 and (h.processes[i] == 0 or not nlz_token_alive(h.processes[i])):
                free_slot = i
        if free_slot >= 0:
            h.processes[free_slot] = nlz_self_token()
            return
        mark = (os.getpid(), self.ident)
        if mark not in _UNRECORDED:
            _UNRECORDED.add(mark)
            h.unrecorded += 1

    cdef void register_process(self) except *:
        if self.is_closed or self.z.base == NULL:
            return
        self.lock_registry("registering a forked process")
        self.add_process()
        nlz_unlock(&self.z.header.registry_lock)

    cdef void repair_abandoned(self) except *:
        """A stale zone kept: every lock a dead process still holds is taken
        over and what it guards repaired, now rather than at first use."""
        cdef uint32_t i
        cdef uint64_t owner
        for i in range(self.z.stripe_mask + 1):
            owner = nlz_lock_owner(&self.z.stripes[i].lock)
            if owner != 0 and not nlz_token_alive(owner):
                self.lock_stripe(i)
                nlz_unlock(&self.z.stripes[i].lock)
        owner = nlz_lock_owner(&self.z.arena.lock)
        if owner != 0 and not nlz_token_alive(owner):
            with nogil:
                nlz_lock(&self.z.arena.lock)
            nlz_unlock(&self.z.arena.lock)

    # -- locks -------------------------------------------------------------
    cdef inline void lock_stripe(self, uint32_t si) noexcept:
        """As ``lock_stripe`` of the in-memory table: try once with the GIL,
        else wait without it; a lock taken over from a dead holder is
        repaired before use."""
        cdef int recovered
        if nlz_trylock(&self.z.stripes[si].lock):
            return
        with nogil:
            recovered = nlz_lock_slow(&self.z.stripes[si].lock)
            if recovered:
                zone_repair_stripe(&self.z, si)
                self.z.header.lock_recoveries += 1

    cdef inline void check_open(self) except *:
        if self.is_closed:
            raise ValidationError(f"shared-memory zone {self.name!r} is closed in this process")

    # -- namespaces ---------------------------------------------------------
    cdef uint32_t namespace(self, object algorithm, str rule, const Params* p) except 0:
        """The id of (algorithm, rule) in the zone's registry, the same in
        every process; the rule's latest parameters are stored with it."""
        cdef bytes raw = rule.encode()
        cdef uint32_t alg = ALGORITHM_IDS[algorithm]
        cdef uint32_t i, found = 0
        cdef ZoneNamespace* record
        self.check_open()
        if len(raw) > ZONE_RULE_BYTES:
            raise ValidationError(
                f"a rule name on a shared-memory zone is at most {ZONE_RULE_BYTES} bytes, got {len(raw)}")
        with self._namespace_lock:
            self.lock_registry("registering a rule")
            try:
                for i in range(<uint32_t>ZONE_NAMESPACES):
                    record = &self.z.namespaces[i]
                    if not record.used:
                        if found == 0:
                            found = i + 1
                        continue
                    if (record.algorithm == alg and record.name_len == len(raw)
                            and memcmp(record.name, <const char*>raw, len(raw)) == 0):
                        record.p = p[0]
                        return ((i + 1) << 3) | alg
                if found == 0:
                    raise ValidationError(
                        f"shared-memory zone {self.name!r} holds {ZONE_NAMESPACES} (algorithm, rule) pairs, "
                        "all taken: unlink it to start again with the rules in use")
                record = &self.z.namespaces[found - 1]
                record.algorithm = alg
                record.name_len = <uint32_t>len(raw)
                memcpy(record.name, <const char*>raw, len(raw))
                record.p = p[0]
                nlz_store_u32_release(&record.used, 1)
                self.z.header.namespace_count += 1
                return (found << 3) | alg
            finally:
                nlz_unlock(&self.z.header.registry_lock)

    cdef inline uint64_t seed_of(self, uint32_t ns) noexcept nogil:
        return zone_seed(&self.z, ns)

    cdef tuple namespace_name(self, uint32_t ns):
        cdef ZoneNamespace* record = &self.z.namespaces[(ns >> 3) - 1]
        rule = PyUnicode_DecodeUTF8(record.name, min(record.name_len, <uint32_t>ZONE_RULE_BYTES), NULL)
        return ZONE_ALGORITHMS[ns & NS_ALGORITHM_MASK], rule

    # -- the decision path --------------------------------------------------
    cdef int decide(self, uint32_t ns, uint64_t seed, const char* key, Py_ssize_t klen, double now,
                    int64_t cost, const Params* p, bint commit, Verdict* v) except? -9:
        cdef char digest[16]
        cdef const char* stored
        cdef uint64_t h
        cdef uint32_t si
        cdef int status
        if self.is_closed:
            self.check_open()
        stored = zone_key(&self.z, key, <uint32_t>klen, digest)
        h = zone_hash(&self.z, seed, stored, <uint32_t>klen)
        si = zone_stripe_of(&self.z, h)
        self.lock_stripe(si)
        status = zone_decide(&self.z, si, h, ns, stored, <uint32_t>klen, now, cost, p, commit, NULL, v)
        if status == NL_CORRUPT:
            zone_repair_stripe(&self.z, si)
        nlz_unlock(&self.z.stripes[si].lock)
        if status == NL_CORRUPT:
            self.raise_corrupt(f"stripe {si}")
        return status

    cdef void raise_corrupt(self, str where) except *:
        """The error of a call that found a stripe corrupt (and repaired it
        under its lock, before releasing it)."""
        raise RuntimeError(
            f"shared-memory zone {self.name!r} ({self.segment_name}): {where} was corrupt (an index slot, "
            "count or sliding-log ring that cannot be: a bad write into the segment); it was repaired, "
            "dropping the entries that could not be trusted, and this call decided nothing; the next "
            "call decides on the repaired stripe")

    cdef int decide_batch(self, uint32_t ns, uint64_t seed, Py_ssize_t n, const char** keys,
                          const Py_ssize_t* sizes, const int64_t* costs, uint64_t* hashes,
                          double now, const double* times, const Params* p, uint8_t* allowed, int64_t* remaining,
                          double* retry_after, double* reset_after, double* delay,
                          uint8_t* storage_full, Py_ssize_t* done, Py_ssize_t* refused) noexcept nogil:
        """``InMemoryStorage.decide_batch`` on the zone: hashes first, index
        slots prefetched ``2 * AHEAD`` requests ahead and entries ``AHEAD``
        ahead, a stripe's lock kept over a run of up to 32 requests."""
        cdef Zone* z = &self.z
        cdef Py_ssize_t i, j, AHEAD = 8
        cdef uint32_t si, held = 0xFFFFFFFFU
        cdef int run = 0, status = NL_OK
        cdef Verdict v
        cdef char digest[16]
        cdef char* digests = NULL
        cdef const char* stored
        for j in range(n):
            if sizes[j] > INLINE_KEY_BYTES:
                digests = <char*>malloc(<size_t>n * 16)
                if digests == NULL:
                    done[0] = 0
                    return NL_NOMEM
                break
        for j in range(n):
            stored = keys[j]
            if sizes[j] > INLINE_KEY_BYTES:
                stored = zone_key(z, keys[j], <uint32_t>sizes[j], digests + 16 * j)
            hashes[j] = zone_hash(z, seed, stored, <uint32_t>sizes[j])
        for i in range(n):
            if i + 2 * AHEAD < n:
                zone_prefetch_slot(z, hashes[i + 2 * AHEAD])
            if i + AHEAD < n:
                zone_prefetch_entry(z, hashes[i + AHEAD])
            si = zone_stripe_of(z, hashes[i])
            if si != held or run >= 32:
                if held != 0xFFFFFFFFU:
                    nlz_unlock(&z.stripes[held].lock)
                if nlz_lock(&z.stripes[si].lock):
                    zone_repair_stripe(z, si)
                    z.header.lock_recoveries += 1
                held = si
                run = 0
            run += 1
            stored = keys[i] if sizes[i] <= INLINE_KEY_BYTES else digests + 16 * i
            status = zone_decide(z, si, hashes[i], ns, stored, <uint32_t>sizes[i],
                                 now if times == NULL else times[i], costs[i], p, True, NULL, &v)
            if status != NL_OK:
                if status == NL_CORRUPT:
                    zone_repair_stripe(z, si)
                break
            allowed[i] = v.allowed
            storage_full[i] = v.storage_full
            refused[0] += v.storage_full
            remaining[i] = whole_units(v.remaining)
            retry_after[i] = v.retry_after
            reset_after[i] = v.reset_after
            delay[i] = v.delay
        if held != 0xFFFFFFFFU:
            nlz_unlock(&z.stripes[held].lock)
        free(digests)
        done[0] = i if status != NL_OK else n
        return status

    cdef int refund(self, uint32_t ns, uint64_t seed, const char* key, Py_ssize_t klen, double now,
                    int64_t cost, double at, bint latest, const Params* p) except -1:
        """``_Limiter.refund`` on the zone (``zone_refund``)."""
        cdef char digest[16]
        cdef const char* stored
        cdef uint64_t h
        cdef uint32_t si
        cdef int status
        self.check_open()
        stored = zone_key(&self.z, key, <uint32_t>klen, digest)
        h = zone_hash(&self.z, seed, stored, <uint32_t>klen)
        si = zone_stripe_of(&self.z, h)
        self.lock_stripe(si)
        status = zone_refund(&self.z, si, h, ns, stored, <uint32_t>klen, now, cost, at, latest, p)
        if status == NL_CORRUPT:
            zone_repair_stripe(&self.z, si)
        nlz_unlock(&self.z.stripes[si].lock)
        if status == NL_CORRUPT:
            self.raise_corrupt(f"stripe {si}")
        if status != NL_OK:
            raise MemoryError(
                f"shared-memory zone {self.name!r}: no arena room to refund a sliding log's stamps; nothing changed")
        return 0

    cdef int forget(self, uint32_t ns, uint64_t seed, const char* key, Py_ssize_t klen) except -1:
        cdef char digest[16]
        cdef const char* stored
        cdef uint64_t h
        cdef uint32_t si, slot
        cdef Py_ssize_t position
        cdef int status = NL_OK
        self.check_open()
        stored = zone_key(&self.z, key, <uint32_t>klen, digest)
        h = zone_hash(&self.z, seed, stored, <uint32_t>klen)
        si = zone_stripe_of(&self.z, h)
        self.lock_stripe(si)
        position = zone_find(&self.z, si, h, ns, stored, <uint32_t>klen, &slot)
        if position >= 0:
            status = zone_delete(&self.z, si, slot, <uint32_t>position)
        elif position == ZONE_FIND_CORRUPT:
            status = NL_CORRUPT
        if status == NL_CORRUPT:
            zone_repair_stripe(&self.z, si)
        nlz_unlock(&self.z.stripes[si].lock)
        if status == NL_CORRUPT:
            self.raise_corrupt(f"stripe {si}")
        return 0

    cdef object snapshot(self, uint32_t ns, uint64_t seed, const char* key, Py_ssize_t klen, object algorithm):
        """A LimiterState copy of one key, built after the lock is released."""
        cdef char digest[16]
        cdef const char* stored
        cdef uint64_t h
        cdef uint32_t si, slot, i
        cdef Py_ssize_t position
        cdef Entry copy
        cdef double* log = NULL
        cdef int status = NL_OK
        self.check_open()
        stored = zone_key(&self.z, key, <uint32_t>klen, digest)
        h = zone_hash(&self.z, seed, stored, <uint32_t>klen)
        si = zone_stripe_of(&self.z, h)
        self.lock_stripe(si)
        position = zone_find(&self.z, si, h, ns, stored, <uint32_t>klen, &slot)
        if position == ZONE_FIND_CORRUPT:
            status = NL_CORRUPT
        elif position >= 0 and not zone_view(&self.z, &stripe_entries(&self.z, si)[position], &copy):
            status = NL_CORRUPT
        elif position >= 0:
            if (ns & NS_ALGORITHM_MASK) == ALG_SLIDING_LOG and copy.state.log.length:
                log = <double*>malloc(copy.state.log.length * sizeof(double))
                if log == NULL:
                    status = NL_NOMEM
                else:
                    for i in range(copy.state.log.length):
                        log[i] = log_at(&copy.state.log, i)
        if status == NL_CORRUPT:
            zone_repair_stripe(&self.z, si)
        nlz_unlock(&self.z.stripes[si].lock)
        if status == NL_CORRUPT:
            self.raise_corrupt(f"stripe {si}")
        if status != NL_OK:
            raise_status(status)
        if position < 0:
            return None
        return entry_snapshot(&copy, ns, algorithm, log)

    # -- compound limits ------------------------------------------------------
    def allow_all(self, requests):
        """All-or-nothing over several limiters of this zone (docs/spec.md
        §5): the stripes involved are locked in index order, every limit is
        decided without spending, and only if all allow is each charged."""
        cdef list items = compound_items(requests)
        cdef Py_ssize_t n = len(items)
        cdef Py_ssize_t i, j, locked = 0, stripes_used = 0
        cdef list limiters = []
        cdef list keys = []
        cdef _Limiter limiter
        cdef BatchBlock block
        cdef int carving
        cdef char* digests
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
        self.check_open()
        if n > ZONE_COMPOUND_MAX:
            raise ValidationError(
                f"a compound request on a shared-memory zone holds at most {ZONE_COMPOUND_MAX} limits, got {n}")
        batch_begin(&block, n)
        for carving in range(2):    # measure, then carve
            if carving:
                batch_alloc(&block)
            digests = <char*>batch_take(&block, 16)     # a long key's digest, 16 bytes
            verdicts = <Verdict*>batch_take(&block, sizeof(Verdict))
            data = <const char**>batch_take(&block, sizeof(char*))
            sizes = <Py_ssize_t*>batch_take(&block, sizeof(Py_ssize_t))
            units = <int64_t*>batch_take(&block, sizeof(int64_t))
            hashes = <uint64_t*>batch_take(&block, sizeof(uint64_t))
            nows = <double*>batch_take(&block, sizeof(double))
            params = <const Params**>batch_take(&block, sizeof(Params*))
            namespaces = <uint32_t*>batch_take(&block, sizeof(uint32_t))
            stripe_ids = <uint32_t*>batch_take(&block, sizeof(uint32_t))
        try:
            for i in range(n):
                candidate, key, cost = items[i]
                if not isinstance(candidate, _Limiter) or (<_Limiter>candidate).zone is not self:
                    raise ValidationError("every limiter of a compound request must use this storage")
                limiter = <_Limiter>candidate
                limiters.append(limiter)
                keys.append(key)
                data[i] = key_bytes(key, self.max_key_bytes, &sizes[i])
                units[i] = cost_value(cost, limiter.p.capacity)
                data[i] = zone_key(&self.z, data[i], <uint32_t>sizes[i], digests + 16 * i)
                hashes[i] = zone_hash(&self.z, limiter.seed, data[i], <uint32_t>sizes[i])
                params[i] = &limiter.p
                namespaces[i] = limiter.ns
                for j in range(i):
                    if (namespaces[j] == namespaces[i] and sizes[j] == sizes[i]
                            and memcmp(data[j], data[i], stored_len(<uint32_t>sizes[i])) == 0):
                        raise ValidationError(DUPLICATE_COMPOUND)
            for i in range(n):
                nows[i] = (<_Limiter>limiters[i]).read_clock()
            for i in range(n):
                stripe_id = zone_stripe_of(&self.z, hashes[i])
                j = stripes_used
                while j > 0 and stripe_ids[j - 1] > stripe_id:
                    j -= 1
                if j > 0 and stripe_ids[j - 1] == stripe_id:
                    continue
                memmove(&stripe_ids[j + 1], &stripe_ids[j], (stripes_used - j) * sizeof(uint32_t))
                stripe_ids[j] = stripe_id
                stripes_used += 1
            for j in range(stripes_used):
                self.lock_stripe(stripe_ids[j])
                locked += 1
            status = zone_compound(&self.z, n, hashes, namespaces, data, sizes, nows, units, params,
                                   verdicts)
            if status == NL_CORRUPT:        # one of them: each is checked and rebuilt
                for j in range(stripes_used):
                    zone_repair_stripe(&self.z, stripe_ids[j])
            while locked > 0:
                locked -= 1
                nlz_unlock(&self.z.stripes[stripe_ids[locked]].lock)
            if status == NL_CORRUPT:
                self.raise_corrupt("one of stripes " + ", ".join(str(stripe_ids[j]) for j in range(stripes_used)))
            if status != NL_OK:
                raise_status(status)
            decisions = []
            for i in range(n):
                limiter = <_Limiter>limiters[i]
                decisions.append(make_decision(&verdicts[i], limiter.p.capacity, limiter._rule, limiter.p.window))
        finally:
            while locked > 0:
                locked -= 1
                nlz_unlock(&self.z.stripes[stripe_ids[locked]].lock)
            free(block.base)
        return CompoundDecision(decisions)

    # -- the Storage protocol ------------------------------------------------
    def apply(self, key, now, mutate):
        """Not available: ``apply`` keeps a Python object per key, and Python
        objects cannot be shared between processes. The six built-in
        algorithms decide in the zone itself."""
        raise ValidationError(
            "SharedMemoryStorage runs the six built-in limiters only: apply() would keep a Python "
            "object per key, which other processes cannot read; use InMemoryStorage for a custom algorithm")

    def evict_idle(self, cutoff):
        """Forget keys whose last decision was before ``cutoff``; returns how many."""
        cdef double limit = check_cutoff(cutoff)
        cdef Py_ssize_t removed = 0
        cdef uint32_t si, j
        cdef int status
        cdef Entry* entries
        self.check_open()
        for si in range(self.z.stripe_mask + 1):
            self.lock_stripe(si)
            entries = stripe_entries(&self.z, si)
            status = NL_CORRUPT if self.z.stripes[si].count > self.z.stripe_entries else NL_OK
            j = 0
            while status == NL_OK and j < self.z.stripes[si].count:
                if entries[j].updated_at < limit:
                    status = zone_remove_position(&self.z, si, j)
                    removed += 1
                else:
                    j += 1
            if status == NL_CORRUPT:
                zone_repair_stripe(&self.z, si)
            nlz_unlock(&self.z.stripes[si].lock)
            if status == NL_CORRUPT:
                self.raise_corrupt(f"stripe {si}")
        return removed

    def __len__(self):
        cdef Py_ssize_t total = 0
        cdef uint32_t si
        self.check_open()
        for si in range(self.z.stripe_mask + 1):
            total += nl_load_u32_relaxed(&self.z.stripes[si].count)
        return total

    def keys(self):
        """Every key held, as storage keys; a key over 16 bytes is stored as
        its digest and listed as ``"#"`` and the digest's 32 hex digits."""
        cdef list out = []
        cdef uint32_t si, j, n
        cdef bint corrupt
        cdef Entry* entries
        cdef char* copy
        self.check_open()
        for si in range(self.z.stripe_mask + 1):
            self.lock_stripe(si)
            n = self.z.stripes[si].count
            corrupt = n > self.z.stripe_entries
            j = 0
            while not corrupt and j < n:
                corrupt = not zone_entry_valid(&self.z, &stripe_entries(&self.z, si)[j])
                j += 1
            if corrupt:
                zone_repair_stripe(&self.z, si)
                nlz_unlock(&self.z.stripes[si].lock)
                self.raise_corrupt(f"stripe {si}")
            copy = <char*>malloc(<size_t>(n if n else 1) * sizeof(Entry))
            if copy == NULL:
                nlz_unlock(&self.z.stripes[si].lock)
                raise MemoryError()
            memcpy(copy, stripe_entries(&self.z, si), <size_t>n * sizeof(Entry))
            nlz_unlock(&self.z.stripes[si].lock)
            try:
                entries = <Entry*>copy
                for j in range(n):
                    if entries[j].key_len <= INLINE_KEY_BYTES:
                        key = PyUnicode_DecodeUTF8(entries[j].key.short_key, entries[j].key_len, NULL)
                    else:
                        key = "#" + (<bytes>entries[j].key.short_key[:16]).hex()
                    algorithm, rule = self.namespace_name(entries[j].ns)
                    out.append(storage_key(algorithm, rule, key))
            finally:
                free(copy)
        return out

    def stats(self):
        """Counters of the zone's table, summed over every process: keys held
        and why keys were forgotten or refused."""
        cdef uint64_t at_rest = 0, lru = 0, idle = 0, denied = 0, arena = 0, repaired = 0
        cdef Py_ssize_t keys = 0
        cdef uint32_t si
        cdef ZoneStripe* s
        self.check_open()
        for si in range(self.z.stripe_mask + 1):
            s = &self.z.stripes[si]
            self.lock_stripe(si)
            keys += s.count
            at_rest += s.evicted_at_rest
            lru += s.evicted_active
            idle += s.evicted_idle
            denied += s.denied_new
            arena += s.denied_arena
            repaired += s.recoveries
            nlz_unlock(&s.lock)
        return {"keys": keys, "evicted_at_rest": at_rest, "evicted_active": lru, "evicted_idle": idle,
                "denied_new": denied, "denied_arena": arena, "stripes_repaired": repaired,
                "lock_recoveries": self.z.header.lock_recoveries}

    def metrics(self):
        """``stats`` plus the zone's size, arena use and attached processes,
        for a dashboard: the numbers an operator sizes the zone by."""
        cdef ZoneArena* a
        out = self.stats()
        a = self.z.arena
        out.update({
            "max_keys": self.max_keys,
            "segment_bytes": self.mapped_bytes,
            "arena_bytes": a.end - (<uint64_t>(<char*>a - self.z.base) + ARENA_HEADER_BYTES),
            "arena_used_bytes": a.used,
            "arena_unused_bytes": a.end - a.top,
            "arena_failures": a.failures,
            "namespaces": self.z.header.namespace_count,
            "processes": len(self.attached_pids()),
            "processes_unrecorded": self.z.header.unrecorded,
        })
        return out

    def attached_pids(self):
        """The pids of the live processes attached to the zone."""
        cdef uint32_t i
        cdef uint64_t token
        self.check_open()
        pids = []
        for i in range(<uint32_t>ZONE_PROCESSES):
            token = self.z.header.processes[i]
            if token != 0 and nlz_token_alive(token):
                pids.append(<uint32_t>(token >> 32))
        return sorted(pids)

    def memory_bytes(self):
        """Bytes of the segment: the whole table is reserved at creation."""
        return self.mapped_bytes

    def _simulate_dead_holder(self, limiter, key, pid, what="decision"):
        """Test hook: leave ``key``'s stripe as a holder that died would,
        locked by ``pid`` (a process that has exited). ``"decision"``: part
        of a decision written over the key's entry, its undo copy kept;
        ``"move"``: a deletion of the key cut off after the last entry moved
        into its place. The next caller that needs the stripe must take the
        lock over and repair it."""
        cdef _Limiter lim = <_Limiter?>limiter
        cdef Py_ssize_t klen
        cdef char digest[16]
        cdef const char* data = key_bytes(key, self.max_key_bytes, &klen)
        cdef const char* stored = zone_key(&self.z, data, <uint32_t>klen, digest)
        cdef uint64_t h = zone_hash(&self.z, lim.seed, stored, <uint32_t>klen)
        cdef uint32_t si = zone_stripe_of(&self.z, h), slot
        cdef ZoneStripe* s = &self.z.stripes[si]
        cdef Entry* entries = stripe_entries(&self.z, si)
        cdef Py_ssize_t position
        self.check_open()
        if what not in ("decision", "move"):
            raise ValidationError(f"what must be 'decision' or 'move', got {what!r}")
        self.lock_stripe(si)
        position = zone_find(&self.z, si, h, lim.ns, stored, <uint32_t>klen, &slot)
        if position < 0 or (what == "move" and s.count < 2):  # (ZONE_FIND_CORRUPT too: not held)
            nlz_unlock(&s.lock)
            raise ValidationError("the key must be held (and, for 'move', share its stripe with another)")
        if what == "decision":
            zone_undo_begin(s, <uint32_t>position, &entries[position])
            memset(&entries[position].state, 0xAB, sizeof(entries[position].state))
            entries[position].updated_at = -1.0
        else:
            entries[position] = entries[s.count - 1]
        nlz_store_u64_release(&s.lock, (<uint64_t>pid << 32) | 0x80000000U)
        return si

    # -- lifecycle -----------------------------------------------------------
    @property
    def created(self):
        """True in the process that created the segment."""
        return self.is_created

    @property
    def closed(self):
        return self.is_closed

    @property
    def stripes(self):
        return self.z.stripe_mask + 1

    def close(self):
        """Detach this process: it leaves the zone's registry and every later
        call here raises. The mapping goes with the last reference (a call
        in flight on another thread finishes on it). The zone lives on for
        the other processes; ``unlink`` removes its name."""
        cdef uint32_t i
        cdef int got
        if self.is_closed:
            return
        _ZONES.discard(self)
        if self.process_still_attached():
            self.is_closed = True   # the slot is the process's: another object here still decides
            return
        with nogil:
            got = nlz_lock_timed(&self.z.header.registry_lock, ZONE_LOCK_SECONDS)
        # with the lock held by a live process that does not let go, this
        # process's own slot is cleared all the same (one store, of a slot
        # nobody else writes while this process is alive)
        for i in range(<uint32_t>ZONE_PROCESSES):
            if self.z.header.processes[i] == nlz_self_token():
                nlz_store_u64_release(&self.z.header.processes[i], 0)
        if got >= 0:
            if got == 1:
                self.z.header.lock_recoveries += 1
            mark = (os.getpid(), self.ident)
            if mark in _UNRECORDED:   # without the lock it stays counted: the zone looks live
                _UNRECORDED.discard(mark)
                if self.z.header.unrecorded:
                    self.z.header.unrecorded -= 1
            nlz_unlock(&self.z.header.registry_lock)
        self.is_closed = True

    cdef bint process_still_attached(self):
        """Whether another open object of this process maps this segment:
        the registry holds one slot per process (its token), not per object,
        so the slot stays until the last of them closes (a second attach to
        read metrics had unregistered the process, and a later
        ``if_stale="reset"`` then took the live zone for stale)."""
        cdef SharedMemoryStorage other
        for zone in list(_ZONES):
            other = <SharedMemoryStorage>zone
            if other is not self and not other.is_closed and other.z.base != NULL and other.ident == self.ident:
                return True
        return False

    def unlink(self):
        """Remove the zone's name: processes attached keep deciding on it
        until they close, and the next ``SharedMemoryStorage(name, ...)``
        creates a fresh, empty zone. Returns whether the name was removed:
        False when it was not there, or when it names another segment now
        (a newer zone made under the name after this one was retired), which
        is left alone. The zone is marked retired and its name removed under
        its registry lock, so a process killed between the two leaves a lock
        that the next attacher takes over and finishes the removal under."""
        cdef int err
        if self.z.base == NULL:
            return nlz_unlink(self.segment_name.encode()) == 0
        self.lock_registry("unlinking")
        try:
            if not self.is_closed:
                nlz_store_u64_release(&self.z.header.magic, ZONE_RETIRED)
            err = nlz_unlink_if(self.segment_name.encode(), self.ident)
        finally:
            nlz_unlock(&self.z.header.registry_lock)
        return err == 0

    @staticmethod
    def attach(name):
        """Attach to the zone called ``name`` with the parameters it was
        created with (a tool that inspects a running gateway's zone does not
        know them); never creates one."""
        cdef void* base = NULL
        cdef uint64_t mapped = 0, ident = 0
        cdef ZoneHeader* h
        segment = _zone_segment_name(_check_zone_name(name))
        deadline = time_module.monotonic() + ZONE_ATTACH_SECONDS
        while True:
            err = nlz_open(segment.encode(), 0, 0, 0, &base, &mapped, &ident)
            if err == errno_module.ENOENT:
                raise ValidationError(f"there is no shared-memory zone called {name!r}")
            if err != 0 and err != errno_module.EAGAIN:
                raise _zone_error(err, segment, 0)
            if err == 0 and mapped >= ZONE_HEADER_BYTES:
                h = <ZoneHeader*>base
                if nlz_load_u64_acquire(&h.magic) == ZONE_MAGIC and h.layout_version == ZONE_LAYOUT_VERSION:
                    options = {"max_keys": h.max_keys, "stripes": h.stripes,
                               "on_full": "evict" if h.on_full == ON_FULL_EVICT else "deny_new",
                               "evict_idle_after": None if h.idle_after == 0.0 else h.idle_after,
                               "max_key_bytes": h.max_key_bytes, "arena_bytes": h.arena_bytes}
                    nlz_unmap(base, mapped)
                    return SharedMemoryStorage(name, _attach_only=True, **options)
            if err == 0:
                nlz_unmap(base, mapped)
            if time_module.monotonic() > deadline:
                raise ValidationError(f"{segment} is not a finished nanolimit shared-memory zone")
            time_module.sleep(0.001)

    @staticmethod
    def unlink_segment(name):
        """Remove the zone called ``name`` without attaching to it (a
        deployment's exit hook); returns whether it was there."""
        return nlz_unlink(_zone_segment_name(_check_zone_name(name)).encode()) == 0

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def __reduce__(self):
        return (_attach_zone, (self.name, self._options))

    def __repr__(self):
        state = "closed" if self.is_closed else f"keys={len(self)}"
        return f"<SharedMemoryStorage {self.name!r} {state} max_keys={self.max_keys} stripes={self.stripes}>"

# Included by _core.pyx (one extension module, nanolimit._core): its cimports,
# imports and shared constants are in scope here.
#
# InMemoryStorage: the striped table in C memory, its namespaces, the
# decision paths (one, a batch, a compound) and the Storage protocol.

# apply's mutate runs under a Python lock shared by a group of stripes (see
# ``InMemoryStorage.apply``): enough groups for applies of unrelated keys to
# overlap, few enough to build with every storage.
cdef uint32_t APPLY_LOCK_GROUPS = 16


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
    cdef tuple _apply_locks               # apply's Python locks, one per group of stripes
    cdef uint32_t apply_lock_mask         # a stripe's group: its index & this
    cdef object _applying                 # threading.local: this thread is running a mutate

    def __cinit__(self, *, stripes=64, max_key_bytes=MAX_KEY_BYTES, max_keys=None, on_full="evict",
                  evict_idle_after=None, _hash_mask=None):
        cdef uintptr_t address
        cdef uint32_t i
        stripes, self.max_key_bytes, max_keys, on_full, evict_idle_after = check_storage_options(
            stripes, max_key_bytes, max_keys, on_full, evict_idle_after)
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
        self.max_keys, self.on_full, self.evict_idle_after = max_keys, on_full, evict_idle_after
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
        self.apply_lock_mask = min(self.stripe_mask + 1, APPLY_LOCK_GROUPS) - 1
        self._apply_locks = tuple([threading.Lock() for i in range(self.apply_lock_mask + 1)])
        self._applying = threading.local()

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
                lock_stripe(s)
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
        cdef int status
        lock_stripe(s)
        status = table_decide(s, self.bounds_or_null(), h, ns, key, <uint32_t>klen, now, cost, p, commit, v)
        nl_unlock(&s.lock)
        return status

    cdef inline void refund(self, uint64_t h, uint32_t ns, const char* key, Py_ssize_t klen, double now,
                            int64_t cost, double at, bint latest, const Params* p) noexcept:
        """``_Limiter.refund`` under the key's stripe lock (``table_refund``)."""
        cdef Stripe* s = self.stripe_for(h)
        lock_stripe(s)
        table_refund(s, h, ns, key, <uint32_t>klen, now, cost, at, latest, p)
        nl_unlock(&s.lock)

    cdef int decide_batch(self, uint32_t ns, uint64_t seed, Py_ssize_t n, const char** keys,
                          const Py_ssize_t* sizes, const int64_t* costs, uint64_t* hashes,
                          double now, const double* times, const Params* p, uint8_t* allowed, int64_t* remaining,
                          double* retry_after, double* reset_after, double* delay,
                          uint8_t* storage_full, Py_ssize_t* done, Py_ssize_t* refused) noexcept nogil:
        """Decide ``n`` requests in order. Hashes are computed first so the
        loop can prefetch the index slot ``2 * AHEAD`` requests ahead and the
        entry ``AHEAD`` ahead: a large table costs cache misses, not probes."""
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
        lock_stripe(s)
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
        cdef int status = NL_OK
        lock_stripe(s)
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
        return entry_snapshot(&copy, ns, algorithm, log)

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
        all-or-nothing (docs/spec.md §5, compound requests): every stripe involved is
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
        cdef BatchBlock block
        cdef int carving
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
        cdef CompoundKeys keep
        cdef Stripe* s
        cdef uint32_t slot
        cdef bint absent = False
        cdef uint8_t* created
        cdef uint8_t* reserved
        batch_begin(&block, n)
        for carving in range(2):    # measure, then carve
            if carving:
                batch_alloc(&block)
            verdicts = <Verdict*>batch_take(&block, sizeof(Verdict))
            data = <const char**>batch_take(&block, sizeof(char*))
            sizes = <Py_ssize_t*>batch_take(&block, sizeof(Py_ssize_t))
            units = <int64_t*>batch_take(&block, sizeof(int64_t))
            hashes = <uint64_t*>batch_take(&block, sizeof(uint64_t))
            nows = <double*>batch_take(&block, sizeof(double))
            params = <const Params**>batch_take(&block, sizeof(Params*))
            namespaces = <uint32_t*>batch_take(&block, sizeof(uint32_t))
            stripe_ids = <uint32_t*>batch_take(&block, sizeof(uint32_t))
            created = <uint8_t*>batch_take(&block, sizeof(uint8_t))
            reserved = <uint8_t*>batch_take(&block, sizeof(uint8_t))
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
                lock_stripe(&self.stripes[stripe_ids[j]])
                locked += 1
            # Phase 1 makes room in full stripes; phase 2 then never refuses.
            # The room for a new key counts the compound's new keys of its
            # stripe given room before it (not in yet), and no key of the
            # compound is forgotten for it: all committed, a stripe holds
            # at most its cap. Where that room cannot be made the key is
            # refused as a lone new key would be (storage_full), so the
            # compound is, charging nothing.
            unbounded = self.bounds
            unbounded.stripe_cap = 0
            unbounded.idle_after = 0.0
            keep.n = n
            keep.namespaces = namespaces
            keep.data = data
            keep.sizes = sizes
            reserve = self.bounds
            reserve.reserve_on_peek = True
            reserve.keep = &keep
            if status == NL_OK:
                for i in range(n):
                    s = self.stripe_for(hashes[i])
                    reserved[i] = 0
                    if self.bounded:
                        reserve.pending = 0
                        for j in range(i):
                            if reserved[j] and self.stripe_for(hashes[j]) == s:
                                reserve.pending += 1
                        absent = stripe_find(s, hashes[i], namespaces[i], data[i], <uint32_t>sizes[i], &slot) < 0
                    status = table_decide(s, &reserve if self.bounded else NULL,
                                          hashes[i], namespaces[i], data[i],
                                          <uint32_t>sizes[i], nows[i], units[i], params[i], False,
                                          &verdicts[i])
                    if status != NL_OK:
                        break
                    if self.bounded and absent and not verdicts[i].storage_full:
                        reserved[i] = 1     # room made: the commit writes it
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
            free(block.base)
        return CompoundDecision(decisions)

    # -- the Storage protocol ------------------------------------------------
    def apply(self, key, now, mutate):
        """Run ``mutate(state | None) -> (state, result)`` atomically for ``key``.

        The slow, general seam (docs/spec.md §5) for algorithms written in Python. No
        stripe lock is held while ``mutate`` runs: the ``apply`` calls of a
        group of stripes take turns on a Python lock (``_apply_locks``, which
        releases the GIL while it waits), and the stripe lock is taken only
        to read the state before and to write it after. So a slow mutate
        holds up only other ``apply`` calls of its group, never a limiter's
        decision, and ``evict_idle`` leaves the key it is running for (the
        key is being touched). ``mutate`` must not call ``apply`` of this
        storage (``RuntimeError``: it could wait on itself). A returned state
        of ``None`` forgets the key.
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
        cdef bint full = False
        if not callable(mutate):
            raise ValidationError("mutate must be callable")
        applying = self._applying
        if getattr(applying, "active", False):
            raise_status(NL_REENTRANT)
        with <object>self._apply_locks[((h >> 40) & self.stripe_mask) & self.apply_lock_mask]:
            applying.active = True
            try:
                # Read: the state (a new reference, ours while mutate runs)
                # and the pin that keeps evict_idle off this key meanwhile.
                lock_stripe(s)
                position = stripe_find(s, h, ALG_APPLY, data, <uint32_t>klen, &slot)
                if position >= 0:
                    e = &s.entries[position]
                    e.state.apply.busy = 1
                    state = <object><PyObject*>e.state.obj
                else:
                    state = None
                nl_unlock(&s.lock)
                try:
                    new_state, result = mutate(state)
                except BaseException:
                    if position >= 0:
                        lock_stripe(s)
                        position = stripe_find(s, h, ALG_APPLY, data, <uint32_t>klen, &slot)
                        if position >= 0:
                            s.entries[position].state.apply.busy = 0
                        nl_unlock(&s.lock)
                    raise
                # Write, unpinning in the same hold. Other keys of the stripe
                # may have come and gone (entries move), so the key is looked
                # up again; its own entry cannot have changed (apply keys
                # change only here, one apply of a group at a time, and the
                # pin kept evict_idle away): it still holds the ``state`` read,
                # or is still absent.
                lock_stripe(s)
                position = stripe_find(s, h, ALG_APPLY, data, <uint32_t>klen, &slot)
                if position >= 0:
                    s.entries[position].state.apply.busy = 0
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
                elif self.bounded and not room_for_new_key(s, &self.bounds, t):
                    full = True     # a new key holds the bound as a limiter's does (denied_new)
                else:
                    if self.bounded:    # making room may have moved the probe run
                        stripe_find(s, h, ALG_APPLY, data, <uint32_t>klen, &slot)
                    e = stripe_insert(s, h, ALG_APPLY, data, <uint32_t>klen, slot, &status)
                    if e != NULL:
                        Py_INCREF(new_state)
                        e.state.obj = <void*><PyObject*>new_state
                        e.state.apply.busy = 0
                        e.updated_at = t
                nl_unlock(&s.lock)
            finally:
                applying.active = False
        if old != NULL:
            Py_DECREF(<object><PyObject*>old)
        if status != NL_OK:
            raise_status(status)
        if full:
            raise StorageFullError(
                f"apply: no room for the new key {key!r}: max_keys={self.max_keys} holds keys it may not "
                f"forget (on_full={self.on_full!r}); its state was not stored")
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
        memset(&objects, 0, sizeof(ObjectList))
        for i in range(self.stripe_mask + 1):
            s = &self.stripes[i]
            lock_stripe(s)
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
            lock_stripe(s)
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
        for i in range(self.stripe_mask + 1):
            s = &self.stripes[i]
            lock_stripe(s)
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
            lock_stripe(s)
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
            lock_stripe(s)
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
            lock_stripe(s)
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

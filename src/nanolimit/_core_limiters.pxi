# Included by _core.pyx (one extension module, nanolimit._core): its cimports,
# imports and shared constants are in scope here.
#
# The limiters: ``_Limiter``'s shared machinery and the six algorithms.

cdef class _Limiter:
    """Shared machinery of the six limiters; subclasses name the algorithm."""

    cdef Params p
    cdef InMemoryStorage store          # None when the storage is not native
    cdef SharedMemoryStorage zone       # a shared-memory zone, else None
    cdef object _storage
    cdef object _clock
    cdef object _config
    cdef object _fallback               # reference limiter over a foreign storage
    cdef object kernel_run              # storage.run_kernel of a KernelStorage (Redis), else None
    cdef LeaseBook book                 # a TwoTierStorage's leases for this config, else None
    cdef bint system_clock
    cdef uint32_t ns
    cdef uint64_t seed
    cdef str _rule
    cdef Py_ssize_t max_key_bytes
    cdef object __weakref__              # the storage tracks which namespaces live limiters use

    algorithm = None

    def __init__(self, limit, window_seconds, storage=None, clock=None, rule="", *, burst=None):
        algorithm = type(self).algorithm
        cfg = LimiterConfig.build(algorithm, limit, window_seconds, burst, rule)
        if clock is None:
            clock = SystemClock()
        elif not callable(getattr(clock, "now", None)):
            raise ValidationError(f"clock must have a now() method, got {type(clock).__name__}")
        if storage is None:
            storage = InMemoryStorage()
        elif not isinstance(storage, Storage):
            raise ValidationError(f"storage must implement Storage, got {type(storage).__name__}")
        self._config = cfg
        self._storage = storage
        self._clock = clock
        self._rule = cfg.rule
        self.system_clock = type(clock) is SystemClock
        self.p.algorithm = ALGORITHM_IDS[algorithm]
        self.p.capacity = cfg.capacity
        self.p.capacity_f = <double>cfg.capacity
        self.p.rate = cfg.rate
        self.p.window = cfg.window_seconds
        self.p.interval_us = cfg.gcra_interval_us
        self.p.tolerance_us = cfg.gcra_tolerance_us
        if isinstance(storage, InMemoryStorage):
            self.store = <InMemoryStorage>storage
            self.ns = self.store.namespace(algorithm, self._rule, &self.p, self)
            self.seed = nl_namespace_seed(self.ns)
            self.max_key_bytes = self.store.max_key_bytes
        elif isinstance(storage, SharedMemoryStorage):
            self.zone = <SharedMemoryStorage>storage
            self.ns = self.zone.namespace(algorithm, self._rule, &self.p)
            self.seed = self.zone.seed_of(self.ns)
            self.max_key_bytes = self.zone.max_key_bytes
        else:
            # Any other storage (Redis runs the kernels in Lua; a user's runs
            # them through apply): the reference limiter is the glue.
            self.store = None
            self._fallback = _reference.LIMITERS[algorithm](
                limit, window_seconds, storage, clock, rule, burst=burst
            )
            self.max_key_bytes = getattr(storage, "max_key_bytes", MAX_KEY_BYTES)
            # A storage that runs the kernels itself is called directly for
            # single decisions: the checks stay in C, one Python call remains.
            self.kernel_run = storage.run_kernel if isinstance(storage, KernelStorage) else None
            # A storage that leases budget locally (TwoTierStorage) lets us
            # decide against the lease in C while the lease holds.
            hook = getattr(storage, "lease_book", None) if self.kernel_run is not None else None
            book = hook(cfg) if callable(hook) else None
            if isinstance(book, LeaseBook):
                self.book = <LeaseBook>book

    # -- properties ------------------------------------------------------------
    @property
    def limit(self):
        return self._config.limit

    @property
    def capacity(self):
        return self._config.capacity

    @property
    def window_seconds(self):
        return self._config.window_seconds

    @property
    def burst(self):
        return self._config.burst

    @property
    def rule(self):
        return self._rule

    @property
    def config(self):
        """The validated configuration (what a KernelStorage is given)."""
        return self._config

    @property
    def storage(self):
        return self._storage

    @property
    def clock(self):
        return self._clock

    # -- decisions -----------------------------------------------------------
    cdef inline double read_clock(self) except? -1.0:
        if self.system_clock:
            return nl_wall_now()
        return clock_value(self._clock.now())

    cdef Decision decide(self, object key, object cost, bint commit):
        cdef Verdict v
        cdef Py_ssize_t klen
        cdef const char* data
        cdef uint64_t h
        cdef int64_t units
        cdef double now = 0.0  # set below on either clock path; this quiets -Wmaybe-uninitialized
        cdef int status
        if self.store is None:
            if self.book is not None:
                return self.decide_leased(key, cost, commit)
            return self.decide_elsewhere(key, cost, commit)
        # The system clock first: its TSC read is ordered (it waits for every
        # earlier instruction), so work placed before it, such as the hash
        # below, would stall it (+3-4 ns measured). It cannot fail, so the
        # order of the checks' errors does not change.
        if self.system_clock:
            now = nl_wall_now()
        data = key_bytes(key, self.max_key_bytes, &klen)
        h = self.store.hash_key(self.seed, data, klen)
        # In a large table the index slot is a cache miss: start it now, so
        # it overlaps the cost check and the stripe lock (a hint: it reads
        # the stripe unlocked, and a stale address is harmless to prefetch).
        prefetch_slot(self.store.stripe_for(h), h)
        units = cost_value(cost, self.p.capacity)
        if not self.system_clock:
            now = clock_value(self._clock.now())
        status = self.store.decide(h, self.ns, data, klen, now, units, &self.p, commit, &v)
        if status != NL_OK:
            raise_status(status)
        return make_decision(&v, self.p.capacity, self._rule, self.p.window)

    cdef Decision decide_leased(self, object key, object cost, bint commit):
        """A TwoTierStorage: against the key's lease in C (``LeaseBook.decide``)
        while it holds, else the storage's ``run_kernel``. The checks come in
        ``decide``'s order (the system clock first: see there); the key is
        hashed early, to start its index entry's load under the cost check."""
        cdef Verdict v
        cdef Py_ssize_t klen
        cdef const char* data
        cdef uint64_t h
        cdef int64_t units
        cdef double now = 0.0
        if self.system_clock:
            now = nl_wall_now()
        data = key_bytes(key, self.max_key_bytes, &klen)
        h = self.book.hash(data, klen)
        self.book.prefetch(h)
        units = cost_value(cost, self.p.capacity)
        if type(key) is not str:    # a str subclass may compare in Python: not under the gate's lock
            return self.from_verdict(self.kernel_run(    # its characters, as the reference hands over
                self._config, str.__str__(key), units, None if self.system_clock else self.read_clock(), commit))
        if not self.system_clock:
            now = clock_value(self._clock.now())
        if lease_decide(self.book, key, data, klen, h, units, now, commit, &v):
            return make_decision(&v, self.p.capacity, self._rule, self.p.window)
        return self.from_verdict(self.kernel_run(self._config, key, units, now, commit))

    cdef Decision decide_elsewhere(self, object key, object cost, bint commit):
        """A storage other than InMemoryStorage and TwoTierStorage: a
        shared-memory zone, the storage's own kernels (KernelStorage), or the
        reference glue. Kept out of ``decide`` so the in-memory path stays
        compact."""
        cdef Py_ssize_t klen
        cdef int64_t units
        if self.zone is not None:
            return self.decide_zone(key, cost, commit)
        if self.kernel_run is None:
            return self.foreign(key, cost, commit)
        key_bytes(key, self.max_key_bytes, &klen)
        units = cost_value(cost, self.p.capacity)
        if type(key) is not str:    # its characters: the storage's dicts and key names must not see the subclass
            key = str.__str__(key)
        return self.from_verdict(self.kernel_run(
            self._config, key, units, None if self.system_clock else self.read_clock(), commit))

    cdef Decision decide_zone(self, object key, object cost, bint commit):
        """``decide`` on a shared-memory zone: the same checks, in C."""
        cdef Verdict v
        cdef Py_ssize_t klen
        cdef const char* data
        cdef int64_t units
        cdef double now = 0.0
        cdef int status
        if self.system_clock:
            now = nl_wall_now()
        data = key_bytes(key, self.max_key_bytes, &klen)
        units = cost_value(cost, self.p.capacity)
        if not self.system_clock:
            now = clock_value(self._clock.now())
        status = self.zone.decide(self.ns, self.seed, data, klen, now, units, &self.p, commit, &v)
        if status != NL_OK:
            raise_status(status)
        return make_decision(&v, self.p.capacity, self._rule, self.p.window)

    cdef Decision foreign(self, object key, object cost, bint commit):
        d = self._fallback.allow(key, cost) if commit else self._fallback.peek(key, cost)
        return Decision(d.allowed, d.limit, d.remaining, d.retry_after, d.reset_after,
                        d.rule, d.window, d.delay, d.degraded, d.reason, d.at)

    def allow(self, key, cost=1):
        """Decide one request and spend its cost if it passes."""
        return self.decide(key, cost, True)

    def peek(self, key, cost=1):
        """What ``allow`` would answer now, spending nothing and storing nothing."""
        return self.decide(key, cost, False)

    def allow_async(self, key, cost=1):
        """``await limiter.allow_async(key)``: awaits an async storage
        (``AsyncRedisStorage``); on any other it answers at once."""
        return decide_async(self, key, cost, True)

    def peek_async(self, key, cost=1):
        """``await limiter.peek_async(key)``: ``peek`` for async code."""
        return decide_async(self, key, cost, False)

    def refund(self, key, cost=1, *, at=None):
        """Give back ``cost`` units that an admitted decision made at ``at``
        (its ``Decision.at``; None: the key's latest decision) charged to
        ``key``: counting by response charges on entry, atomically, and
        refunds what the response says should not have counted.

        The log and the windows end exactly as if the charge was never made
        (a charge whose window has passed expired with it, and nothing is
        given back); the buckets and GCRA get the units back, which is exact
        unless the key refilled to full (went idle) in between. Never more
        than a fresh key's budget; a key the storage does not hold is left
        alone, not created.
        """
        cdef Py_ssize_t klen
        cdef const char* data
        cdef int64_t units
        cdef double now, stamp = 0.0
        cdef uint64_t h
        if self.store is None and self.zone is None:
            self._fallback.refund(key, cost, at=at)     # a KernelStorage's refund_kernel, or apply
            return
        data = key_bytes(key, self.max_key_bytes, &klen)
        units = cost_value(cost, self.p.capacity)
        at = check_at(at)
        if at is not None:
            stamp = at
        now = self.read_clock()
        if self.zone is not None:
            self.zone.refund(self.ns, self.seed, data, klen, now, units, stamp, at is None, &self.p)
            return
        h = self.store.hash_key(self.seed, data, klen)
        self.store.refund(h, self.ns, data, klen, now, units, stamp, at is None, &self.p)

    def refund_async(self, key, cost=1, *, at=None):
        """``await limiter.refund_async(key)``: awaits an async storage
        (``AsyncRedisStorage``); on any other it refunds at once."""
        return refund_async(self, key, cost, at)

    def _decision(self, verdict):
        """A Decision from a storage's KernelVerdict tuple."""
        return self.from_verdict(verdict)

    cdef Decision from_verdict(self, object verdict):
        """``_decision`` without a Python call: a KernelVerdict tuple of
        plain values read in C (anything else takes the general path)."""
        cdef Verdict v
        cdef Py_ssize_t n
        cdef Decision d
        if type(verdict) is not tuple or not 5 <= len(<tuple>verdict) <= 8 or not isfinite(verdict[1]):
            return Decision(verdict[0], self.p.capacity, max(0, floor(verdict[1])), verdict[2], verdict[3],
                            self._rule, self.p.window, verdict[4],
                            verdict[5] if len(verdict) > 5 else False,
                            verdict[6] if len(verdict) > 6 else "",
                            verdict[7] if len(verdict) > 7 else 0.0)
        n = len(<tuple>verdict)
        v.allowed = bool(verdict[0])
        v.remaining = verdict[1]
        v.retry_after = verdict[2]
        v.reset_after = verdict[3]
        v.delay = verdict[4]
        v.at = verdict[7] if n > 7 else 0.0     # the store's stamp of the decision (Redis)
        v.storage_full = False
        d = make_decision(&v, self.p.capacity, self._rule, self.p.window)
        if n > 5:
            d.degraded = bool(verdict[5])
        if n > 6:
            d.reason = str(verdict[6])
        return d

    def allow_many(self, keys, costs=None, *, times=None):
        """Decide a batch in order with the GIL released; every key and cost is
        checked before any is spent. Returns a :class:`BatchResult` of arrays.

        ``times`` (replays) gives each request its own clock reading instead
        of one reading for the batch; per key, time still never runs backwards.

        A batch is a sequence of decisions, not one (``allow_all`` is): if
        memory for a new key's state runs out part-way, ``MemoryError`` is
        raised and the requests before that one stay decided and charged.
        """
        # The batch borrows each key's bytes and decides with the GIL
        # released: it holds its own reference to every key (``held``), so
        # no other thread, clock, cost's __index__ or finalizer that runs
        # meanwhile can free one by emptying the caller's list. The lists are
        # indexed with bounds checks, as such code may also shrink them.
        cdef list key_list = keys if type(keys) is list else batch_keys(keys)     # one str is refused
        cdef list cost_list = None
        cdef list time_list = None
        cdef double* stamps = NULL
        cdef BatchBlock block
        cdef int carving
        cdef Py_ssize_t n = len(key_list)
        cdef Py_ssize_t i, done = 0, refused = 0, nheld = 0
        cdef const char** data
        cdef Py_ssize_t* sizes
        cdef int64_t* units
        cdef uint64_t* hashes
        cdef PyObject** held
        cdef uint8_t* storage_full
        cdef object key
        cdef dict reasons = None
        cdef array allowed, remaining, retry, reset, delay
        cdef double now
        cdef int status
        if self.store is None and self.zone is None:
            r = self._fallback.allow_many(key_list, costs, times=times)
            return BatchResult(Decision, r.limit, r.rule, r.window, r.allowed, r.remaining,
                               r.retry_after, r.reset_after, r.delay, r.degraded, r.reasons)
        if costs is not None:
            cost_list = costs if type(costs) is list else list(costs)
            if len(cost_list) != n:
                raise ValidationError(f"{n} keys but {len(cost_list)} costs")
        if times is not None:
            time_list = times if type(times) is list else list(times)
            if len(time_list) != n:
                raise ValidationError(f"{n} keys but {len(time_list)} times")
        batch_begin(&block, n)
        for carving in range(2):    # measure, then carve
            if carving:
                batch_alloc(&block)
            data = <const char**>batch_take(&block, sizeof(char*))
            sizes = <Py_ssize_t*>batch_take(&block, sizeof(Py_ssize_t))
            units = <int64_t*>batch_take(&block, sizeof(int64_t))
            hashes = <uint64_t*>batch_take(&block, sizeof(uint64_t))
            held = <PyObject**>batch_take(&block, sizeof(PyObject*))
            stamps = <double*>batch_take(&block, sizeof(double))       # used only with ``times``
            storage_full = <uint8_t*>batch_take(&block, sizeof(uint8_t))
        if time_list is None:
            stamps = NULL
        try:
            with cython.boundscheck(True):
                for i in range(n):
                    key = key_list[i]
                    data[i] = key_bytes(key, self.max_key_bytes, &sizes[i])
                    Py_INCREF(key)
                    held[i] = <PyObject*>key
                    nheld = i + 1
                    units[i] = 1 if costs is None else cost_value(cost_list[i], self.p.capacity)
                if time_list is not None:
                    for i in range(n):
                        stamps[i] = clock_value(time_list[i])
            if time_list is not None:
                now = 0.0
            else:
                now = self.read_clock()
            allowed = clone(_U8, n, False)
            remaining = clone(_I64, n, False)
            retry = clone(_F64, n, False)
            reset = clone(_F64, n, False)
            delay = clone(_F64, n, False)
            if self.zone is not None:
                self.zone.check_open()
                with nogil:
                    status = self.zone.decide_batch(
                        self.ns, self.seed, n, data, sizes, units, hashes, now, stamps, &self.p,
                        allowed.data.as_uchars, <int64_t*>remaining.data.as_longlongs, retry.data.as_doubles,
                        reset.data.as_doubles, delay.data.as_doubles, storage_full, &done, &refused)
            else:
                with nogil:
                    status = self.store.decide_batch(
                        self.ns, self.seed, n, data, sizes, units, hashes, now, stamps, &self.p,
                        allowed.data.as_uchars, <int64_t*>remaining.data.as_longlongs, retry.data.as_doubles,
                        reset.data.as_doubles, delay.data.as_doubles, storage_full, &done, &refused)
            if status == NL_OK and refused > 0:
                # which requests a bounded storage refused (no room for a new key)
                reasons = {i: REASON_STORAGE_FULL for i in range(n) if storage_full[i]}
        finally:
            for i in range(nheld):
                Py_DECREF(<object>held[i])
            free(block.base)
        if status != NL_OK:
            if status == NL_CORRUPT and self.zone is not None:
                self.zone.raise_corrupt("a stripe of this batch")     # repaired, its lock released
            raise_status(status)
        return BatchResult(Decision, self.p.capacity, self._rule, self.p.window,
                           allowed, remaining, retry, reset, delay, refused > 0, reasons)

    def reset(self, key):
        """Forget ``key``: its next request sees a full budget."""
        cdef Py_ssize_t klen
        cdef const char* data
        if self.zone is not None:
            data = key_bytes(key, self.max_key_bytes, &klen)
            self.zone.forget(self.ns, self.seed, data, klen)
            return
        if self.store is None:
            self._fallback.reset(key)
            return
        data = key_bytes(key, self.max_key_bytes, &klen)
        self.store.forget(self.ns, self.seed, data, klen)

    def state(self, key):
        """A snapshot of ``key``'s state, or ``None`` if the storage holds none."""
        cdef Py_ssize_t klen
        cdef const char* data
        if self.zone is not None:
            data = key_bytes(key, self.max_key_bytes, &klen)
            return self.zone.snapshot(self.ns, self.seed, data, klen, type(self).algorithm)
        if self.store is None:
            return self._fallback.state(key)
        data = key_bytes(key, self.max_key_bytes, &klen)
        return self.store.snapshot(self.ns, self.seed, data, klen, type(self).algorithm)

    def __repr__(self):
        cfg = self._config
        burst = "" if cfg.burst is None else f", burst={cfg.burst}"
        return f"{type(self).__name__}({cfg.limit}, {cfg.window_seconds!r}, rule={cfg.rule!r}{burst})"


cdef class TokenBucket(_Limiter):
    """Refills ``limit`` tokens per window up to ``burst`` (default ``limit``)."""

    algorithm = Algorithm.TOKEN_BUCKET


cdef class LeakyBucket(_Limiter):
    """A shaper: admitted work queues and drains at the rate; ``delay`` says how long to wait."""

    algorithm = Algorithm.LEAKY_BUCKET


cdef class FixedWindowCounter(_Limiter):
    """``limit`` per aligned window; cheap, but lets 2x through across a boundary."""

    algorithm = Algorithm.FIXED_WINDOW


cdef class SlidingWindowLog(_Limiter):
    """Exact: at most ``limit`` units in any trailing window, O(limit) memory per key."""

    algorithm = Algorithm.SLIDING_LOG


cdef class SlidingWindowCounter(_Limiter):
    """Approximates the sliding log with two counters per key."""

    algorithm = Algorithm.SLIDING_COUNTER


cdef class GCRA(_Limiter):
    """Generic cell rate algorithm: one integer per key, smooth spacing, burst tolerance."""

    algorithm = Algorithm.GCRA


LIMITERS = {
    cls.algorithm: cls
    for cls in (TokenBucket, LeakyBucket, FixedWindowCounter, SlidingWindowLog,
                SlidingWindowCounter, GCRA)
}

# Included by _core.pyx (one extension module, nanolimit._core): its cimports,
# imports and shared constants are in scope here.
#
# Two-tier leases (TwoTierStorage): the gate and each key's lease record,
# where a native limiter decides a request without leaving C.

# The hot window of one key's lease (TwoTierStorage): enough to decide a
# request in C exactly as the storage's Python path would.
ctypedef struct LeaseRecord:
    double last_now                 # the key's own time floor (docs/spec.md §4)
    int64_t window_index            # the window described below; LEASE_NONE: Python decides
    int64_t own                     # this instance's units in it (authoritative while loaded)
    int64_t ceiling                 # own + cost must stay <= ceiling: units pushed + the lease
    int64_t others                  # the other instances' units in it, as last read
    int64_t previous                # fleet units of the window before (sliding), else 0
    int64_t next_ceiling            # a later window's ceiling before any sync of it: ceil(L / N)
    int64_t prev_index              # a window C rolled away from, its units not yet pulled
    int64_t prev_own
    int64_t decisions               # committed here since the storage last pulled
    int64_t want                    # the largest cost refused for want of lease, not budget
    bint prev_pending
    bint committed                  # committed to since take_dirty (this key, not the slot's last)
    bint listed                     # its slot is in the book's dirty list

cdef int64_t LEASE_NONE = INT64_MIN


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
    cdef dict index                 # key -> slot
    cdef LeaseRecord* records
    cdef Py_ssize_t* dirty          # slots committed to since take_dirty; one entry each
    cdef Py_ssize_t dirty_len
    cdef Py_ssize_t used
    cdef Py_ssize_t allocated
    cdef list free_slots
    cdef list keys                  # slot -> key (None when free)
    cdef list owners                # slot -> what attach was given for it (the storage's track)
    cdef readonly int64_t limit
    cdef readonly double window
    cdef readonly bint sliding
    cdef readonly double sync_interval

    def __cinit__(self, LeaseGate gate not None, limit, window, sliding, sync_interval):
        self.gate = gate
        self.index = {}
        self.free_slots = []
        self.keys = []
        self.owners = []
        self.limit = limit
        self.window = window
        self.sliding = bool(sliding)
        self.sync_interval = sync_interval
        if not (1 <= self.limit and self.window > 0.0 and self.sync_interval > 0.0):
            raise ValidationError("LeaseBook needs limit >= 1, window > 0 and sync_interval > 0")
        if not MAX_TIME_C / self.window < 4.611686018427388e18:  # 2**62: window indexes fit int64
            raise ValidationError(f"LeaseBook window {self.window!r} is too short for int64 window indexes")

    def __dealloc__(self):
        free(self.records)
        free(self.dirty)

    cdef inline void check_closed(self) except *:
        if self.gate.is_open:
            raise RuntimeError("LeaseBook changed while its gate is open")

    cdef inline LeaseRecord* record(self, Py_ssize_t slot) except NULL:
        if not 0 <= slot < self.used:
            raise IndexError(f"lease slot {slot} out of range")
        return &self.records[slot]

    def attach(self, key, owner=None):
        """A slot for ``key`` (empty until ``load``); ``take_dirty`` hands
        ``owner`` back (the storage's own record of the key)."""
        cdef Py_ssize_t slot, size
        cdef LeaseRecord* grown
        cdef Py_ssize_t* grown_dirty
        cdef bint listed = False
        self.check_closed()
        if type(key) is not str:  # lookups run under the gate's spinlock: no Python __eq__
            raise TypeError(f"LeaseBook keys are str, not {type(key).__name__}")
        if key in self.index:
            return self.index[key]
        if self.free_slots:
            slot = self.free_slots.pop()
            listed = self.records[slot].listed  # still in the dirty list: stays there once,
            # reported only if the new key is committed to
            self.keys[slot] = key
            self.owners[slot] = owner
        else:
            if self.used == self.allocated:
                size = self.allocated * 2 + 16
                grown = <LeaseRecord*>realloc(self.records, <size_t>size * sizeof(LeaseRecord))
                if grown == NULL:
                    raise MemoryError()
                self.records = grown
                # the dirty list holds each slot at most once: it never outgrows the records
                grown_dirty = <Py_ssize_t*>realloc(self.dirty, <size_t>size * sizeof(Py_ssize_t))
                if grown_dirty == NULL:
                    raise MemoryError()
                self.dirty = grown_dirty
                self.allocated = size
            slot = self.used
            self.used += 1
            self.keys.append(key)
            self.owners.append(owner)
        memset(&self.records[slot], 0, sizeof(LeaseRecord))
        self.records[slot].window_index = LEASE_NONE
        self.records[slot].listed = listed
        self.index[key] = slot
        return slot

    def detach(self, key):
        self.check_closed()
        slot = self.index.pop(key, None)
        if slot is not None:
            self.records[<Py_ssize_t>slot].window_index = LEASE_NONE
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

    def pull(self, Py_ssize_t slot):
        """``(window_index or None, own units, last_now, committed decisions,
        rolled-away window or None, its own units, largest cost refused for
        want of lease)``: what C decided since the last pull. The decision
        count and the wanted cost restart from zero."""
        self.check_closed()
        cdef LeaseRecord* r = self.record(slot)
        cdef int64_t n = r.decisions
        cdef int64_t want = r.want
        cdef bint rolled = r.prev_pending
        r.decisions = 0
        r.want = 0
        r.prev_pending = False
        return (None if r.window_index == LEASE_NONE else r.window_index, r.own, r.last_now, n,
                r.prev_index if rolled else None, r.prev_own if rolled else 0, want)

    def load(self, Py_ssize_t slot, int64_t window_index, int64_t own, int64_t ceiling,
             int64_t others, int64_t previous, double last_now, int64_t next_ceiling):
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

    def __len__(self):
        return len(self.index)

    cdef int decide(self, object key, int64_t cost, double now, bint commit, Verdict* v) except -1:
        """1 when decided here (``v`` filled), 0 when the Python path must.
        Mirrors ``TwoTierStorage._decide`` operation for operation."""
        cdef LeaseGate gate = self.gate
        cdef PyObject* found
        cdef LeaseRecord* r
        cdef int64_t k, current, previous, own, ceiling, others
        cdef double start, weight, estimate, reset_after, retry_after, end, room
        cdef bint fits, ok, rolls = False, wake = False
        nl_lock_spin(&gate.lock)
        if not gate.is_open:
            nl_unlock(&gate.lock)
            return 0
        found = PyDict_GetItem(self.index, key)
        if found == NULL:
            nl_unlock(&gate.lock)
            return 0
        r = &self.records[PyLong_AsSsize_t(<object>found)]
        if r.last_now > now:
            now = r.last_now
        k = nl_floor_i64(now / self.window)
        if k == r.window_index:
            own = r.own
            ceiling = r.ceiling
            others = r.others
            previous = r.previous
        elif k > r.window_index != LEASE_NONE and not r.prev_pending:
            # a later window, not yet synced: nobody's units seen, the default
            # share; the window just left is the sliding estimate's previous
            rolls = True
            own = 0
            ceiling = r.next_ceiling
            others = 0
            previous = r.others + r.own if (self.sliding and k == r.window_index + 1) else 0
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
                    self.dirty[self.dirty_len] = r - self.records
                    self.dirty_len += 1
            if rolls:  # keep the left window's units for the sync until pulled
                r.prev_index = r.window_index
                r.prev_own = r.own
                r.prev_pending = True
                r.window_index = k
                r.own = 0
                r.ceiling = ceiling
                r.others = 0
                r.previous = previous
        start = <double>k * self.window
        current = others + own
        weight = 1.0 - (now - start) / self.window
        estimate = <double>previous * weight + <double>current
        fits = estimate + <double>cost <= <double>self.limit
        ok = fits and own <= ceiling - cost
        if fits and not ok:
            if commit and cost > r.want:
                r.want = cost           # the next sync asks a lease this big (a cost above ceil(L/N))
            gate.early += 1
            if not gate.wake_pending:
                gate.wake_pending = True
                wake = True
        end = start + self.window - now
        reset_after = end if (current > 0 or previous > 0) else 0.0
        if current > 0 and self.sliding:
            reset_after = start + 2 * self.window - now
        v.storage_full = False
        v.delay = 0.0
        v.at = now                      # the key's time, as TwoTierStorage._judge says it
        v.allowed = ok
        if ok:
            if commit:
                r.own += cost
            v.remaining = <double>self.limit - estimate - <double>cost
            v.retry_after = 0.0
            v.reset_after = end if end > reset_after else reset_after
        else:
            retry_after = end
            if fits:
                if self.sync_interval < retry_after:
                    retry_after = self.sync_interval
            elif self.sliding and previous > 0:
                room = <double>(self.limit - current - cost)
                if room >= 0:
                    retry_after = start + self.window * (1 - room / <double>previous) - now
            v.remaining = <double>self.limit - estimate
            v.retry_after = retry_after if retry_after > 0.0 else 0.0
            v.reset_after = reset_after
        nl_unlock(&gate.lock)
        if wake:
            gate.wake()
        return 1

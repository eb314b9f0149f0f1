# cython: language_level=3, cdivision=True
# Fixed-layout C types shared by every native module: per-key state, the
# table entry, the limiter parameters and a kernel's verdict.

from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t


cdef extern from "_native.h" nogil:
    uint64_t nl_mum(uint64_t a, uint64_t b)
    void nl_set_secrets(uint64_t k0, uint64_t s1, uint64_t s2)
    uint64_t nl_namespace_seed(uint32_t ns)
    uint64_t nl_hash_seeded(uint64_t seed, const char* key, size_t n)
    uint64_t nl_hash(uint64_t seed, uint64_t s1, uint64_t s2, const char* key, size_t n)
    bint nl_trylock(uint8_t* lock)
    void nl_lock_spin(uint8_t* lock)
    void nl_unlock(uint8_t* lock)
    double nl_wall_now()
    int64_t nl_floordiv(int64_t a, int64_t b)
    int64_t nl_floor_i64(double x)
    void nl_prefetch(const void* p)
    bint nl_key_equal(const char* a, const char* b, uint32_t n)
    const void* nl_load_pointer_relaxed(const void* const* p)
    uint32_t nl_load_u32_relaxed(const uint32_t* p)
    void nl_add_u64_relaxed(uint64_t* p, uint64_t v)
    uint64_t nl_load_u64_relaxed(const uint64_t* p)
    uint64_t nl_fetch_add_u64(uint64_t* p, uint64_t v)
    void nl_fence()
    uint64_t nl_load_u64_seq(const uint64_t* p)
    bint nl_cas_u64(uint64_t* p, uint64_t expected, uint64_t desired)
    void nl_store_pointer_release(void** p, void* v)
    const void* nl_load_pointer_acquire(const void* const* p)


# Algorithm ids; 0 is the generic ``apply`` namespace (a Python object per key).
cdef enum:
    ALG_APPLY = 0
    ALG_TOKEN_BUCKET = 1
    ALG_LEAKY_BUCKET = 2
    ALG_FIXED_WINDOW = 3
    ALG_SLIDING_LOG = 4
    ALG_SLIDING_COUNTER = 5
    ALG_GCRA = 6

# Status codes: kernels and the table never raise; wrappers turn these into
# exceptions after the stripe lock is released.
cdef enum:
    NL_OK = 0
    NL_NOMEM = -1
    NL_TABLE_FULL = -2
    NL_REENTRANT = -3               # apply() called inside a mutate (apply's own check)
    NL_CORRUPT = -4                 # a shared-memory zone's stripe held what cannot be (_zone.pxd)

# Keys up to this many UTF-8 bytes live inside the entry; longer ones on the heap.
cdef enum:
    INLINE_KEY_BYTES = 16


ctypedef struct BucketState:        # token bucket, leaky bucket
    double level

ctypedef struct WindowState:        # fixed window, sliding window counter
    int64_t index
    uint32_t count                  # capacities are below 2**32 (MAX_LIMIT)
    uint32_t previous

ctypedef struct GcraState:
    int64_t tat                     # theoretical arrival time, integer µs

ctypedef struct LogState:           # sliding log: ring buffer, oldest at head
    double* ring                    # its size is stored just before it (log_ring_size)
    uint32_t head
    uint32_t length

ctypedef struct ZoneLog:            # LogState in a shared-memory zone: the ring as an arena offset
    uint64_t ring
    uint32_t head
    uint32_t length

ctypedef struct ApplyState:         # apply(): ``obj`` is KeyState.obj
    void* obj
    uint32_t busy                   # its mutate is running: evict_idle leaves it

ctypedef union KeyState:
    BucketState bucket
    WindowState window
    GcraState gcra
    LogState log
    ZoneLog zone_log                # the same log, in a shared-memory zone (_zone.pxd)
    void* obj                       # ALG_APPLY: an owned PyObject*
    ApplyState apply                # ALG_APPLY: the same object and its busy flag

ctypedef union KeyBytes:
    char short_key[16]
    char* long_key

# 48 bytes a key. The hash is not stored: the index slot keeps 8 bits of it,
# and the rare paths that need all of it (rehash, deletion) recompute it.
ctypedef struct Entry:
    double updated_at               # the key's own monotonic time (docs/spec.md §4)
    uint32_t key_len
    uint32_t ns                     # namespace: (algorithm, rule) of the owner
    KeyBytes key
    KeyState state

ctypedef struct Params:
    int algorithm
    int64_t capacity
    double capacity_f
    double rate
    double window
    int64_t interval_us             # GCRA emission interval T
    int64_t tolerance_us            # GCRA tau = T * capacity

ctypedef struct Verdict:
    bint allowed
    bint storage_full               # denied because a bounded table had no room
    double remaining                # before max(0, floor(.))
    double retry_after
    double reset_after
    double delay
    double at                       # the key's time the decision was made at (Decision.at)

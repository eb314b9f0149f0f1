# cython: language_level=3, cdivision=True
# Fixed-layout C types shared by every native module: per-key state, the
# table entry, the limiter parameters and a kernel's verdict; and the one
# allocator of a batch's arrays (BatchBlock).

from libc.stdint cimport SIZE_MAX, int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport malloc


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


# ---------------------------------------------------------------- a batch's arrays
#
# A batch (allow_many, allow_all) keeps a few arrays of one row per request:
# one malloc, carved. The caller lists its arrays once, in a loop that runs
# twice: the first pass measures, the second carves the block then allocated.
#
#     batch_begin(&block, n)
#     for carving in range(2):
#         if carving:
#             batch_alloc(&block)
#         verdicts = <Verdict*>batch_take(&block, sizeof(Verdict))
#         keys = <const char**>batch_take(&block, sizeof(char*))
#     try: ... finally: free(block.base)
#
# Each array starts at its item's alignment (the largest power of two that
# divides its size, which the C alignment of a type always divides; at most
# malloc's 16), so any order is correct; listing the widest first leaves no
# padding. A batch of none is given one row: malloc never sees 0, so NULL is
# only ever out of memory, and an array of a batch of none can be passed on.

ctypedef struct BatchBlock:
    char* base                      # the block: NULL until the second pass
    size_t rows                     # items per array (n, or 1 for a batch of none)
    size_t size                     # bytes laid out so far
    bint overflow                   # the block would not fit in a size_t


cdef inline void batch_begin(BatchBlock* b, Py_ssize_t n) noexcept nogil:
    b.base = NULL
    b.rows = <size_t>n if n > 0 else 1
    b.size = 0
    b.overflow = False


cdef inline int batch_alloc(BatchBlock* b) except -1:
    """Allocate the block the first pass measured; the second then carves
    it. MemoryError when it cannot be had (nothing is then left to free)."""
    if b.overflow:
        raise MemoryError()
    b.base = <char*>malloc(b.size)
    if b.base == NULL:
        raise MemoryError()
    b.size = 0
    return 0


cdef inline void* batch_take(BatchBlock* b, size_t item) noexcept nogil:
    """The next array, of ``rows`` items of ``item`` bytes (NULL in the
    measuring pass)."""
    cdef size_t align = item & (~item + 1)
    cdef size_t offset
    if align > 16:
        align = 16
    offset = (b.size + align - 1) & ~(align - 1)
    if offset < b.size or item > (SIZE_MAX - offset) // b.rows:
        b.overflow = True
        return NULL
    b.size = offset + item * b.rows
    if b.base == NULL:
        return NULL
    return b.base + offset


/* Small portable C helpers for the native core: a seeded hash, a byte-sized
 * stripe lock, the wall clock, integer floor division, key equality, and the
 * atomics and prefetch hints of the lock-free counters and batch readers.
 * Header-only so the Cython kernels inline them. */
#ifndef NANOLIMIT_NATIVE_H
#define NANOLIMIT_NATIVE_H

#include <stdint.h>
#include <stddef.h>
#include <string.h>

#ifdef _WIN32
#  ifndef WIN32_LEAN_AND_MEAN
#    define WIN32_LEAN_AND_MEAN
#  endif
#  include <windows.h>
#  include <intrin.h>
#else
#  include <time.h>
#  include <sched.h>
#endif

/* ------------------------------------------------------------------------
 * Seeded multiply-mix hash in the style of wyhash (the construction Go's
 * runtime map hash also uses): about 25 instructions for a short key, against
 * ~100 for SipHash-1-3. The secrets come from os.urandom at import, so keys
 * chosen offline cannot be made to collide; the known weakness of this family
 * (an input word equal to the secret zeroes a product) needs the secret. */

static inline uint64_t nl_mum(uint64_t a, uint64_t b)
{
#if defined(__SIZEOF_INT128__)
    __uint128_t r = (__uint128_t)a * b;
    return (uint64_t)r ^ (uint64_t)(r >> 64);
#elif defined(_MSC_VER) && defined(_M_X64)
    uint64_t hi;
    uint64_t lo = _umul128(a, b, &hi);
    return lo ^ hi;
#else
    uint64_t ha = a >> 32, hb = b >> 32, la = (uint32_t)a, lb = (uint32_t)b;
    uint64_t rh = ha * hb, rm0 = ha * lb, rm1 = hb * la, rl = la * lb;
    uint64_t t = rl + (rm0 << 32);
    uint64_t c = t < rl;
    uint64_t lo = t + (rm1 << 32);
    c += lo < t;
    uint64_t hi = rh + (rm0 >> 32) + (rm1 >> 32) + c;
    return lo ^ hi;
#endif
}

static inline uint64_t nl_read64(const unsigned char *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static inline uint64_t nl_read32(const unsigned char *p) { uint32_t v; memcpy(&v, p, 4); return v; }

/* seed: per namespace and per process; s1, s2: per-process secrets (odd). */
static inline uint64_t nl_hash(uint64_t seed, uint64_t s1, uint64_t s2, const char *data, size_t len)
{
    const unsigned char *p = (const unsigned char *)data;
    uint64_t a, b;
    if (len <= 16) {
        if (len >= 4) {
            size_t shift = (len >> 3) << 2;
            a = (nl_read32(p) << 32) | nl_read32(p + shift);
            b = (nl_read32(p + len - 4) << 32) | nl_read32(p + len - 4 - shift);
        } else if (len > 0) {
            a = ((uint64_t)p[0] << 16) | ((uint64_t)p[len >> 1] << 8) | p[len - 1];
            b = 0;
        } else {
            a = b = 0;
        }
    } else {
        size_t i = len;
        if (i > 48) {
            uint64_t see1 = seed, see2 = seed;
            do {
                seed = nl_mum(nl_read64(p) ^ s1, nl_read64(p + 8) ^ seed);
                see1 = nl_mum(nl_read64(p + 16) ^ s2, nl_read64(p + 24) ^ see1);
                see2 = nl_mum(nl_read64(p + 32) ^ s1 ^ s2, nl_read64(p + 40) ^ see2);
                p += 48;
                i -= 48;
            } while (i > 48);
            seed ^= see1 ^ see2;
        }
        while (i > 16) {
            seed = nl_mum(nl_read64(p) ^ s1, nl_read64(p + 8) ^ seed);
            i -= 16;
            p += 16;
        }
        a = nl_read64(p + i - 16);
        b = nl_read64(p + i - 8);
    }
    return nl_mum(s1 ^ (uint64_t)len, nl_mum(a ^ s1, b ^ seed));
}

/* The per-process secrets, set once at import (nl_set_secrets) from
 * os.urandom. Static: only the one extension module includes this header. */
static uint64_t nl_secret_k0 = 0;
static uint64_t nl_secret_s1 = 1;
static uint64_t nl_secret_s2 = 1;

static inline void nl_set_secrets(uint64_t k0, uint64_t s1, uint64_t s2)
{
    nl_secret_k0 = k0;
    nl_secret_s1 = s1 | 1;
    nl_secret_s2 = s2 | 1;
}

/* Each namespace (rule and algorithm) hashes under its own seed, so equal
 * strings under two rules land in unrelated slots. */
static inline uint64_t nl_namespace_seed(uint32_t ns)
{
    return nl_mum(nl_secret_k0 ^ (uint64_t)ns, nl_secret_s1 ^ 0x9E3779B97F4A7C15ULL);
}

static inline uint64_t nl_hash_seeded(uint64_t seed, const char *key, size_t len)
{
    return nl_hash(seed, nl_secret_s1, nl_secret_s2, key, len);
}

/* ------------------------------------------------------------------------
 * Stripe lock: one byte, test-and-set. Critical sections are tens of
 * nanoseconds, so a contended waiter spins briefly and then yields its core.
 * Callers holding the GIL try once and release the GIL before spinning; no
 * Python code runs while a stripe lock is held (apply runs its mutate unlocked). */

static inline void nl_cpu_relax(void)
{
#if defined(_MSC_VER)
    YieldProcessor();
#elif defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline void nl_yield_thread(void)
{
#ifdef _WIN32
    SwitchToThread();
#else
    sched_yield();
#endif
}

static inline int nl_trylock(uint8_t *lock)
{
#if defined(_MSC_VER)
    return _InterlockedExchange8((volatile char *)lock, 1) == 0;
#else
    return !__atomic_test_and_set(lock, __ATOMIC_ACQUIRE);
#endif
}

static inline int nl_is_locked(uint8_t *lock)
{
#if defined(_MSC_VER)
    return *(volatile uint8_t *)lock != 0;
#else
    return __atomic_load_n(lock, __ATOMIC_RELAXED) != 0;
#endif
}

static inline void nl_unlock(uint8_t *lock)
{
#if defined(_MSC_VER)
    _InterlockedExchange8((volatile char *)lock, 0);
#else
    __atomic_clear(lock, __ATOMIC_RELEASE);
#endif
}

static inline void nl_lock_spin(uint8_t *lock)
{
    unsigned spins = 0;
    for (;;) {
        if (!nl_is_locked(lock) && nl_trylock(lock)) {
            return;
        }
        if (++spins < 64) {
            nl_cpu_relax();
        } else {
            nl_yield_thread();
        }
    }
}

/* ------------------------------------------------------------------------
 * Wall clock in seconds, computed the way CPython's time.time() is: integer
 * nanoseconds, then one division. */

static inline double nl_wall_now(void)
{
#ifdef _WIN32
    FILETIME ft;
    ULARGE_INTEGER t;
    GetSystemTimePreciseAsFileTime(&ft);
    t.LowPart = ft.dwLowDateTime;
    t.HighPart = ft.dwHighDateTime;
    /* 100 ns ticks since 1601 -> ns since 1970 */
    return (double)((int64_t)(t.QuadPart - 116444736000000000ULL) * 100) / 1e9;
#else
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)((int64_t)ts.tv_sec * 1000000000LL + (int64_t)ts.tv_nsec) / 1e9;
#endif
}

/* floor(x) as an int64 without a libm call (x86-64's baseline has no
 * roundsd, so floor() is a call through the PLT). Exact for |x| < 2^63,
 * the same domain the cast of floor() needs: above 2^52 every double is an
 * integer and the cast is exact; below, truncation is corrected by one. */
static inline int64_t nl_floor_i64(double x)
{
    int64_t t = (int64_t)x;
    return t - ((double)t > x);
}

/* Python's // for int64 (rounds toward minus infinity). */
static inline int64_t nl_floordiv(int64_t a, int64_t b)
{
    int64_t q = a / b;
    if ((a % b != 0) && ((a < 0) != (b < 0))) {
        q -= 1;
    }
    return q;
}

/* Key equality for the probe loop: short keys (the common case) compare as
 * two overlapping words instead of a call to memcmp. */
static inline int nl_key_equal(const char *a, const char *b, uint32_t n)
{
    if (n >= 8 && n <= 16) {
        uint64_t a0, b0, a1, b1;
        memcpy(&a0, a, 8);
        memcpy(&b0, b, 8);
        memcpy(&a1, a + n - 8, 8);
        memcpy(&b1, b + n - 8, 8);
        return a0 == b0 && a1 == b1;
    }
    if (n >= 4 && n < 8) {
        uint32_t a0, b0, a1, b1;
        memcpy(&a0, a, 4);
        memcpy(&b0, b, 4);
        memcpy(&a1, a + n - 4, 4);
        memcpy(&b1, b + n - 4, 4);
        return a0 == b0 && a1 == b1;
    }
    return memcmp(a, b, n) == 0;
}

/* A racy read used only to choose what to prefetch: never dereferenced. */
static inline const void *nl_load_pointer_relaxed(const void *const *p)
{
#if defined(_MSC_VER)
    return *(const void *const volatile *)p;
#else
    return __atomic_load_n(p, __ATOMIC_RELAXED);
#endif
}

static inline uint32_t nl_load_u32_relaxed(const uint32_t *p)
{
#if defined(_MSC_VER)
    return *(const volatile uint32_t *)p;
#else
    return __atomic_load_n(p, __ATOMIC_RELAXED);
#endif
}

/* Counters shared by threads that need no lock (free-threaded builds too). */
static inline void nl_add_u64_relaxed(uint64_t *p, uint64_t v)
{
#if defined(_MSC_VER)
    _InterlockedExchangeAdd64((volatile long long *)p, (long long)v);
#else
    __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
#endif
}

static inline uint64_t nl_load_u64_relaxed(const uint64_t *p)
{
#if defined(_MSC_VER)
    return *(const volatile uint64_t *)p;
#else
    return __atomic_load_n(p, __ATOMIC_RELAXED);
#endif
}

/* The count of batches reading a storage's index blocks without locks, and
   the fence that orders a replaced index against it (see _table.pxd). */
static inline uint64_t nl_fetch_add_u64(uint64_t *p, uint64_t v)
{
#if defined(_MSC_VER)
    return (uint64_t)_InterlockedExchangeAdd64((volatile long long *)p, (long long)v);
#else
    return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
#endif
}

static inline void nl_fence(void)
{
#if defined(_MSC_VER)
    MemoryBarrier();
#else
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
}

static inline uint64_t nl_load_u64_seq(const uint64_t *p)
{
#if defined(_MSC_VER)
    uint64_t v;
    MemoryBarrier();
    v = *(const volatile uint64_t *)p;
    MemoryBarrier();
    return v;
#else
    return __atomic_load_n(p, __ATOMIC_SEQ_CST);
#endif
}

/* 1 if *p held expected and now holds desired. */
static inline int nl_cas_u64(uint64_t *p, uint64_t expected, uint64_t desired)
{
#if defined(_MSC_VER)
    return (uint64_t)_InterlockedCompareExchange64((volatile long long *)p, (long long)desired,
                                                   (long long)expected) == expected;
#else
    return __atomic_compare_exchange_n(p, &expected, desired, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
#endif
}

/* Publishing a block that readers without the lock may follow: its
   contents (written before) are visible before the pointer is. */
static inline void nl_store_pointer_release(void **p, void *v)
{
#if defined(_MSC_VER)
    _ReadWriteBarrier();
    *(void *volatile *)p = v;
#else
    __atomic_store_n(p, v, __ATOMIC_RELEASE);
#endif
}

static inline const void *nl_load_pointer_acquire(const void *const *p)
{
#if defined(_MSC_VER)
    const void *v = *(const void *const volatile *)p;
    _ReadWriteBarrier();
    return v;
#else
    return __atomic_load_n(p, __ATOMIC_ACQUIRE);
#endif
}

static inline void nl_prefetch(const void *p)
{
#if defined(__GNUC__) || defined(__clang__)
    __builtin_prefetch(p, 1, 3);
#else
    (void)p;
#endif
}

#endif /* NANOLIMIT_NATIVE_H */

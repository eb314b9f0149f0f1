/* Small portable C helpers for the native core: a seeded hash, a byte-sized
 * stripe lock, the wall clock and integer floor division. Header-only so the
 * Cython kernels inline them. */
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
 * SipHash-1-3 (the keyed hash CPython uses for str), 64-bit output. Keyed
 * with random bytes per process, so nobody outside can pick colliding keys. */

#define NL_ROTL(x, b) (uint64_t)(((x) << (b)) | ((x) >> (64 - (b))))
#define NL_SIPROUND                                                    \
    do {                                                               \
        v0 += v1; v1 = NL_ROTL(v1, 13); v1 ^= v0; v0 = NL_ROTL(v0, 32); \
        v2 += v3; v3 = NL_ROTL(v3, 16); v3 ^= v2;                      \
        v0 += v3; v3 = NL_ROTL(v3, 21); v3 ^= v0;                      \
        v2 += v1; v1 = NL_ROTL(v1, 17); v1 ^= v2; v2 = NL_ROTL(v2, 32); \
    } while (0)

static inline uint64_t nl_siphash13(uint64_t k0, uint64_t k1, const char *data, size_t len)
{
    const unsigned char *in = (const unsigned char *)data;
    uint64_t v0 = 0x736f6d6570736575ULL ^ k0;
    uint64_t v1 = 0x646f72616e646f6dULL ^ k1;
    uint64_t v2 = 0x6c7967656e657261ULL ^ k0;
    uint64_t v3 = 0x7465646279746573ULL ^ k1;
    uint64_t b = ((uint64_t)len) << 56;
    const unsigned char *end = in + (len - (len & 7));
    uint64_t m;

    for (; in != end; in += 8) {
        memcpy(&m, in, 8); /* native byte order: the hash never leaves the process */
        v3 ^= m;
        NL_SIPROUND;
        v0 ^= m;
    }
    switch (len & 7) {
    case 7: b |= ((uint64_t)in[6]) << 48; /* fall through */
    case 6: b |= ((uint64_t)in[5]) << 40; /* fall through */
    case 5: b |= ((uint64_t)in[4]) << 32; /* fall through */
    case 4: b |= ((uint64_t)in[3]) << 24; /* fall through */
    case 3: b |= ((uint64_t)in[2]) << 16; /* fall through */
    case 2: b |= ((uint64_t)in[1]) << 8;  /* fall through */
    case 1: b |= ((uint64_t)in[0]);       /* fall through */
    default: break;
    }
    v3 ^= b;
    NL_SIPROUND;
    v0 ^= b;
    v2 ^= 0xff;
    NL_SIPROUND;
    NL_SIPROUND;
    NL_SIPROUND;
    return v0 ^ v1 ^ v2 ^ v3;
}

/* ------------------------------------------------------------------------
 * Stripe lock: one byte, test-and-set. Critical sections are tens of
 * nanoseconds, so a contended waiter spins briefly and then yields its core.
 * Callers holding the GIL try once and release the GIL before spinning. */

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

/* Python's // for int64 (rounds toward minus infinity). */
static inline int64_t nl_floordiv(int64_t a, int64_t b)
{
    int64_t q = a / b;
    if ((a % b != 0) && ((a < 0) != (b < 0))) {
        q -= 1;
    }
    return q;
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

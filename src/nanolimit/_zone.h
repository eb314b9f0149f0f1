/* The operating-system side of the shared-memory zone (SharedMemoryStorage):
 * named POSIX segments, the identity of a process (pid and start time, so a
 * reused pid is not taken for a live owner), locks that a waiter can take
 * over from a dead owner, and SipHash-2-4-128 for keys too long to store.
 * Windows has no POSIX shared memory: there every call reports ENOSYS and
 * the storage refuses to start with a clear message. */
#ifndef NANOLIMIT_ZONE_H
#define NANOLIMIT_ZONE_H

#include <stdint.h>
#include <stddef.h>
#include <string.h>
#include <errno.h>
#include "_native.h"

#ifndef _WIN32
#  include <fcntl.h>
#  include <signal.h>
#  include <stdio.h>
#  include <stdlib.h>
#  include <sys/mman.h>
#  include <sys/stat.h>
#  include <sys/types.h>
#  include <time.h>
#  include <unistd.h>
#endif

/* ------------------------------------------------------------------------
 * Segments. nlz_open returns 0 and fills base and mapped, or an errno. With
 * create, the segment is made with O_EXCL (EEXIST if it is there) and its
 * space is reserved (posix_fallocate on Linux), so a /dev/shm too small for
 * it fails here with ENOSPC instead of a SIGBUS on a later first touch.
 * ident gets the identity of the segment opened (its inode; also for
 * EAGAIN), which nlz_unlink_if compares with what the name names now.
 * Attaching refuses (NLZ_EFOREIGN) a segment another user owns, or that
 * its group or others may open: /dev/shm is writable by every user, so a
 * name can be made first by anyone, who could then read and set budgets. */

#define NLZ_EFOREIGN (-1000)

#ifdef _WIN32
static inline int nlz_supported(void) { return 0; }
static inline int nlz_open(const char *name, int create, uint64_t size, uint64_t token,
                           void **base, uint64_t *mapped, uint64_t *ident)
{ (void)name; (void)create; (void)size; (void)token; *base = NULL; *mapped = 0; *ident = 0; return ENOSYS; }
static inline int nlz_unlink_if(const char *name, uint64_t ident) { (void)name; (void)ident; return ENOSYS; }
static inline uint64_t nlz_pid_namespace(void) { return 0; }
static inline int nlz_unmap(void *base, uint64_t size) { (void)base; (void)size; return ENOSYS; }
static inline int nlz_unlink(const char *name) { (void)name; return ENOSYS; }
static inline uint64_t nlz_self_token(void) { return 1; }
static inline void nlz_refresh_identity(void) {}
static inline int nlz_token_alive(uint64_t token) { (void)token; return 1; }
static inline int nlz_pid_alive(uint32_t pid) { (void)pid; return 1; }
static inline uint32_t nlz_pid(void) { return 1; }
static inline double nlz_monotonic(void) { return nl_wall_now(); }
#else
/* Seconds of a clock that never jumps: the lifecycle's deadlines. */
static inline double nlz_monotonic(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static inline int nlz_supported(void) { return 1; }

static inline uint64_t nlz_ident_of(const struct stat *st)
{
    return (uint64_t)st->st_ino ^ ((uint64_t)st->st_dev << 48);
}

static inline int nlz_open(const char *name, int create, uint64_t size, uint64_t token,
                           void **base, uint64_t *mapped, uint64_t *ident)
{
    int fd, err = 0;
    struct stat st;
    void *p;
    *base = NULL;
    *mapped = 0;
    *ident = 0;
    fd = shm_open(name, create ? (O_RDWR | O_CREAT | O_EXCL) : O_RDWR, 0600);
    if (fd < 0) {
        return errno;
    }
    if (fstat(fd, &st) != 0) {
        err = errno;
        close(fd);
        if (create) {
            shm_unlink(name);
        }
        return err;
    }
    *ident = nlz_ident_of(&st);
    if (!create && (st.st_uid != geteuid() || (st.st_mode & 077) != 0)) {
        close(fd);
        return NLZ_EFOREIGN;
    }
    if (create) {
        if (ftruncate(fd, (off_t)size) != 0) {
            err = errno;
        }
#if defined(__linux__)
        /* the creator's token (ZoneHeader.creator_token) before the long
           reservation: an attacher waits for a live creator, however big
           the zone, and starts over only when it is dead (elsewhere there
           is no reservation, and the token is stored through the mapping,
           below: macOS cannot write a shared-memory object with pwrite) */
        if (err == 0 && pwrite(fd, &token, sizeof token, 16) != (ssize_t)sizeof token) {
            err = errno ? errno : EIO;
        }
        if (err == 0) {
            err = posix_fallocate(fd, 0, (off_t)size);
        }
#endif
        if (err != 0) {
            close(fd);
            shm_unlink(name);
            return err;
        }
    } else {
        size = (uint64_t)st.st_size;
        if (size == 0) {
            close(fd);
            return EAGAIN;      /* created, not sized yet */
        }
    }
    p = mmap(NULL, (size_t)size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    err = errno;
    close(fd);
    if (p == MAP_FAILED) {
        if (create) {
            shm_unlink(name);
        }
        return err;
    }
#if !defined(__linux__)
    if (create) {
        memcpy((char *)p + 16, &token, sizeof token);
    }
#endif
    *base = p;
    *mapped = size;
    return 0;
}

static inline int nlz_unmap(void *base, uint64_t size)
{
    return munmap(base, (size_t)size) == 0 ? 0 : errno;
}

static inline int nlz_unlink(const char *name)
{
    return shm_unlink(name) == 0 ? 0 : errno;
}

/* Remove the name only while it still names the segment ``ident`` (from
 * nlz_open): 0, ESTALE when it names another segment now (a newer zone made
 * under the same name: left alone), ENOENT when it names none. The check
 * and the unlink are two calls; callers that remove a name they did not
 * make hold the old segment's registry lock across both, as every such
 * remover does, so no other remover can swap the name between them. */
static inline int nlz_unlink_if(const char *name, uint64_t ident)
{
    struct stat st;
    int fd = shm_open(name, O_RDONLY, 0);
    if (fd < 0) {
        return errno;
    }
    if (fstat(fd, &st) != 0) {
        int err = errno;
        close(fd);
        return err;
    }
    close(fd);
    if (nlz_ident_of(&st) != ident) {
        return ESTALE;
    }
    return shm_unlink(name) == 0 ? 0 : errno;
}

/* ------------------------------------------------------------------------
 * Who holds a lock: a 64-bit token, the pid in the high half and a digest
 * of the process's start time in the low half (never 0). A token whose pid
 * is gone, or whose pid now belongs to a process started at another time,
 * names a dead owner. */

static uint64_t nlz_token = 0;
static uint32_t nlz_my_pid = 0;

/* A process's start time (clock ticks since boot) from /proc/<pid>/stat,
 * and whether it is a zombie (exited, not yet reaped: still answering
 * kill(pid, 0), but it will never release a lock). 0: unknown. */
static inline uint64_t nlz_proc_start(uint32_t pid, int *zombie)
{
#if defined(__linux__)
    char path[64], buf[1024];
    FILE *f;
    size_t n;
    char *p;
    int field;
    unsigned long long start = 0;
    *zombie = 0;
    snprintf(path, sizeof path, "/proc/%u/stat", pid);
    f = fopen(path, "r");
    if (f == NULL) {
        return 0;
    }
    n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    p = strrchr(buf, ')');      /* the command name may hold spaces */
    if (p == NULL || p[1] != ' ') {
        return 0;
    }
    *zombie = p[2] == 'Z' || p[2] == 'X';
    /* after ") " come fields 3..; starttime is field 22 */
    for (field = 2; field < 22 && *p; p++) {
        if (*p == ' ') {
            field++;
        }
    }
    if (field == 22) {
        start = strtoull(p, NULL, 10);
    }
    return (uint64_t)start;
#else
    (void)pid;
    *zombie = 0;
    return 0;                   /* no portable start time: the pid alone */
#endif
}

static inline uint64_t nlz_start_time(uint32_t pid)
{
    int zombie;
    return nlz_proc_start(pid, &zombie);
}

/* The PID namespace this process lives in (Linux: the inode of
 * /proc/self/ns/pid), 0 where there is none to read. Tokens name pids of
 * one namespace: the zone refuses processes of another. */
static inline uint64_t nlz_pid_namespace(void)
{
#if defined(__linux__)
    struct stat st;
    if (stat("/proc/self/ns/pid", &st) == 0) {
        return (uint64_t)st.st_ino;
    }
#endif
    return 0;
}

static inline uint64_t nlz_token_of(uint32_t pid, uint64_t start)
{
    uint32_t digest = (uint32_t)(start ^ (start >> 32)) | 0x80000000u;
    return ((uint64_t)pid << 32) | digest;
}

static inline void nlz_refresh_identity(void)
{
    nlz_my_pid = (uint32_t)getpid();
    nlz_token = nlz_token_of(nlz_my_pid, nlz_start_time(nlz_my_pid));
}

static inline uint64_t nlz_self_token(void) { return nlz_token; }
static inline uint32_t nlz_pid(void) { return nlz_my_pid; }

static inline int nlz_pid_alive(uint32_t pid)
{
    /* 0 and pids that do not fit a pid_t's positive range name no process:
       kill() would read them as a process group or as "every process"
       (-1), which a garbage lock word must never be taken for */
    if (pid == 0 || pid > 0x7FFFFFFFu) {
        return 0;
    }
    return kill((pid_t)pid, 0) == 0 || errno == EPERM;
}

static inline int nlz_token_alive(uint64_t token)
{
    uint32_t pid = (uint32_t)(token >> 32);
    if (token == nlz_token) {
        return 1;
    }
    if (!nlz_pid_alive(pid)) {
        return 0;
    }
#if defined(__linux__)
    {
        int zombie;
        uint64_t start = nlz_proc_start(pid, &zombie);
        if (zombie) {
            return 0;           /* killed, not yet reaped */
        }
        if (start != 0 && nlz_token_of(pid, start) != token) {
            return 0;           /* the pid was reused by a younger process */
        }
    }
#endif
    return 1;
}
#endif

/* ------------------------------------------------------------------------
 * Zone locks: a 64-bit word, 0 when free, else the owner's token. Held for
 * tens of nanoseconds; a waiter spins, then yields, and every ~1 ms of
 * waiting checks whether the owner is still alive. nlz_lock returns 1 when
 * it took the lock over from a dead owner: the caller must then repair what
 * the lock guards before using it. */

static inline int nlz_trylock(uint64_t *lock)
{
    uint64_t expected = 0;
#if defined(_MSC_VER)
    return (uint64_t)_InterlockedCompareExchange64((volatile long long *)lock,
                                                   (long long)nlz_self_token(), 0) == 0;
#else
    return __atomic_compare_exchange_n(lock, &expected, nlz_self_token(), 0,
                                       __ATOMIC_ACQUIRE, __ATOMIC_RELAXED);
#endif
}

static inline void nlz_unlock(uint64_t *lock)
{
#if defined(_MSC_VER)
    _InterlockedExchange64((volatile long long *)lock, 0);
#else
    __atomic_store_n(lock, 0, __ATOMIC_RELEASE);
#endif
}

static inline uint64_t nlz_lock_owner(const uint64_t *lock)
{
#if defined(_MSC_VER)
    return *(const volatile uint64_t *)lock;
#else
    return __atomic_load_n(lock, __ATOMIC_ACQUIRE);
#endif
}

/* Take the lock over from its owner when that owner is dead (and no one else
 * took it first): 1 when this process now holds it. */
static inline int nlz_take_over_dead(uint64_t *lock)
{
    uint64_t owner = nlz_lock_owner(lock);
    if (owner == 0 || nlz_token_alive(owner)) {
        return 0;
    }
#if defined(_MSC_VER)
    return (uint64_t)_InterlockedCompareExchange64((volatile long long *)lock,
            (long long)nlz_self_token(), (long long)owner) == owner;
#else
    return __atomic_compare_exchange_n(lock, &owner, nlz_self_token(), 0,
                                       __ATOMIC_ACQUIRE, __ATOMIC_RELAXED);
#endif
}

/* Wait for a lock, at most `seconds` from now: 0 when taken free, 1 when
 * taken over from a dead owner, -1 when a live owner still held it at the
 * deadline. The lifecycle (attach, join, unlink, close) passes a deadline,
 * as it must never wait forever; a decision waits without one
 * (nlz_lock_slow), since a live holder may still be writing. */
static inline int nlz_lock_timed(uint64_t *lock, double seconds)
{
    unsigned spins = 0;
    double deadline = nlz_monotonic() + seconds, checked = 0.0, now;
    uint64_t owner;
    for (;;) {
        owner = nlz_lock_owner(lock);
        if (owner == 0 && nlz_trylock(lock)) {
            return 0;
        }
        if (++spins < 64) {
            nl_cpu_relax();
            continue;
        }
        nl_yield_thread();
        if ((spins & 63) != 0) {
            continue;
        }
        now = nlz_monotonic();
        if (now >= deadline) {
            return -1;
        }
        if (checked == 0.0) {
            checked = now;
        } else if (now - checked >= 0.001) {
            checked = now;
            if (nlz_take_over_dead(lock)) {
                return 1;
            }
        }
    }
}

static inline int nlz_lock_slow(uint64_t *lock)
{
    return nlz_lock_timed(lock, 1e300);  /* no deadline */
}

static inline int nlz_lock(uint64_t *lock)
{
    if (nlz_trylock(lock)) {
        return 0;
    }
    return nlz_lock_slow(lock);
}

static inline void nlz_store_u32_release(uint32_t *p, uint32_t v)
{
#if defined(_MSC_VER)
    _ReadWriteBarrier();
    *(volatile uint32_t *)p = v;
#else
    __atomic_store_n(p, v, __ATOMIC_RELEASE);
#endif
}

static inline void nlz_store_u64_release(uint64_t *p, uint64_t v)
{
#if defined(_MSC_VER)
    _ReadWriteBarrier();
    *(volatile uint64_t *)p = v;
#else
    __atomic_store_n(p, v, __ATOMIC_RELEASE);
#endif
}

static inline uint64_t nlz_load_u64_acquire(const uint64_t *p)
{
    return nlz_lock_owner(p);
}

/* Compiler-only barrier: the entry's state is written after its undo copy
 * is complete (x86 and ARM keep a process's stores in order for a reader
 * that only starts after the writer died; the release stores order them). */
static inline void nlz_compiler_barrier(void)
{
#if defined(_MSC_VER)
    _ReadWriteBarrier();
#else
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
#endif
}

/* ------------------------------------------------------------------------
 * SipHash-2-4 with a 128-bit output (Aumasson and Bernstein), keyed by the
 * zone's secret: a key longer than an entry holds is stored as this digest.
 * Without the secret nobody can choose two keys with one digest. */

#define NLZ_ROTL(x, b) (uint64_t)(((x) << (b)) | ((x) >> (64 - (b))))
#define NLZ_SIPROUND                                                           \
    do {                                                                       \
        v0 += v1; v1 = NLZ_ROTL(v1, 13); v1 ^= v0; v0 = NLZ_ROTL(v0, 32);      \
        v2 += v3; v3 = NLZ_ROTL(v3, 16); v3 ^= v2;                             \
        v0 += v3; v3 = NLZ_ROTL(v3, 21); v3 ^= v0;                             \
        v2 += v1; v1 = NLZ_ROTL(v1, 17); v1 ^= v2; v2 = NLZ_ROTL(v2, 32);      \
    } while (0)

static inline void nlz_siphash128(uint64_t k0, uint64_t k1, const char *data, size_t len, char out[16])
{
    const unsigned char *in = (const unsigned char *)data;
    const unsigned char *end = in + len - (len % 8);
    uint64_t v0 = 0x736f6d6570736575ULL ^ k0;
    uint64_t v1 = 0x646f72616e646f6dULL ^ k1;
    uint64_t v2 = 0x6c7967656e657261ULL ^ k0;
    uint64_t v3 = 0x7465646279746573ULL ^ k1;
    uint64_t b = ((uint64_t)len) << 56;
    uint64_t m;
    int left = (int)(len & 7);
    v1 ^= 0xee;
    for (; in != end; in += 8) {
        memcpy(&m, in, 8);
        v3 ^= m;
        NLZ_SIPROUND;
        NLZ_SIPROUND;
        v0 ^= m;
    }
    switch (left) {
    case 7: b |= ((uint64_t)in[6]) << 48; /* fall through */
    case 6: b |= ((uint64_t)in[5]) << 40; /* fall through */
    case 5: b |= ((uint64_t)in[4]) << 32; /* fall through */
    case 4: b |= ((uint64_t)in[3]) << 24; /* fall through */
    case 3: b |= ((uint64_t)in[2]) << 16; /* fall through */
    case 2: b |= ((uint64_t)in[1]) << 8;  /* fall through */
    case 1: b |= ((uint64_t)in[0]); break;
    case 0: break;
    }
    v3 ^= b;
    NLZ_SIPROUND;
    NLZ_SIPROUND;
    v0 ^= b;
    v2 ^= 0xee;
    NLZ_SIPROUND; NLZ_SIPROUND; NLZ_SIPROUND; NLZ_SIPROUND;
    b = v0 ^ v1 ^ v2 ^ v3;
    memcpy(out, &b, 8);
    v1 ^= 0xdd;
    NLZ_SIPROUND; NLZ_SIPROUND; NLZ_SIPROUND; NLZ_SIPROUND;
    b = v0 ^ v1 ^ v2 ^ v3;
    memcpy(out + 8, &b, 8);
}

#undef NLZ_SIPROUND
#undef NLZ_ROTL

#endif /* NANOLIMIT_ZONE_H */

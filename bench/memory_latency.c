/* What a cache miss costs on this machine: the time per load of a chain of
   dependent loads (each address depends on the previous load's value) over
   a buffer of each size, 4 KiB pages, and 2 MiB pages where the kernel gives
   them (MADV_HUGEPAGE). Explains the 1,000,000-key and allow_many rows of
   bench/README.md. Build and run:

       cc -O2 bench/memory_latency.c -o /tmp/memory_latency && /tmp/memory_latency

   With an argument N it prints one number, ns per load over N MiB of 4 KiB
   pages (bench/floors.py reads it).
*/
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

static double seconds(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static double ns_per_load(size_t bytes, int huge)
{
    const size_t align = 2u << 20;
    char *raw = mmap(NULL, bytes + align, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) return -1.0;
    char *p = (char *)(((uintptr_t)raw + align - 1) & ~(uintptr_t)(align - 1));
    if (huge) madvise(p, bytes, MADV_HUGEPAGE);
    memset(p, 1, bytes);
    size_t lines = bytes / 64;
    uint64_t x = 88172645463325252ull, sink = 0;
    const int n = 2000000;
    double t0 = seconds();
    for (int i = 0; i < n; i++) {
        x ^= x << 13; x ^= x >> 7; x ^= x << 17;
        sink += *(volatile uint64_t *)(p + ((x ^ sink) % lines) * 64);  /* depends on the last load */
    }
    double t = (seconds() - t0) / n * 1e9;
    munmap(raw, bytes + align);
    return t + (double)(sink & 0);
}

int main(int argc, char **argv)
{
    static const size_t mib[] = {1, 4, 8, 16, 32, 64};
    if (argc > 1) {
        long size = strtol(argv[1], NULL, 10);
        if (size < 1 || size > 4096) {
            fprintf(stderr, "usage: %s [MiB, 1-4096]\n", argv[0]);
            return 2;
        }
        printf("%.1f\n", ns_per_load((size_t)size << 20, 0));
        return 0;
    }
    printf("| working set | ns per dependent load (4 KiB pages) | (MADV_HUGEPAGE) |\n| --- | ---: | ---: |\n");
    for (size_t i = 0; i < sizeof mib / sizeof mib[0]; i++)
        printf("| %zu MiB | %.0f | %.0f |\n", mib[i], ns_per_load(mib[i] << 20, 0), ns_per_load(mib[i] << 20, 1));
    return 0;
}

/* ns per dependent random read over SIZE MB (pointer chasing): what a miss costs here */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <stdint.h>
#include <sys/mman.h>
int main(int argc, char **argv) {
    size_t mb = atoi(argv[1]), n = mb * 1024 * 1024 / 64;
    uint64_t *a = aligned_alloc(1 << 21, n * 64);
    if (argc > 2) madvise(a, n * 64, MADV_HUGEPAGE);
    size_t *perm = malloc(n * sizeof *perm);
    for (size_t i = 0; i < n; i++) perm[i] = i;
    srand(1);
    for (size_t i = n - 1; i > 0; i--) { size_t j = ((size_t)rand() << 16 ^ rand()) % (i + 1); size_t t = perm[i]; perm[i] = perm[j]; perm[j] = t; }
    for (size_t i = 0; i < n; i++) a[perm[i] * 8] = perm[(i + 1) % n] * 8;
    struct timespec t0, t1; uint64_t p = 0, steps = 20000000;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (uint64_t i = 0; i < steps; i++) p = a[p];
    clock_gettime(CLOCK_MONOTONIC, &t1);
    printf("%zu MB%s: %.0f ns a read (%lu)\n", mb, argc > 2 ? " huge pages" : "", ((t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec)) / steps, (unsigned long)p % 2);
    return 0;
}

/* Brute force of tf_hstu_tile_empty (kernels/hstu.h) against tf_hstu_valid: over random masks (lengths,
 * targets, context, windows with and without exempt rows, target groups), it must never call a tile with
 * a valid pair empty. Tiles: every 64 x 64 one on the grids the sm_90a backward uses (query tiles of 64
 * rows, key panels of 64; ends past n included), random rectangles, and every rectangle for short
 * sequences. Also counts the empty 64 x 64 tiles it finds against the empty ones there are (information).
 * Built and run by tests/test_hstu.py (test_tile_empty_never_hides_a_valid_pair); prints "ok" on success.
 *
 *     cc -O2 -I kernels tests/hstu_tile_empty_check.c -o /tmp/check && /tmp/check [masks] */
#include <stdio.h>
#include <stdlib.h>

#include "hstu.h"

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint32_t rnd(uint32_t n) { /* uniform-ish in [0, n) */
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return n ? (uint32_t)((rng >> 11) % n) : 0;
}

enum { NMAX = 330 };
static int pre[NMAX + 1][NMAX + 1]; /* pre[p][q]: valid pairs in rows < p, columns < q */

static int any_valid(int n, int p0, int p1, int q0, int q1) {
    if (p0 < 0) p0 = 0;
    if (q0 < 0) q0 = 0;
    if (p1 > n) p1 = n;
    if (q1 > n) q1 = n;
    if (p0 >= p1 || q0 >= q1) return 0;
    return pre[p1][q1] - pre[p0][q1] - pre[p1][q0] + pre[p0][q0] > 0;
}

static long checked, bad, aligned_empty, aligned_found;

static void check(const tf_hstu_mask *m, int p0, int p1, int q0, int q1, int aligned) {
    const int empty = tf_hstu_tile_empty(m, p0, p1, q0, q1), any = any_valid(m->n, p0, p1, q0, q1);
    ++checked;
    if (empty && any) {
        if (++bad <= 10)
            printf("WRONG: n %d t %d c %d m %d f %d g %d: rows [%d, %d) keys [%d, %d) called empty\n", m->n, m->t,
                   m->c, m->m, m->f, m->g, p0, p1, q0, q1);
    }
    if (aligned && !any) {
        ++aligned_empty;
        aligned_found += empty;
    }
}

int main(int argc, char **argv) {
    const int masks = argc > 1 ? atoi(argv[1]) : 3000;
    for (int it = 0; it < masks; ++it) {
        const int n = rnd(4) == 0 ? (int)rnd(25) : (int)rnd(NMAX - 10 + 1);
        const int t = rnd(3) == 0 ? 0 : rnd(4) == 0 ? n : (int)rnd(n + 1);
        const int c = rnd(2) ? 0 : (int)rnd(n + 4);
        const int w = rnd(2) ? 0 : 1 + (int)rnd(n + 8);
        const int f = rnd(2) ? 0 : 1 + (int)rnd(n + 2);
        const int g = rnd(2) ? 1 : 2 + (int)rnd(6);
        const tf_hstu_mask m = tf_hstu_mask_make(n, t, c, w, f, g);
        for (int p = 0; p <= n; ++p) pre[p][0] = 0;
        for (int q = 0; q <= n; ++q) pre[0][q] = 0;
        for (int p = 0; p < n; ++p)
            for (int q = 0; q < n; ++q)
                pre[p + 1][q + 1] = pre[p][q + 1] + pre[p + 1][q] - pre[p][q] + (tf_hstu_valid(&m, p, q) ? 1 : 0);
        /* the kernel's tiles: rows [64 i, 64 i + 64), keys [64 j, 64 j + 64) (both past n at the end) */
        for (int p0 = 0; p0 < n + 64; p0 += 64)
            for (int q0 = 0; q0 < n + 64; q0 += 64) check(&m, p0, p0 + 64, q0, q0 + 64, p0 < n && q0 < n);
        for (int r = 0; r < 300; ++r) {
            const int p0 = (int)rnd(n + 3) - 1, q0 = (int)rnd(n + 3) - 1;
            check(&m, p0, p0 + 1 + (int)rnd(80), q0, q0 + 1 + (int)rnd(80), 0);
        }
        if (n <= 24)
            for (int p0 = 0; p0 < n; ++p0)
                for (int p1 = p0 + 1; p1 <= n; ++p1)
                    for (int q0 = 0; q0 < n; ++q0)
                        for (int q1 = q0 + 1; q1 <= n; ++q1) check(&m, p0, p1, q0, q1, 0);
    }
    printf("%ld tiles checked over %d masks, %ld wrongly called empty; 64 x 64 tiles: %ld of %ld empty ones found\n",
           checked, masks, bad, aligned_found, aligned_empty);
    if (bad) return 1;
    printf("ok\n");
    return 0;
}

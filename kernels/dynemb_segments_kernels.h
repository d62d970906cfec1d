/* A lookup batch's layout for the dynamic-embedding training paths: the C ABI of the kernel family
 * (CPU: dynemb_segments_cpu.c, CUDA: dynemb_segments_cuda.cu). Two jobs, each done on the GPU in one or
 * two launches where ATen takes a dozen (the training step from an idle GPU waits on that host time):
 *
 * Bag layout (DynamicEmbeddingBag): from the caller's offsets (n_in entries, int32 or int64) and the
 * number of ids n, the bags' bounds `full` (n_bags + 1 entries: offsets, then n unless
 * include_last_offset, where n_bags = n_in - 1), each id's bag `bag_of`, each id's mean-mode scale
 * 1 / max(length of its bag, 1) (optional) and one flag `bad`: full[0] != 0, full decreasing
 * somewhere, or full[n_bags] != n. Any offsets give defined, in-range results (bag_of[i] is the last
 * bag b in [0, max(n_bags - 1, 0)] with full[b] <= i, by a binary search that tolerates disorder), so
 * the flag can be read after later kernels were queued.
 *
 * Grouping (DynamicEmbedding's training batches): from a stable sort of the batch (sorted ids and
 * perm), uniq (the distinct ids in ascending order), seg (their runs' bounds in sorted order), inv
 * (each id's index into uniq in batch order) and n_unique, without a host sync: uniq and seg have n
 * and n + 1 entries; past n_unique, uniq[j] = sorted[j] and seg[j + 1] = n (defined contents). */
#ifndef TF_DYNEMB_SEGMENTS_KERNELS_H
#define TF_DYNEMB_SEGMENTS_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    const void *offsets; int offsets_64;  /* n_in entries of int64 (offsets_64) or int32 */
    int64_t n_in;
    int include_last;                     /* n_bags = n_in - 1 (else n_in; full[n_bags] = n) */
    int64_t n;                            /* ids */
    int64_t *full;                        /* n_bags + 1 */
    int64_t *bag_of;                      /* n, or NULL: bounds and flag only (then scale NULL too) */
    float *scale;                         /* n, or NULL */
    uint8_t *bad;                         /* 1 byte: written 0 or 1 (CUDA: zeroed by the caller first) */
} tf_dynemb_bag_layout_params;

typedef struct {
    int64_t n;
    const int64_t *sorted, *perm;         /* n each; perm NULL: perm32 (and perm_out gets it widened) */
    const int32_t *perm32;                /* CUDA, with perm NULL: the sort's int32 permutation */
    int64_t *perm_out;                    /* with perm32: n, perm32 as int64 */
    int64_t *uniq, *seg, *inv;            /* n, n + 1, n */
    int64_t *n_unique;                    /* 1 */
    int32_t *flags;                       /* CUDA: n scratch (1 where a run of equal ids starts) */
    int64_t *run;                         /* CUDA: n scratch (each sorted position's index into uniq) */
    void *temp; size_t temp_bytes;        /* CUDA: scan scratch of tf_dynemb_segments_temp_bytes(n) */
} tf_dynemb_segments_params;

void tf_dynemb_bag_layout_cpu(const tf_dynemb_bag_layout_params *p);
void tf_dynemb_segments_cpu(const tf_dynemb_segments_params *p);

/* Sort and grouping in one (dynemb_sort_segments): ids (n int64) sorted stably by a CUB radix sort
 * with int32 values (a quarter less traffic per pass than int64 ones), then grouped as above; the
 * permutation comes out widened to int64 (perm_out) by the grouping's scatter. Scratch, all n long:
 * sorted (int64), iota and perm32 (int32), plus tf_dynemb_sort_temp_bytes(n) for the sort.
 * CUDA: the sort key is the top 32 bits of the id's hash (tf_mix64), 4 radix passes of 4-byte keys where
 * the ids themselves would take 8 of 8-byte keys; the ids are gathered after, and a run of equal keys
 * holding different ids (a hash collision: about a hundred pairs in a million distinct ids) is put in
 * id order by one thread, by a heap sort on (id, batch position): stable, and O(L log L) for a run of
 * L even if ids were chosen to collide. Equal ids end up adjacent and in batch order as the id sort
 * leaves them. The groups then come in hash order, not id order. The hash keys use g.flags and g.run
 * as scratch (free until the grouping). */
typedef struct {
    tf_dynemb_segments_params g;             /* g.sorted / g.perm32 point into the scratch below */
    const int64_t *ids;
    int64_t *sorted;
    int32_t *iota, *perm32;
    void *sort_temp; size_t sort_temp_bytes;
} tf_dynemb_sort_segments_params;

/* CUDA: return a cudaError_t as int. */
int tf_dynemb_bag_layout_cuda(const tf_dynemb_bag_layout_params *p, void *stream);
size_t tf_dynemb_segments_temp_bytes(int64_t n);
int tf_dynemb_segments_cuda(const tf_dynemb_segments_params *p, void *stream);
size_t tf_dynemb_sort_temp_bytes(int64_t n);
int tf_dynemb_sort_segments_cuda(const tf_dynemb_sort_segments_params *p, void *stream);

#ifdef __cplusplus
}
#endif
#endif /* TF_DYNEMB_SEGMENTS_KERNELS_H */

/* CPU reference of kernels/dynemb_segments_kernels.h: plain loops, the same results as the CUDA kernels. */
#include "dynemb_segments_kernels.h"

static int64_t offset_at(const tf_dynemb_bag_layout_params *p, int64_t b) {
    if (b >= p->n_in) return p->n;  /* the appended end (no include_last) */
    return p->offsets_64 ? ((const int64_t *)p->offsets)[b] : (int64_t)((const int32_t *)p->offsets)[b];
}

void tf_dynemb_bag_layout_cpu(const tf_dynemb_bag_layout_params *p) {
    const int64_t n_bags = p->include_last ? p->n_in - 1 : p->n_in;
    int bad = 0;
    for (int64_t b = 0; b <= n_bags; ++b) {
        p->full[b] = offset_at(p, b);
        if (b > 0 && p->full[b] < p->full[b - 1]) bad = 1;
    }
    if (p->full[0] != 0 || p->full[n_bags] != p->n) bad = 1;
    *p->bad = (uint8_t)bad;
    const int64_t last = n_bags > 0 ? n_bags - 1 : 0;
    for (int64_t i = 0; p->bag_of && i < p->n; ++i) {
        /* the last b in [0, last] with full[b] <= i (b = 0 when none): the search the GPU does */
        int64_t lo = 0, hi = last;
        while (lo < hi) {
            const int64_t mid = lo + (hi - lo + 1) / 2;
            if (p->full[mid] <= i) lo = mid; else hi = mid - 1;
        }
        p->bag_of[i] = lo;
        if (p->scale) {
            const int64_t len = n_bags > 0 ? p->full[lo + 1] - p->full[lo] : 0;
            p->scale[i] = 1.0f / (float)(len > 1 ? len : 1);
        }
    }
}

void tf_dynemb_segments_cpu(const tf_dynemb_segments_params *p) {
    int64_t u = -1;
    for (int64_t j = 0; j < p->n; ++j) {
        if (j == 0 || p->sorted[j] != p->sorted[j - 1]) {
            ++u;
            p->uniq[u] = p->sorted[j];
            p->seg[u] = j;
        }
        p->inv[p->perm[j]] = u;
    }
    const int64_t nu = u + 1;
    for (int64_t j = nu; j < p->n; ++j) p->uniq[j] = p->sorted[j];
    for (int64_t j = nu; j <= p->n; ++j) p->seg[j] = p->n;
    *p->n_unique = nu;
}

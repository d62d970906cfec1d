/* Phase traces of the persistent sm_90a HSTU kernels: a measurement build only (-DTF_HSTU_BWD_TRACE /
 * -DTF_HSTU_FWD_TRACE, setup.py's TORCHFUSE_HSTU_TRACE_BUILD=1), read by benchmarks/trace_hstu_*.py.
 *
 * One thread per consumer warpgroup records (clock64, event << 32 | index) pairs into its own region of
 * kTraceCap records (the last record is overwritten once a region is full). The launch names the file
 * through an environment variable; after the kernel it waits, and writes {regions, kTraceCap} then the
 * records. Clocks are per SM: only differences within a region mean anything. */
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

constexpr int kTraceCap = 4096;

#define TF_TRACE_RECORD(buf, region, n, ev, idx)                                                          \
    do {                                                                                                   \
        unsigned long long *r_ = (buf) + 2 * ((int64_t)(region) * kTraceCap + ((n) < kTraceCap - 1 ? (n) \
                                                                                    : kTraceCap - 1));    \
        r_[0] = clock64();                                                                                 \
        r_[1] = ((unsigned long long)(ev) << 32) | (unsigned)(idx);                                        \
        ++(n);                                                                                             \
    } while (0)

/* The launch's zeroed buffer of `regions` regions (grown as needed, kept across launches), or nullptr
 * when `file` is NULL (tracing off). */
static inline unsigned long long *tf_trace_begin(const char *file, int64_t regions, cudaStream_t stream) {
    static unsigned long long *buf = nullptr;
    static int64_t have = 0;
    if (!file) return nullptr;
    const size_t bytes = (size_t)regions * kTraceCap * 16;
    if (regions > have) {
        if (buf) cudaFree(buf);
        if (cudaMalloc(&buf, bytes) != cudaSuccess) return nullptr;
        have = regions;
    }
    cudaMemsetAsync(buf, 0, bytes, stream);
    return buf;
}

/* Waits for the stream, then writes the trace to `file`. */
static inline void tf_trace_end(const char *file, const unsigned long long *buf, int64_t regions, cudaStream_t stream) {
    if (!file || !buf) return;
    const size_t bytes = (size_t)regions * kTraceCap * 16;
    unsigned long long *host = (unsigned long long *)malloc(bytes);
    if (!host) return;
    cudaStreamSynchronize(stream);
    cudaMemcpy(host, buf, bytes, cudaMemcpyDeviceToHost);
    FILE *f = fopen(file, "wb");
    if (f) {
        const long long hdr[2] = {(long long)regions / 2, (long long)kTraceCap};  // blocks, records per region
        fwrite(hdr, sizeof(hdr), 1, f);
        fwrite(host, 1, bytes, f);
        fclose(f);
    }
    free(host);
}

/* HSTU attention, cached inference of one query row per sequence (tf_hstu_decode_applies): the serving
 * case of scoring a user's newest event against a long cached history.
 *
 * The tiled kernels give each (sequence, head) one block for all of its keys, so one user's request
 * ran on H blocks of a 132-SM GPU, each streaming the whole history (4 blocks x 4096 keys of 256 dims:
 * 88 us a layer on an H100, the device nearly idle). Here the keys are split into chunks, one block
 * per (sequence, head, chunk), and since HSTU's attention has no softmax (no running maximum, no
 * normaliser) the chunks' partial outputs simply add:
 *
 *   hstu_decode_partial: block = 4 warps; a warp's lanes form groups of G lanes (G a power of two,
 *     G x VEC x NV >= the head dims), one key per group, each lane holding NV 16-byte slices of the
 *     key's and value's row. Per key: the R query rows' dot products (reduced over the group by
 *     shuffles), P = SiLU(alpha s) x inv_scale x mask, rounded to the input dtype as the tiled kernels
 *     round P before their P V product, then acc += P v. The groups' and warps' sums go through
 *     shared memory to one fp32 partial row per query row, written to ws[chunk].
 *   hstu_decode_reduce: out = the sum of a row's chunks, in the output dtype; zeros for rows at
 *     negative positions and empty sequences. A block covers 32 consecutive outputs with 8 teams of
 *     32 threads: team t sums chunks t, t + 8, ..., then the teams' sums add in team order: a fixed
 *     order (deterministic), and 8 independent load chains instead of one per output, whose L2
 *     latency a long history's many chunks would otherwise pay one after another.
 *
 * Only chunks below ceil(n / chunk) are written and read, so the workspace needs no zeroing. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "hstu_kernels.h"
#include "hstu_mma.cuh"

namespace {

constexpr int kDecodeThreads = 128;
constexpr int kDecodeWarps = kDecodeThreads / 32;

template <typename T>
__device__ __forceinline__ float to_f(T v) {
    if constexpr (std::is_same_v<T, float>) return v;
    else if constexpr (std::is_same_v<T, __nv_bfloat16>) return __bfloat162float(v);
    else return __half2float(v);
}

template <typename T>
__device__ __forceinline__ T from_f(float v) {
    if constexpr (std::is_same_v<T, float>) return v;
    else if constexpr (std::is_same_v<T, __nv_bfloat16>) return __float2bfloat16_rn(v);
    else return __float2half_rn(v);
}

/* VEC elements of a row from column c on (16 bytes), zeros past d; one 16-byte load when whole and aligned. */
template <typename T>
__device__ __forceinline__ uint4 load_slice(const T *row, int c, int d, bool vec_ok) {
    constexpr int VEC = 16 / sizeof(T);
    uint4 raw = make_uint4(0, 0, 0, 0);
    if (c >= d) return raw;
    if (vec_ok) return *(const uint4 *)(row + c);
    T tmp[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) tmp[e] = c + e < d ? row[c + e] : from_f<T>(0.f);
    memcpy(&raw, tmp, sizeof(raw));
    return raw;
}

template <typename T>
__device__ __forceinline__ void slice_to_f(const uint4 &raw, float (&out)[16 / sizeof(T)]) {
    constexpr int VEC = 16 / sizeof(T);
    T tmp[VEC];
    memcpy(tmp, &raw, sizeof(raw));
#pragma unroll
    for (int e = 0; e < VEC; ++e) out[e] = to_f<T>(tmp[e]);
}

/* R: query rows per sequence the registers hold (delta <= R; launched with R = 1, see launch_rows); NV:
 * 16-byte slices per lane (head dims up to 32 x VEC x NV); U: keys a group has in flight. */
template <typename T, int R, int NV>
__global__ void __launch_bounds__(kDecodeThreads) hstu_decode_partial(const tf_hstu_params p, int chunk,
                                                                     int64_t chunks, int G, float *ws) {
    constexpr int VEC = 16 / sizeof(T);
    constexpr int U = NV == 1 ? 4 : 2;
    constexpr int SLICE = NV * VEC;  // a lane's elements of a row
    __shared__ float red[kDecodeWarps][R][32 * SLICE];
    const int64_t c = blockIdx.x % chunks, bh = blockIdx.x / chunks;
    const int64_t b = bh / p.H;
    const int h = (int)(bh % p.H);
    const HstuSeq s = hstu_seq(p, b);
    const int k0 = (int)c * chunk;
    if (k0 >= s.n) return;  // past the sequence: the reducer reads no partial of this chunk
    const int k1 = k0 + chunk < s.n ? k0 + chunk : s.n;
    const int delta = (int)p.delta;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int grp = lane / G, gl = lane % G, groups = 32 / G;
    const int64_t q_rows = p.B * p.delta;
    const T *qb = (const T *)p.q, *kb = (const T *)p.k, *vb = (const T *)p.v;
    const bool qk_vec = p.dqk % VEC == 0 && p.q_sr % VEC == 0 && p.q_sh % VEC == 0 && p.k_sr % VEC == 0 &&
                        p.k_sh % VEC == 0 && ((uintptr_t)qb & 15) == 0 && ((uintptr_t)kb & 15) == 0;
    const bool v_vec = p.dv % VEC == 0 && p.v_sr % VEC == 0 && p.v_sh % VEC == 0 && ((uintptr_t)vb & 15) == 0;
    const float alpha = (float)p.alpha, inv_scale = (float)p.inv_scale;

    // the query rows (positions n - delta + i) in registers; whether this chunk needs the mask per key
    float q[R][SLICE];
    int pos[R];
    bool full[R];
#pragma unroll
    for (int i = 0; i < R; ++i) {
        pos[i] = i < delta ? s.n - delta + i : -1;
        full[i] = pos[i] >= 0 && tf_hstu_tile_full(&s.mask, pos[i], pos[i] + 1, k0, k1);
        const T *qrow = qb + (s.q_start + i) * p.q_sr + (int64_t)h * p.q_sh;
#pragma unroll
        for (int j = 0; j < NV; ++j) {
            float f[VEC];
            const uint4 raw = pos[i] >= 0 ? load_slice<T>(qrow, (gl + G * j) * VEC, (int)p.dqk, qk_vec)
                                          : make_uint4(0, 0, 0, 0);
            slice_to_f<T>(raw, f);
#pragma unroll
            for (int e = 0; e < VEC; ++e) q[i][j * VEC + e] = f[e];
        }
    }
    float acc[R][SLICE];
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
        for (int e = 0; e < SLICE; ++e) acc[i][e] = 0.f;

    // The trip count is the warp's, not the group's: every lane must reach the group reductions' shuffles
    // (a group past the chunk's end takes part with weight 0).
    const int stride = kDecodeWarps * groups;  // keys per round of every group of the block
    for (int wbase = k0 + warp * groups; wbase < k1; wbase += U * stride) {
        const int base = wbase + grp;
        uint4 kr[U][NV], vr[U][NV];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int key = base + u * stride;
            const int64_t row = s.start + (key < k1 ? key : k0);
            const T *krow = kb + row * p.k_sr + (int64_t)h * p.k_sh;
            const T *vrow = vb + row * p.v_sr + (int64_t)h * p.v_sh;
#pragma unroll
            for (int j = 0; j < NV; ++j) {
                kr[u][j] = load_slice<T>(krow, (gl + G * j) * VEC, (int)p.dqk, qk_vec);
                vr[u][j] = load_slice<T>(vrow, (gl + G * j) * VEC, (int)p.dv, v_vec);
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int key = base + u * stride;
            float kf[SLICE], vf[SLICE];
#pragma unroll
            for (int j = 0; j < NV; ++j) {
                float f[VEC];
                slice_to_f<T>(kr[u][j], f);
#pragma unroll
                for (int e = 0; e < VEC; ++e) kf[j * VEC + e] = f[e];
                slice_to_f<T>(vr[u][j], f);
#pragma unroll
                for (int e = 0; e < VEC; ++e) vf[j * VEC + e] = f[e];
            }
#pragma unroll
            for (int i = 0; i < R; ++i) {
                float dot = 0.f;
#pragma unroll
                for (int e = 0; e < SLICE; ++e) dot = fmaf(q[i][e], kf[e], dot);
                for (int off = G / 2; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
                const bool ok = key < k1 && pos[i] >= 0 && (full[i] || tf_hstu_valid(&s.mask, pos[i], key));
                const float w = ok ? to_f<T>(from_f<T>(silu_of(alpha * dot) * inv_scale)) : 0.f;
#pragma unroll
                for (int e = 0; e < SLICE; ++e) acc[i][e] = fmaf(w, vf[e], acc[i][e]);
            }
        }
    }

    // the groups of a warp, then the warps: one partial row per query row
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
        for (int e = 0; e < SLICE; ++e)
            for (int off = G; off < 32; off <<= 1) acc[i][e] += __shfl_xor_sync(0xffffffffu, acc[i][e], off);
    if (grp == 0) {
#pragma unroll
        for (int i = 0; i < R; ++i)
#pragma unroll
            for (int j = 0; j < NV; ++j)
#pragma unroll
                for (int e = 0; e < VEC; ++e) red[warp][i][(gl + G * j) * VEC + e] = acc[i][j * VEC + e];
    }
    __syncthreads();
    const int width = G * SLICE;  // the dims the groups cover (>= dv)
    for (int t = threadIdx.x; t < delta * width; t += kDecodeThreads) {
        const int i = t / width, dim = t % width;
        if (dim >= p.dv) continue;
        float sum = 0.f;
#pragma unroll
        for (int w = 0; w < kDecodeWarps; ++w) sum += red[w][i][dim];
        ws[((c * q_rows + s.q_start + i) * p.H + h) * p.dv + dim] = sum;
    }
}

constexpr int kReduceTeams = 8;

template <typename T>
__global__ void __launch_bounds__(32 * kReduceTeams) hstu_decode_reduce(const tf_hstu_params p, int chunk,
                                                                        const float *ws) {
    __shared__ float part[kReduceTeams][32];
    const int64_t q_rows = p.B * p.delta, total = q_rows * p.H * p.dv;
    const int lane = threadIdx.x % 32, team = threadIdx.x / 32;
    T *out = (T *)p.o;
    for (int64_t base = (int64_t)blockIdx.x * 32; base < total; base += (int64_t)gridDim.x * 32) {
        const int64_t idx = base + lane;
        float sum = 0.f;
        int pos = -1;
        if (idx < total) {
            const int64_t row = idx / (p.H * p.dv);
            const HstuSeq s = hstu_seq(p, row / p.delta);
            pos = s.n - (int)p.delta + (int)(row % p.delta);
            if (pos >= 0) {
                const int nc = (s.n + chunk - 1) / chunk;
#pragma unroll 4
                for (int c = team; c < nc; c += kReduceTeams) sum += ws[c * total + idx];
            }
        }
        part[team][lane] = sum;
        __syncthreads();
        if (team == 0 && idx < total) {
            float t = 0.f;
#pragma unroll
            for (int i = 0; i < kReduceTeams; ++i) t += part[i][lane];
            out[idx] = from_f<T>(pos >= 0 ? t : 0.f);
        }
        __syncthreads();
    }
}

int device_sms() {
    static int sms[64] = {0};
    int dev = 0;
    cudaGetDevice(&dev);
    if (dev < 0 || dev >= 64) return 132;
    if (!sms[dev]) cudaDeviceGetAttribute(&sms[dev], cudaDevAttrMultiProcessorCount, dev);
    return sms[dev] > 0 ? sms[dev] : 132;
}

/* Keys per block: the largest power of two from 32 up that still gives every SM four blocks (at most
 * the longest sequence, rounded up); 32 when even that does not. */
int decode_chunk(const tf_hstu_params &p) {
    const int64_t want = 4 * (int64_t)device_sms(), pairs = p.B * p.H;
    int chunk = 32;
    while (chunk < p.max_seq_len && pairs * ((p.max_seq_len + 2 * chunk - 1) / (2 * chunk)) >= want) chunk *= 2;
    return chunk;
}

int elem_bytes(int dt) { return dt == TF_F32 ? 4 : 2; }

/* Head dims the decode kernel covers at NV slices a lane: 32 lanes x 16 bytes x NV. */
int decode_nv(const tf_hstu_params &p) {
    const int64_t d = p.dqk > p.dv ? p.dqk : p.dv, per16 = 16 / elem_bytes(p.dtype);
    return d <= 32 * per16 ? 1 : 2;
}

template <typename T, int NV>
cudaError_t launch_rows(const tf_hstu_params &p, int chunk, int64_t chunks, int G, cudaStream_t st) {
    const int64_t blocks = p.B * p.H * chunks;
    if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
    // one query row per sequence (tf_hstu_decode_applies): R = 2, 4, 8 measured slower than the tiled kernels
    hstu_decode_partial<T, 1, NV><<<(unsigned)blocks, kDecodeThreads, 0, st>>>(p, chunk, chunks, G, p.decode_ws);
    return cudaGetLastError();
}

template <typename T>
cudaError_t launch_decode(const tf_hstu_params &p, cudaStream_t st) {
    const int chunk = decode_chunk(p);
    const int64_t chunks = (p.max_seq_len + chunk - 1) / chunk;
    const int nv = decode_nv(p), per16 = 16 / (int)sizeof(T);
    const int64_t d = p.dqk > p.dv ? p.dqk : p.dv;
    int G = 1;
    while ((int64_t)G * per16 * nv < d && G < 32) G *= 2;
    cudaError_t err;
    if constexpr (sizeof(T) == 2) err = launch_rows<T, 1>(p, chunk, chunks, G, st);  // 32 x 8 >= 256 dims
    else err = nv == 1 ? launch_rows<T, 1>(p, chunk, chunks, G, st) : launch_rows<T, 2>(p, chunk, chunks, G, st);
    if (err != cudaSuccess) return err;
    const int64_t total = p.B * p.delta * p.H * p.dv;
    const int64_t want = (total + 31) / 32;
    const unsigned grid = (unsigned)(want < 16 * (int64_t)device_sms() ? want : 16 * (int64_t)device_sms());
    hstu_decode_reduce<T><<<grid, 32 * kReduceTeams, 0, st>>>(p, chunk, p.decode_ws);
    return cudaGetLastError();
}

}  // namespace

extern "C" int64_t tf_hstu_decode_ws_floats(const tf_hstu_params *p) {
    if (!tf_hstu_decode_applies(p->delta, p->bias != nullptr, p->dropout_p, p->backend)) return 0;
    if (p->dqk > 256 || p->dv > 256 || p->B == 0 || p->H == 0 || p->max_seq_len < 1) return 0;
    const int chunk = decode_chunk(*p);
    const int64_t chunks = (p->max_seq_len + chunk - 1) / chunk;
    return chunks * p->B * p->delta * p->H * p->dv;
}

extern "C" int tf_hstu_decode_cuda(const tf_hstu_params *p, void *stream) {
    const cudaStream_t st = (cudaStream_t)stream;
    if (p->dtype == TF_BF16) return (int)launch_decode<__nv_bfloat16>(*p, st);
    if (p->dtype == TF_F16) return (int)launch_decode<__half>(*p, st);
    return (int)launch_decode<float>(*p, st);
}

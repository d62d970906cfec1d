/* HSTU attention, cached inference of one query row per sequence (tf_hstu_decode_applies): the serving
 * case of scoring a user's newest event against a long cached history.
 *
 * The tiled kernels give each (sequence, head) one block for all of its keys, so one user's request
 * ran on H blocks of a 132-SM GPU, each streaming the whole history (4 blocks x 4096 keys of 256 dims:
 * 88 us a layer on an H100, the device nearly idle). Here the keys are split into chunks, one block
 * per (sequence, head, chunk), and since HSTU's attention has no softmax (no running maximum, no
 * normaliser) the chunks' partial outputs simply add:
 *
 *   hstu_decode_partial: block = 4 warps, grid x = the chunk, y and z = the (sequence, head) pair; a
 *     warp's lanes form groups of G lanes (G a power of two, G x VEC x NV >= the head dims), one key per
 *     group and warp step, each lane holding NV 16-byte slices of the key's and value's row (NV = 2
 *     past 16 slices a row: two or more keys a warp step, so the shuffle reduction, SiLU and mask of a
 *     key are shared by fewer lanes). Per key: the R query rows' dot products (reduced over the group
 *     by shuffles), P = SiLU(alpha s) x inv_scale x mask, rounded to the input dtype as the tiled
 *     kernels round P before their P V product, then acc += P v. The next steps' K and V slices load
 *     into a ring of registers while a step's keys are used. The groups' and warps' sums go through
 *     shared memory to one fp32 partial row per query row, written to ws[chunk].
 *   The sum of a row's chunks runs in the same kernel, in the last of the pair's blocks to finish (a
 *     separate reduce kernel cost a launch, most of its time for one user): each block that wrote a
 *     partial fences it and counts itself on the pair's counter; the block that brings the count to the
 *     pair's chunk count ceil(n / chunk) reads every partial, resets the counter to zero for the next
 *     launch, and writes the output row. Its 128 threads take (team, column) units, team t summing chunks
 *     t, t + 8, ..., then each output adds the 8 teams' sums in team order: the order of the reduce
 *     kernel this replaced, so the results are the same bits. Blocks past a sequence's end and the
 *     grid's padding plane write nothing and do not count; an empty sequence's row (no chunk) is zeroed
 *     by its chunk-0 block.
 *
 * Only chunks below ceil(n / chunk) are written and read, so the workspace needs no zeroing; the
 * counters (decode_cnt, B x H) must be zero before a launch and are zero again after it. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "hstu_kernels.h"
#include "hstu_mma.cuh"
#include "tf_typed.cuh"

namespace {

constexpr int kDecodeThreads = 128;
constexpr int kDecodeWarps = kDecodeThreads / 32;
constexpr int kReduceTeams = 8;

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

/* VEC elements from ptr, the first `left` of them (zeros after; none when left <= 0). */
template <typename T>
__device__ __forceinline__ uint4 load_part(const T *ptr, int left) {
    constexpr int VEC = 16 / sizeof(T);
    T tmp[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) tmp[e] = e < left ? ptr[e] : from_f<T>(0.f);
    uint4 raw;
    memcpy(&raw, tmp, sizeof(raw));
    return raw;
}

template <typename T>
__device__ __forceinline__ void slice_to_f(const uint4 &raw, float (&out)[16 / sizeof(T)]) {
    constexpr int VEC = 16 / sizeof(T);
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {  // exact: a bf16 is a float's high half
        const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            out[2 * e] = __uint_as_float(w[e] << 16);
            out[2 * e + 1] = __uint_as_float(w[e] & 0xffff0000u);
        }
    } else {
        T tmp[VEC];
        memcpy(tmp, &raw, sizeof(raw));
#pragma unroll
        for (int e = 0; e < VEC; ++e) out[e] = to_f<T>(tmp[e]);
    }
}

/* The red buffer's index of a partial row's element: 4 floats of padding every 32, so that the 16-byte
 * stores of lanes 8 floats apart (a 16-bit dtype's slice) fall in different banks (unpadded, 8 lanes
 * wrote one bank), and a warp reading 32 consecutive dims still reads 32 banks. */
__device__ __forceinline__ int red_idx(int dim) { return dim + (dim >> 5) * 4; }

/* The last block's team sums of one row: smem[t x dv + dim] = the sum of chunks t, t + 8, ... of
 * src[c x plane + dim], each from 0 in chunk order. Units (team, VF columns) spread over the threads,
 * two units a thread at a time with UNIT_LOADS loads each in flight: the partials sit in L2 (another
 * block wrote most of them, so they are read through L2, __ldcg), and one load chain a team would pay
 * its latency nc / 8 times over. VF = 4: dv a multiple of 4, the rows 16-byte aligned. */
template <int VF>
__device__ __forceinline__ void sum_chunks(const float *src, int64_t plane, int nc, int dv, float *smem) {
    using V = std::conditional_t<VF == 4, float4, float>;
    constexpr int UNIT_LOADS = 8, PAIR = 2;
    auto zero = [] {
        if constexpr (VF == 4) return make_float4(0.f, 0.f, 0.f, 0.f);
        else return 0.f;
    };
    auto add = [](V &a, const V &x) {
        if constexpr (VF == 4) {
            a.x += x.x;
            a.y += x.y;
            a.z += x.z;
            a.w += x.w;
        } else {
            a += x;
        }
    };
    const int cols = dv / VF, units = kReduceTeams * cols;
    for (int u0 = threadIdx.x; u0 < units; u0 += PAIR * kDecodeThreads) {
        int team[PAIR], col[PAIR];
        bool on[PAIR];
        V acc[PAIR];
#pragma unroll
        for (int m = 0; m < PAIR; ++m) {
            const int u = u0 + m * kDecodeThreads;
            on[m] = u < units;
            team[m] = on[m] ? u / cols : nc;  // no unit: every chunk index past nc, nothing added
            col[m] = on[m] ? u - team[m] * cols : 0;
            acc[m] = zero();
        }
        for (int c0 = 0; c0 < nc; c0 += kReduceTeams * UNIT_LOADS) {
            V x[PAIR][UNIT_LOADS];
#pragma unroll
            for (int m = 0; m < PAIR; ++m)
#pragma unroll
                for (int j = 0; j < UNIT_LOADS; ++j) {
                    // a chunk past nc loads chunk nc - 1 and is dropped below: unpredicated loads, so that
                    // the predicate registers do not cap the loads in flight
                    const int c = min(c0 + j * kReduceTeams + team[m], nc - 1);
                    x[m][j] = __ldcg((const V *)(src + c * plane) + col[m]);
                }
#pragma unroll
            for (int m = 0; m < PAIR; ++m)
#pragma unroll
                for (int j = 0; j < UNIT_LOADS; ++j)
                    if (c0 + j * kReduceTeams + team[m] < nc) add(acc[m], x[m][j]);
        }
#pragma unroll
        for (int m = 0; m < PAIR; ++m)
            if (on[m]) *((V *)(smem + team[m] * dv) + col[m]) = acc[m];
    }
    __syncthreads();
}

/* R: query rows per sequence the registers hold (delta <= R; launched with R = 1, see launch_rows); NV:
 * 16-byte slices per lane (head dims up to 32 x VEC x NV); GF: G when known at compile time (16, 32: the
 * shuffle reductions unrolled, the lane split by shifts), else 0 and G = g. Grid: x the chunk, y +
 * gridDim.y z the (sequence, head) pair, so that no 64-bit division runs and B x H may pass 65535.
 * qk_vec / v_vec: q and k / v rows are whole aligned 16-byte slices (decode_vec). */
template <typename T, int R, int NV, int GF>
__global__ void __launch_bounds__(kDecodeThreads, 4) hstu_decode_partial(const tf_hstu_params p, int chunk, int g,
                                                                        float alpha, float inv_scale, bool qk_vec,
                                                                        bool v_vec, float *ws, unsigned *cnt) {
    const int G = GF ? GF : g;
    constexpr int VEC = 16 / sizeof(T);
    constexpr int U = NV == 1 ? 5 : 3;  // register slots of K and V slices: warp steps loaded ahead
    constexpr int SLICE = NV * VEC;  // a lane's elements of a row
    constexpr int RED = 32 * SLICE + 32 * SLICE / 8;  // red_idx(32 x SLICE) rounded up
    // the head dims are at most 32 x SLICE (G <= 32): the last block's team sums fit in kReduceTeams rows
    constexpr int DV_MAX = 32 * SLICE < 256 ? 32 * SLICE : 256;
    constexpr int RED_FLOATS = kDecodeWarps * R * RED, TEAM_FLOATS = kReduceTeams * DV_MAX;
    // the warps' sums, then (last block only, after a barrier) the team sums: one buffer
    __shared__ __align__(16) float smem[RED_FLOATS > TEAM_FLOATS ? RED_FLOATS : TEAM_FLOATS];
    __shared__ bool last;
    float(*red)[R][RED] = reinterpret_cast<float(*)[R][RED]>(smem);
    const unsigned bh = blockIdx.y + gridDim.y * blockIdx.z, H = (unsigned)p.H;
    if (bh >= (unsigned)p.B * H) return;  // the grid's last z plane: no pair, not counted
    const unsigned b = bh / H, h = bh - b * H;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int grp = lane / G, gl = lane % G, groups = 32 / G;
    const int delta = (int)p.delta;
    const int dqk = (int)p.dqk, dv = (int)p.dv;
    const T *qb = (const T *)p.q, *kb = (const T *)p.k, *vb = (const T *)p.v;

    // The query rows (b delta + i, present for every i < delta) load before the offsets: their addresses
    // need no sequence. A row at a negative position gets weight 0 below whatever it holds.
    uint4 qraw[R][NV];
#pragma unroll
    for (int i = 0; i < R; ++i) {
        const T *qrow = qb + ((int64_t)b * delta + i) * p.q_sr + (int64_t)h * p.q_sh;
#pragma unroll
        for (int j = 0; j < NV; ++j)
            qraw[i][j] = i < delta ? load_slice<T>(qrow, (gl + G * j) * VEC, dqk, qk_vec) : make_uint4(0, 0, 0, 0);
    }

    const HstuSeq s = hstu_seq(p, b);
    const int64_t k0l = (int64_t)blockIdx.x * chunk;
    if (k0l >= s.n) {  // past the sequence: no partial of this chunk is read, and the block does not count
        if (s.n == 0 && blockIdx.x == 0) {  // no chunk at all: the row (at position -1) is zero
            T *orow = (T *)p.o + ((int64_t)b * delta * H + h) * dv;
            for (int dim = threadIdx.x; dim < dv; dim += kDecodeThreads) orow[dim] = from_f<T>(0.f);
        }
        return;
    }
    const int k0 = (int)k0l;
    const int k1 = s.n - k0 > chunk ? k0 + chunk : s.n;
    const int nc = (s.n + chunk - 1) / chunk;  // the pair's blocks that write (at most gridDim.x)

    // whether this chunk needs the mask per key
    float q[R][SLICE];
    int pos[R];
    bool full[R];
#pragma unroll
    for (int i = 0; i < R; ++i) {
        pos[i] = i < delta ? s.n - delta + i : -1;
        full[i] = pos[i] >= 0 && tf_hstu_tile_full(&s.mask, pos[i], pos[i] + 1, k0, k1);
#pragma unroll
        for (int j = 0; j < NV; ++j) {
            float f[VEC];
            slice_to_f<T>(qraw[i][j], f);
#pragma unroll
            for (int e = 0; e < VEC; ++e) q[i][j * VEC + e] = f[e];
        }
    }
    float acc[R][SLICE];
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
        for (int e = 0; e < SLICE; ++e) acc[i][e] = 0.f;

    const int stride = kDecodeWarps * groups;  // keys per step of every group of the block
    // This lane's slices of the next key it loads (kp, vp), stepping by stride rows; keys from k1 on are
    // not loaded (zeros, weight 0). vk: whole aligned 16-byte slices (qk_vec and v_vec), one predicated
    // load each; else element loads up to the row's end.
    int next = k0 + warp * groups + grp;
    const int col = gl * VEC, jstep = G * VEC;  // slice j's first element: col + j jstep
    const T *kp = kb + (s.start + next) * p.k_sr + (int64_t)h * p.k_sh + col;
    const T *vp = vb + (s.start + next) * p.v_sr + (int64_t)h * p.v_sh + col;
    const int64_t kstep = (int64_t)stride * p.k_sr, vstep = (int64_t)stride * p.v_sr;
    auto load = [&](uint4 (&kr)[NV], uint4 (&vr)[NV], auto vk) {
        const bool in = next < k1;
#pragma unroll
        for (int j = 0; j < NV; ++j) {
            if constexpr (decltype(vk)::value) {
                kr[j] = in && col + j * jstep < dqk ? *(const uint4 *)(kp + j * jstep) : make_uint4(0, 0, 0, 0);
                vr[j] = in && col + j * jstep < dv ? *(const uint4 *)(vp + j * jstep) : make_uint4(0, 0, 0, 0);
            } else {
                kr[j] = load_part<T>(kp + j * jstep, in ? dqk - col - j * jstep : 0);
                vr[j] = load_part<T>(vp + j * jstep, in ? dv - col - j * jstep : 0);
            }
        }
        kp += kstep;
        vp += vstep;
        next += stride;
    };
    auto consume = [&](const uint4 (&kr)[NV], const uint4 (&vr)[NV], int wb) {
        const int key = wb + grp;
        float kf[SLICE], vf[SLICE];
#pragma unroll
        for (int j = 0; j < NV; ++j) {
            float f[VEC];
            slice_to_f<T>(kr[j], f);
#pragma unroll
            for (int e = 0; e < VEC; ++e) kf[j * VEC + e] = f[e];
            slice_to_f<T>(vr[j], f);
#pragma unroll
            for (int e = 0; e < VEC; ++e) vf[j * VEC + e] = f[e];
        }
#pragma unroll
        for (int i = 0; i < R; ++i) {
            float dot = 0.f;
#pragma unroll
            for (int e = 0; e < SLICE; ++e) dot = fmaf(q[i][e], kf[e], dot);
#pragma unroll
            for (int off = 16; off > 0; off >>= 1)  // G is the whole warp's: a uniform branch
                if (off < G) dot += __shfl_xor_sync(0xffffffffu, dot, off);
            const bool ok = key < k1 && pos[i] >= 0 && (full[i] || tf_hstu_valid(&s.mask, pos[i], key));
            const float w = ok ? to_f<T>(from_f<T>(silu_of(alpha * dot) * inv_scale)) : 0.f;
#pragma unroll
            for (int e = 0; e < SLICE; ++e) acc[i][e] = fmaf(w, vf[e], acc[i][e]);
        }
    };

    // A ring of U register slots, one warp step each: a slot is reloaded with the step U on as soon as
    // its keys are used, so U - 1 steps' loads (8 16-byte loads a lane) stay in flight. wb is the
    // warp's (not the group's), so every lane runs the same trip count and reaches the group reductions'
    // shuffles (a group past the chunk's end takes part with weight 0).
    auto keys = [&](auto vk) {
        // element loads hold a register per element until packed: one slot there
        constexpr int S = decltype(vk)::value ? U : 1;
        uint4 kr[S][NV], vr[S][NV];
        int wb = k0 + warp * groups;
#pragma unroll
        for (int u = 0; u < S; ++u) load(kr[u], vr[u], vk);
        while (true) {
#pragma unroll
            for (int u = 0; u < S; ++u) {
                if (wb >= k1) return;
                consume(kr[u], vr[u], wb);
                load(kr[u], vr[u], vk);
                wb += stride;
            }
        }
    };
    if (qk_vec && v_vec) keys(std::true_type{});
    else keys(std::false_type{});

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
                for (int e = 0; e < VEC; e += 4)
                    *(float4 *)&red[warp][i][red_idx((gl + G * j) * VEC + e)] =
                        make_float4(acc[i][j * VEC + e], acc[i][j * VEC + e + 1], acc[i][j * VEC + e + 2],
                                    acc[i][j * VEC + e + 3]);
    }
    __syncthreads();
    const int64_t plane = p.B * p.delta * p.H * p.dv;  // one chunk's partial rows
#pragma unroll
    for (int i = 0; i < R; ++i) {
        if (i >= delta) break;
        float *wrow = ws + (int64_t)blockIdx.x * plane + (((int64_t)b * delta + i) * p.H + h) * p.dv;
        for (int dim = threadIdx.x; dim < dv; dim += kDecodeThreads) {
            float sum = 0.f;
#pragma unroll
            for (int w = 0; w < kDecodeWarps; ++w) sum += red[w][i][red_idx(dim)];
            wrow[dim] = sum;
        }
    }

    // Every thread's partial stores are visible device-wide before thread 0 counts the block; the block
    // that sees the others' counts sees their partials (the fence-then-count pattern of the CUDA
    // programming guide's last-block sum). The barrier also ends every read of red before the team sums
    // reuse its memory.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned *pair_cnt = cnt + blockIdx.y + gridDim.y * blockIdx.z;  // bh, not held through the key loop
        last = atomicAdd(pair_cnt, 1u) == (unsigned)nc - 1u;
        if (last) *pair_cnt = 0u;  // all nc blocks have counted: the next launch (a graph replay too) starts at 0
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
#pragma unroll
    for (int i = 0; i < R; ++i) {
        if (i >= delta) break;
        const int64_t row = (((int64_t)b * delta + i) * p.H + h) * p.dv;
        if (dv % 4 == 0)
            sum_chunks<4>(ws + row, plane, nc, dv, smem);
        else
            sum_chunks<1>(ws + row, plane, nc, dv, smem);
        T *orow = (T *)p.o + row;
        for (int dim = threadIdx.x; dim < dv; dim += kDecodeThreads) {
            float t = 0.f;
#pragma unroll
            for (int team = 0; team < kReduceTeams; ++team) t += smem[team * dv + dim];
            orow[dim] = from_f<T>(t);
        }
        __syncthreads();  // the next row's team sums reuse smem
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

/* Keys per block: the largest power of two from 64 up that still gives every SM two blocks (at most
 * the longest sequence, rounded up); 64 when even that does not. A warp's fixed cost (the sequence's
 * metadata, the query row, the reductions, the partial row's write) was most of its instructions at 8
 * keys a warp; at two blocks an SM every block is resident at once (four fit) and each warp's ring of
 * register slots keeps 8 16-byte loads a lane in flight. */
int decode_chunk(const tf_hstu_params &p) {
    const int64_t want = 2 * (int64_t)device_sms(), pairs = p.B * p.H;
    int chunk = 64;
    while (chunk < p.max_seq_len && pairs * ((p.max_seq_len + 2 * chunk - 1) / (2 * chunk)) >= want) chunk *= 2;
    return chunk;
}

int elem_bytes(int dt) { return dt == TF_F32 ? 4 : 2; }

/* 16-byte slices a lane holds: two past 16 slices a row, so that a warp step covers two or more keys
 * (G <= 16) and a key's shuffle reduction, SiLU and mask cost half as many instructions a key. */
int decode_nv(const tf_hstu_params &p) {
    const int64_t d = p.dqk > p.dv ? p.dqk : p.dv, per16 = 16 / elem_bytes(p.dtype);
    return d <= 16 * per16 ? 1 : 2;
}

/* Whether q and k (qk), else v, rows split into whole aligned 16-byte slices of `vec` elements: decided
 * once here instead of per block, and the kernel's loop is then built for one kind of load. */
bool decode_vec(const tf_hstu_params &p, int vec, bool qk) {
    if (qk)
        return p.dqk % vec == 0 && p.q_sr % vec == 0 && p.q_sh % vec == 0 && p.k_sr % vec == 0 &&
               p.k_sh % vec == 0 && ((uintptr_t)p.q & 15) == 0 && ((uintptr_t)p.k & 15) == 0;
    return p.dv % vec == 0 && p.v_sr % vec == 0 && p.v_sh % vec == 0 && ((uintptr_t)p.v & 15) == 0;
}

template <typename T, int NV, int GF>
cudaError_t launch_rows(const tf_hstu_params &p, int chunk, int64_t chunks, int G, cudaStream_t st) {
    const int64_t pairs = p.B * p.H;
    if (pairs == 0 || chunks == 0) return cudaSuccess;
    if (chunks > 0x7fffffff || pairs > 0xffffffffll) return cudaErrorInvalidConfiguration;
    const int64_t gy = pairs < 65535 ? pairs : 65535, gz = (pairs + gy - 1) / gy;
    if (gz > 65535) return cudaErrorInvalidConfiguration;
    const dim3 grid((unsigned)chunks, (unsigned)gy, (unsigned)gz);
    // one query row per sequence (tf_hstu_decode_applies): R = 2, 4, 8 measured slower than the tiled kernels
    const int vec = 16 / (int)sizeof(T);
    hstu_decode_partial<T, 1, NV, GF><<<grid, kDecodeThreads, 0, st>>>(
        p, chunk, G, (float)p.alpha, (float)p.inv_scale, decode_vec(p, vec, true), decode_vec(p, vec, false),
        p.decode_ws, p.decode_cnt);
    return cudaGetLastError();
}

template <typename T>
cudaError_t launch_decode(const tf_hstu_params &p, cudaStream_t st) {
    // the partial kernel holds one query row; its last blocks count on decode_cnt
    if (p.delta != 1 || !p.decode_cnt) return cudaErrorInvalidValue;
    const int chunk = decode_chunk(p);
    const int64_t chunks = (p.max_seq_len + chunk - 1) / chunk;
    const int nv = decode_nv(p), per16 = 16 / (int)sizeof(T);
    const int64_t d = p.dqk > p.dv ? p.dqk : p.dv;
    if (d > 256) return cudaErrorInvalidValue;  // 32 lanes x 2 slices of fp32
    int G = 1;
    while ((int64_t)G * per16 * nv < d) G *= 2;
    // NV = 1 has G <= 16 and NV = 2 has G >= 16 (decode_nv); G = 32 only for fp32
    cudaError_t err;
    if (nv == 1)
        err = G == 16 ? launch_rows<T, 1, 16>(p, chunk, chunks, G, st) : launch_rows<T, 1, 0>(p, chunk, chunks, G, st);
    else if constexpr (sizeof(T) == 2)
        err = launch_rows<T, 2, 16>(p, chunk, chunks, G, st);
    else
        err = G == 16 ? launch_rows<T, 2, 16>(p, chunk, chunks, G, st) : launch_rows<T, 2, 32>(p, chunk, chunks, G, st);
    return err;
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

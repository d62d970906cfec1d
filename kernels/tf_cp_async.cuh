/* cp.async (sm_80+): 16-byte global -> shared copies that hold no registers while in flight. A
 * thread's copies are committed as groups and waited for by count; a copy is visible to the other
 * threads only after the copying thread's wait and a barrier (__syncwarp / __syncthreads) between.
 * Shared by the kernels that stage rows in shared memory (norm, HSTU mma.sync, dynamic embeddings). */
#ifndef TF_CP_ASYNC_CUH
#define TF_CP_ASYNC_CUH

/* 16 bytes global -> shared; zero-filled when !pred (src is then not read). Both 16-byte aligned. */
__device__ __forceinline__ void cp_async16(void *dst, const void *src, bool pred = true) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(pred ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
/* Until at most N of this thread's committed groups are still in flight. */
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

#endif

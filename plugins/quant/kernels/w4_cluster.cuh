// CLU: split K reduced inside a thread block cluster. The CLU splits of one column block are one
// cluster (__cluster_dims__(1, CLU, 1) on the kernel, gridDim.y == CLU), so their fp32 sums meet
// in distributed shared memory (PTX ISA: "Distributed shared memory", mapa, ld.shared::cluster,
// barrier.cluster) instead of global partials, a __threadfence and an arrival counter: the
// partials' store / fence / reload was ~14% of the stall samples of the M = 64 kernel
// (BENCHMARKS.md, nineteenth session). Compiled after w4_mma_io.cuh (Acc, FOR_FRAGS).

#ifndef CLU
#define CLU 0
#endif
#if CLU
// Every thread of every CTA of the cluster; release / acquire order the shared-memory writes
// before it with the remote reads after it.
__device__ __forceinline__ void cluster_barrier() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

// The address in cluster CTA ``rank``'s shared memory of this CTA's shared address ``addr``
// (offsets from it stay inside that CTA's window).
__device__ __forceinline__ unsigned mapa_rank(unsigned addr, unsigned rank) {
    unsigned remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
    return remote;
}

__device__ __forceinline__ float ld_cluster_f32(unsigned addr) {
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
    return v;
}

// All threads of the CTA call it, with ``red`` the shared address of TW * NB * 4 floats per
// thread (the stages are done with). Each owner thread leaves its fragments there; the owners
// of cluster rank 0 (split 0) then add the other splits' in split order, the order of the
// global path (deterministic, bit-identical to it). Returns whether this thread stores y.
__device__ __forceinline__ bool cluster_reduce(Acc& A, bool owner, unsigned red) {
    __syncthreads();  // no warp still reads the shared memory (KW sums, the last stage)
    const unsigned nt = blockDim.x, slot = red + 4 * threadIdx.x;  // fragment i at slot + 4 * nt * i
    if (owner) {
        FOR_FRAGS asm volatile("st.shared.f32 [%0], %1;" ::"r"(slot + 4 * nt * ((a * NB + b) * 4 + f)),
                               "f"(A.acc[a][b][f]) : "memory");
    }
    cluster_barrier();  // every split's fragments are in its shared memory
    const unsigned rank = cluster_rank();
    if (rank == 0 && owner) {
        for (unsigned r = 1; r < CLU; ++r) {
            const unsigned peer = mapa_rank(slot, r);
            FOR_FRAGS A.acc[a][b][f] += ld_cluster_f32(peer + 4 * nt * ((a * NB + b) * 4 + f));
        }
    }
    cluster_barrier();  // the other CTAs keep their shared memory until rank 0 has read it
    return rank == 0 && owner;
}
#endif

// flash_decode: split-KV paged decode attention (Flash-Decoding, Dao et al. 2023;
// FlashInfer's split-KV + merge-states design, Ye et al. 2025), compiled at run time by NVRTC.
//
// Compile-time constants (passed as -D options): KV_DTYPE (0 fp16, 1 bf16, 2 fp32),
// HEAD_DIM (multiple of 32), GROUP (query heads per KV head), BLOCK_SIZE (tokens per
// KV block), TILE_BLOCKS (KV blocks staged in shared memory per iteration).
//
// Layouts: q/out rows [*, Hq, D] (row stride given), cache [2, NB, BS, Hkv, D],
// block_table int32 [B, max_blocks], seq_lens int32 [B].

#if KV_DTYPE == 2
typedef float st;
__device__ __forceinline__ float to_f(st x) { return x; }
__device__ __forceinline__ st from_f(float x) { return x; }
#else
typedef unsigned short st;
#if KV_DTYPE == 0
__device__ __forceinline__ float to_f(st x) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x)); return f; }
__device__ __forceinline__ st from_f(float x) { st h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x)); return h; }
#else
__device__ __forceinline__ float to_f(st x) { return __uint_as_float(((unsigned int)x) << 16); }
__device__ __forceinline__ st from_f(float x) { st h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x)); return h; }
#endif
#endif

#define WARP 32
#define NEG_INF __int_as_float(0xff800000)
#define DPL ((HEAD_DIM + WARP - 1) / WARP)     // dims per lane (lanes past HEAD_DIM idle when < 32)
#define OWN(i) (HEAD_DIM % WARP == 0 || lane + (i) * WARP < HEAD_DIM)
#define TILE (TILE_BLOCKS * BLOCK_SIZE)       // tokens per iteration
#define VEC (16 / sizeof(st))                 // elements per 16-byte load

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// One program = (split, kv head, decode row); warp w serves query head kv_head*GROUP + w,
// so each K/V tile is read from HBM once for the whole GQA group.
extern "C" __global__ void __launch_bounds__(WARP * GROUP)
fd_partial(const st* __restrict__ q, long long q_row_stride,
           const st* __restrict__ kv, long long kv_half,              // elements in K (= in V)
           const int* __restrict__ block_table, int max_blocks,
           const int* __restrict__ seq_lens,
           const int* __restrict__ row_tok, const int* __restrict__ row_req,
           int num_kv_heads, int partition, int num_splits, float scale,
           float* __restrict__ part_out, float* __restrict__ part_lse,
           st* __restrict__ out, long long out_row_stride) {
    __shared__ __align__(16) st ks[TILE][HEAD_DIM];
    __shared__ __align__(16) st vs[TILE][HEAD_DIM];
    const int split = blockIdx.x, hk = blockIdx.y, row = blockIdx.z;
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int tok = row_tok[row], req = row_req[row];
    const int head = hk * GROUP + warp;
    const int num_heads = num_kv_heads * GROUP;
    const int seq_len = seq_lens[req];
    const int start = split * partition;
    const int end = min(start + partition, seq_len);
    const long long pidx = ((long long)row * num_heads + head) * num_splits + split;
    if (start >= end) {  // an empty split: neutral element for the merge
        if (num_splits > 1 && lane == 0) part_lse[pidx] = NEG_INF;
        return;
    }
    float qr[DPL];
    const st* qp = q + (long long)tok * q_row_stride + (long long)head * HEAD_DIM;
#pragma unroll
    for (int i = 0; i < DPL; ++i) qr[i] = OWN(i) ? to_f(qp[lane + i * WARP]) * scale : 0.f;
    float m = NEG_INF, l = 0.f, acc[DPL];
#pragma unroll
    for (int i = 0; i < DPL; ++i) acc[i] = 0.f;
    const int* bt = block_table + (long long)req * max_blocks;
    const long long tok_stride = (long long)num_kv_heads * HEAD_DIM;
    for (int t0 = start - start % BLOCK_SIZE; t0 < end; t0 += TILE) {
        // stage TILE tokens of K and V for this kv head (16-byte loads)
        for (int e = threadIdx.x * VEC; e < TILE * HEAD_DIM; e += WARP * GROUP * VEC) {
            const int t = e / HEAD_DIM, d = e % HEAD_DIM;
            const int pos = t0 + t;
            if (pos < end) {
                const long long blk = bt[pos / BLOCK_SIZE];
                const long long off = (blk * BLOCK_SIZE + pos % BLOCK_SIZE) * tok_stride + hk * HEAD_DIM + d;
                *reinterpret_cast<uint4*>(&ks[t][d]) = *reinterpret_cast<const uint4*>(kv + off);
                *reinterpret_cast<uint4*>(&vs[t][d]) = *reinterpret_cast<const uint4*>(kv + kv_half + off);
            } else {  // never leave stale shared memory where 0 * NaN could reach acc
                *reinterpret_cast<uint4*>(&ks[t][d]) = make_uint4(0, 0, 0, 0);
                *reinterpret_cast<uint4*>(&vs[t][d]) = make_uint4(0, 0, 0, 0);
            }
        }
        __syncthreads();
        float sc[TILE];
        float tmax = NEG_INF;
#pragma unroll
        for (int t = 0; t < TILE; ++t) {
            const int pos = t0 + t;
            float s = 0.f;
#pragma unroll
            for (int i = 0; i < DPL; ++i) if (OWN(i)) s += qr[i] * to_f(ks[t][lane + i * WARP]);
            s = warp_sum(s);
            sc[t] = (pos >= start && pos < end) ? s : NEG_INF;
            tmax = fmaxf(tmax, sc[t]);
        }
        const float m_new = fmaxf(m, tmax);
        const float alpha = __expf(m - m_new);
        l *= alpha;
#pragma unroll
        for (int i = 0; i < DPL; ++i) acc[i] *= alpha;
#pragma unroll
        for (int t = 0; t < TILE; ++t) {
            const float p = __expf(sc[t] - m_new);
            l += p;
#pragma unroll
            for (int i = 0; i < DPL; ++i) if (OWN(i)) acc[i] += p * to_f(vs[t][lane + i * WARP]);
        }
        m = m_new;
        __syncthreads();
    }
    const float inv = 1.f / l;
    if (num_splits == 1) {
        st* op = out + (long long)tok * out_row_stride + (long long)head * HEAD_DIM;
#pragma unroll
        for (int i = 0; i < DPL; ++i) if (OWN(i)) op[lane + i * WARP] = from_f(acc[i] * inv);
    } else {
        float* pp = part_out + pidx * HEAD_DIM;
#pragma unroll
        for (int i = 0; i < DPL; ++i) if (OWN(i)) pp[lane + i * WARP] = acc[i] * inv;
        if (lane == 0) part_lse[pidx] = m + __logf(l);
    }
}

// Merge the splits of one (row, head) by log-sum-exp weights (FlashInfer's merge_states).
extern "C" __global__ void fd_merge(const float* __restrict__ part_out, const float* __restrict__ part_lse,
                                    const int* __restrict__ row_tok, int num_heads, int num_splits,
                                    st* __restrict__ out, long long out_row_stride) {
    const int head = blockIdx.x, row = blockIdx.y;
    const long long base = ((long long)row * num_heads + head) * num_splits;
    float mx = NEG_INF;
    for (int s = 0; s < num_splits; ++s) mx = fmaxf(mx, part_lse[base + s]);
    float denom = 0.f;
    for (int s = 0; s < num_splits; ++s) denom += __expf(part_lse[base + s] - mx);
    st* op = out + (long long)row_tok[row] * out_row_stride + (long long)head * HEAD_DIM;
    for (int d = threadIdx.x; d < HEAD_DIM; d += blockDim.x) {
        float a = 0.f;
        for (int s = 0; s < num_splits; ++s) {
            const float w = __expf(part_lse[base + s] - mx);
            if (w > 0.f) a += w * part_out[(base + s) * HEAD_DIM + d];
        }
        op[d] = from_f(a / denom);
    }
}

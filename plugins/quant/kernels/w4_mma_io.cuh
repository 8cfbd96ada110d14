// How x comes into the W4A16 mma kernel (w4_mma.cu) and y goes out: the CTA's shared copy of
// x (XS), the RMSNorm prologue that computes x itself (NORM), and store_out with its SwiGLU
// (ACT) and RoPE (ROPE) epilogues. Compiled after w4_mma_stages.cuh (w4_mma_jit.SOURCE).

// Copy x[0:M, cbeg*64 : cend*64) into shared memory (row pitch xpitch), then a CTA barrier.
__device__ __forceinline__ void fill_x(dt* xs, const dt* x, int M, long long stride_x, int xpitch, int cbeg,
                                       int cend) {
    const int units = (cend - cbeg) * 8;  // 16-byte units per row
    for (int u = threadIdx.x; u < M * units; u += blockDim.x) {
        const int row = u / units, col = (u % units) * 8;
        *reinterpret_cast<uint4*>(xs + row * xpitch + col) =
            __ldg(reinterpret_cast<const uint4*>(x + (size_t)row * stride_x + (size_t)cbeg * 64 + col));
    }
    __syncthreads();
}

#ifndef NORM
#define NORM 0
#endif
#if NORM && !XS
#error "NORM keeps the normalized x rows in shared memory: it needs XS"
#endif
#if NORM
// NORM: x = RMSNorm(h + res) * nw (Zhang & Sennrich 2019, the pre-norm of the next layer)
// computed by every CTA into shared memory (full rows, pitch xpitch), so the separate fused
// add + RMSNorm kernel and its launch go. Numerics as kvforge.layers.triton_ops.rmsnorm: the
// sum is rounded to x's dtype (the new residual stream, written by CTA (0, 0) to res_out),
// squares summed in fp32 (per thread in unit order, warps in xor-shuffle order, then warp 0..
// in order: deterministic), y = dt(s * rstd), then dt(y * nw). M <= 8 (one token block).
__device__ __forceinline__ uint4 add_round(const uint4& hv, const uint4& rv, float& ss) {
    // dt(h + r) of 8 values; their squares (fp32) into ss in element order
    const dt* hp = reinterpret_cast<const dt*>(&hv);
    const dt* rp = reinterpret_cast<const dt*>(&rv);
    __align__(16) dt sv[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        sv[e] = f_to_dt(dt_to_f(hp[e]) + dt_to_f(rp[e]));
        const float f = dt_to_f(sv[e]);
        ss += f * f;
    }
    return *reinterpret_cast<const uint4*>(sv);
}

__device__ __forceinline__ void scale_units(dt* sp, const uint4& wv, float rstd) {
    // 8 values of the shared copy: dt(dt(s * rstd) * w), in place
    const dt* wp = reinterpret_cast<const dt*>(&wv);
    __align__(16) dt ov[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) ov[e] = f_to_dt(dt_to_f(f_to_dt(dt_to_f(sp[e]) * rstd)) * dt_to_f(wp[e]));
    *reinterpret_cast<uint4*>(sp) = *reinterpret_cast<const uint4*>(ov);
}

#define NORM_BATCH 2  // 16-byte units a thread has in flight at once (K 4096 at 256 threads: all)
__device__ __forceinline__ void fill_x_norm(dt* xs, const dt* h, int M, long long stride_h, int xpitch, int K,
                                            const dt* res, const dt* nw, float eps, dt* res_out, int cbeg,
                                            int cend) {
    __shared__ float part[32][8];  // [warp][row] sums of squares
    const int units = K / 8, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const int nt = blockDim.x, su = (cend - cbeg) * 8;  // su: units of this CTA's K slice per row
    const bool writer = blockIdx.x == 0 && blockIdx.y == 0;
    // the norm weight of this thread's first slice units, requested before anything waits
    uint4 wpre[NORM_BATCH];
#pragma unroll
    for (int i = 0; i < NORM_BATCH; ++i) {
        const int u = threadIdx.x + i * nt;
        if (u < M * su) wpre[i] = __ldg(reinterpret_cast<const uint4*>(nw + cbeg * 64) + u % su);
    }
    for (int row = 0; row < M; ++row) {
        const uint4* hr = reinterpret_cast<const uint4*>(h + (size_t)row * stride_h);
        const uint4* rr = reinterpret_cast<const uint4*>(res + (size_t)row * K);
        float ss = 0.f;
        for (int u0 = threadIdx.x; u0 < units; u0 += NORM_BATCH * nt) {
            uint4 hv[NORM_BATCH], rv[NORM_BATCH];
#pragma unroll
            for (int i = 0; i < NORM_BATCH; ++i)  // all loads first: one L2 round trip per batch
                if (u0 + i * nt < units) hv[i] = __ldg(hr + u0 + i * nt), rv[i] = __ldg(rr + u0 + i * nt);
#pragma unroll
            for (int i = 0; i < NORM_BATCH; ++i) {
                const int u = u0 + i * nt;
                if (u < units) {
                    const uint4 sv = add_round(hv[i], rv[i], ss);
                    *reinterpret_cast<uint4*>(xs + row * xpitch + u * 8) = sv;
                    if (writer) reinterpret_cast<uint4*>(res_out + (size_t)row * K)[u] = sv;
                }
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        if (lane == 0) part[warp][row] = ss;
    }
    __syncthreads();
    // this CTA's K slice only (its warps read chunks cbeg .. cend)
#pragma unroll
    for (int i = 0; i < NORM_BATCH; ++i) {
        const int u = threadIdx.x + i * nt;
        if (u < M * su) {
            const int row = u / su;
            float tot = 0.f;
            for (int w = 0; w < nwarps; ++w) tot += part[w][row];
            scale_units(xs + row * xpitch + cbeg * 64 + (u % su) * 8, wpre[i], rsqrtf(tot / (float)K + eps));
        }
    }
    for (int u = threadIdx.x + NORM_BATCH * nt; u < M * su; u += nt) {
        const int row = u / su;
        float tot = 0.f;
        for (int w = 0; w < nwarps; ++w) tot += part[w][row];
        scale_units(xs + row * xpitch + cbeg * 64 + (u % su) * 8,
                    __ldg(reinterpret_cast<const uint4*>(nw + cbeg * 64) + u % su), rsqrtf(tot / (float)K + eps));
    }
    __syncthreads();
}
#endif

#ifndef ACT
#define ACT 0
#endif

#ifndef ROPE
#define ROPE 0
#endif
#if ROPE && ACT
#error "ROPE (a q|k|v weight) and ACT (a gate|up weight) exclude each other"
#endif
// ROPE 1: rows below rope_rows (the q and k heads) are packed in the rotary layout
// (w4_mma.interleave_heads: each head's two halves interleaved 8 by 8, as ACT's gate|up), so a
// lane's f = 0, 1 fragments hold dim d and f = 2, 3 dim d + hd / 2 of one head and token; they
// are stored in head order. ROPE 2: also rotated on the way out (RoPE, rotate-half as HF Llama,
// Su et al. 2021) by cos / sin fp32 [max_pos][hd / 2] at the token's position pos[tok] (int64),
// so the separate rotary kernel goes. Its cos / sin are fetched at the kernel's start (rope_load)
// and wait in registers: the epilogue adds no memory round trip.
struct RopeCS {
#if ROPE == 2
    float c[TW][NB][2], s[TW][NB][2];
#else
    int unused;
#endif
};

__device__ __forceinline__ int rope_dim(int row0, int hd) { return ((row0 % hd) >> 4) * 8 + (row0 & 7); }

__device__ __forceinline__ void rope_load(RopeCS& cs, int nbase, int t, int M, int rope_rows, int hd,
                                          const long long* pos, const float* cosp, const float* sinp) {
#if ROPE == 2
    FOR_PAIRS {
        const int row0 = nbase + 16 * a, tok = 8 * b + 2 * t + f;
        float c = 1.f, sn = 0.f;
        if (row0 < rope_rows && tok < M) {
            const size_t at = (size_t)__ldg(pos + tok) * (hd / 2) + rope_dim(row0, hd);
            c = __ldg(cosp + at);
            sn = __ldg(sinp + at);
        }
        cs.c[a][b][f] = c;
        cs.s[a][b][f] = sn;
    }
#endif
}

// y[token][row] for the lane's fragments (rows past nbase as in the kernel's epilogue). ACT 1
// (a gate|up weight packed with gate and up rows interleaved 8 by 8, w4_mma.interleave_gate_up):
// a lane's f = 0, 1 fragments are gate rows and f = 2, 3 the up rows of the same features and
// tokens, so silu(gate) * up (SwiGLU, fp32, rounded once) is written to feature 8 * tile + g.
__device__ __forceinline__ void store_out(const float (&acc)[TW][NB][4], dt* out, long long stride_o, int M,
                                          int nbase, int t, const RopeCS& cs, int rope_rows, int hd) {
#if ACT
    const int g = nbase & 7, col0 = (nbase - g) / 2 + g;  // nbase = 16 * tile + g
    FOR_PAIRS {
        const int tok = 8 * b + 2 * t + f;
        const float gate = acc[a][b][f], up = acc[a][b][f + 2];
        if (tok < M) out[(size_t)tok * stride_o + col0 + 8 * a] = f_to_dt(gate / (1.f + __expf(-gate)) * up);
    }
#elif ROPE
    FOR_PAIRS {
        const int row0 = nbase + 16 * a, tok = 8 * b + 2 * t + f;
        if (tok >= M) continue;
        dt* o = out + (size_t)tok * stride_o;
        float x1 = acc[a][b][f], x2 = acc[a][b][f + 2];
        if (row0 < rope_rows) {  // dims d and d + hd / 2 of one head (rope_rows: a multiple of 16)
            const int d = row0 - row0 % hd + rope_dim(row0, hd);
#if ROPE == 2
            const float c = cs.c[a][b][f], sn = cs.s[a][b][f], y1 = x1 * c - x2 * sn;
            x2 = x2 * c + x1 * sn;
            x1 = y1;
#endif
            o[d] = f_to_dt(x1);
            o[d + hd / 2] = f_to_dt(x2);
        } else {
            o[row0] = f_to_dt(x1);
            o[row0 + 8] = f_to_dt(x2);
        }
    }
#else
    FOR_FRAGS {
        const int tok = 8 * b + 2 * t + (f & 1);
        if (tok < M) out[(size_t)tok * stride_o + nbase + 16 * a + 8 * (f >> 1)] = f_to_dt(acc[a][b][f]);
    }
#endif
}

// One K chunk of the W4A16 mma kernel (w4_mma.cu): its compute (dequantize + MMAs) and the
// cp.async pipeline that stages chunks in shared memory (CPA). Compiled after w4_mma_ops.cuh.

// The accumulators and the current group's dequantization constants of a lane.
struct Acc {
    float acc[TW][NB][4];
    unsigned zb[TW][2];  // -(BIAS + z) pairs (HI_IN_PLACE row n1: -(BIAS / 16 + z)): the MMA operand is q - z, exact
#if SCALE_A
    unsigned sa[TW][2];
#else
    float sf[TW][2];
    float tmp[TW][NB][4];  // the group's product before its scale
#endif
};

// Register j of the A fragment of MMA i (tile a): q - z from word i's nibbles (exact: (BIAS + q)
// - (BIAS + z), or with HI_IN_PLACE for odd j (BIAS + 16 q) / 16 - (BIAS / 16 + z), one rounding
// of an exact integer), times the group scale with SCALE_A (rounded once).
__device__ __forceinline__ void dequant_frag(unsigned* fr, const Acc& A, unsigned w, int a) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // register j: row n0 (j even) or n1 (j odd)
#if HI_IN_PLACE
        fr[j] = fma2(pair_bits(w, j), (j & 1) ? SIXTEENTH2 : ONE2, A.zb[a][j & 1]);
#else
        fr[j] = fma2(pair_bits(w, j), ONE2, A.zb[a][j & 1]);
#endif
#if SCALE_A
        fr[j] = fma2(fr[j], A.sa[a][j & 1], NEG_ZERO2);
#endif
    }
}

#ifndef XR
#define XR 0
#endif
// XR: x rows of one chunk in the CTA's ring, 64 elements + 16 bytes apart, so the 16-byte reads
// of lanes (g, t) and (g + 1, t) fall in different banks (a quarter warp reads 128 distinct bytes)
#define XR_PITCH 144
#define XR_SLOT (NB * 8 * XR_PITCH)  // one chunk for 8 * NB token rows (rows >= M are never written)

// A group starts: its zeros / scales, a fresh product.
__device__ __forceinline__ void open_group(Acc& A, const Stage& cur) {
#pragma unroll
    for (int a = 0; a < TW; ++a)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            // -(BIAS + z) / -(BIAS / 16 + z) pairs: z's nibble, already in both halves, in the mantissa
            const unsigned zw = cur.z[a >> 1] >> (8 * (a & 1));
#if HI_IN_PLACE
            A.zb[a][r] = r ? and_or<0x00f000f0u>(zw, NEG_HI2) : and_or<0x000f000fu>(zw, NEG_LO2);
#else
            A.zb[a][r] = and_or<0x000f000fu>(zw >> (4 * r), NEG_LO2);
#endif
#if SCALE_A
            A.sa[a][r] = dup2(f_to_dt(h16_to_f(cur.s[2 * a + r])));
#else
            A.sf[a][r] = h16_to_f(cur.s[2 * a + r]);
#endif
        }
#if !SCALE_A
    FOR_FRAGS A.tmp[a][b][f] = 0.f;
#endif
}

// One 64-wide K chunk: dequantize the lane's weight words into A fragments, TW * 4 * NB MMAs.
// gstart / gend: the chunk opens / closes a scale group. XR: ``xsm`` is the shared address of
// this lane's x (row g, column 16t) in the chunk's ring slot.
__device__ __forceinline__ void compute_chunk(Acc& A, const Stage& cur, bool gstart, bool gend, unsigned xsm = 0) {
    if (gstart) open_group(A, cur);
#if XR  // x from the ring, half a chunk (MMAs 2h, 2h + 1) at a time: 4 * NB registers live, not 8 * NB
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        uint4 xh[NB];
#pragma unroll
        for (int b = 0; b < NB; ++b) xh[b] = lds128(xsm + b * 8 * XR_PITCH + 16 * h);
#pragma unroll
        for (int i = 2 * h; i < 2 * h + 2; ++i)
#pragma unroll
            for (int a = 0; a < TW; ++a) {
                unsigned fr[4];
                dequant_frag(fr, A, word_of(cur.w[a], i), a);
#pragma unroll
                for (int b = 0; b < NB; ++b) {
                    const unsigned b0 = (i & 1) ? xh[b].z : xh[b].x, b1 = (i & 1) ? xh[b].w : xh[b].y;
#if SCALE_A
                    mma(A.acc[a][b], fr, b0, b1);
#else
                    mma(A.tmp[a][b], fr, b0, b1);
#endif
                }
            }
    }
#else
#pragma unroll
    for (int a = 0; a < TW; ++a)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            unsigned fr[4];
            dequant_frag(fr, A, word_of(cur.w[a], i), a);
#pragma unroll
            for (int b = 0; b < NB; ++b) {
                const uint4& xa = cur.x[b][i >> 1];  // MMA i: x registers 2i, 2i + 1
                const unsigned b0 = (i & 1) ? xa.z : xa.x, b1 = (i & 1) ? xa.w : xa.y;
#if SCALE_A
                mma(A.acc[a][b], fr, b0, b1);
#else
                mma(A.tmp[a][b], fr, b0, b1);
#endif
            }
        }
#endif
#if !SCALE_A
    if (gend) {  // the group ends: scale its product in
        FOR_FRAGS A.acc[a][b][f] += A.sf[a][f >> 1] * A.tmp[a][b][f];
    }
#endif
}

// XS: the lane's x runs of chunk c from the CTA's shared copy.
__device__ __forceinline__ void x_from_smem(Stage& cur, const dt* const* xp, int c) {
#pragma unroll
    for (int b = 0; b < NB; ++b) {
        const uint4* q = reinterpret_cast<const uint4*>(xp[b] + (size_t)c * 64);
        cur.x[b][0] = q[0];
        cur.x[b][1] = q[1];
    }
}

#ifndef CPA
#define CPA 0
#endif
#define NT (WARPS * 32)
#if CPA
// CPA stages in shared memory, filled by cp.async (Marlin's multi-stage pipeline, here per
// thread): unit u of stage s of thread tid is 16 bytes at ((s * UNITS + u) * NT + tid) * 16,
// so a warp's 16-byte reads of one unit are 512 contiguous bytes (no bank conflict). A thread
// reads back only what it copied itself, so its own cp.async.wait_group orders them: no CTA
// barrier. Units: TW weight vectors, 2 * NB x runs (unless XS), the scales (4 * TW bytes),
// the zero-point words (4 * ZW bytes).
#define U_X TW
#define U_S (U_X + (XIN ? 0 : 2 * NB))
#define U_Z (U_S + 1)
#define UNITS (U_Z + 1)
#if CPA < 2
#error "CPA needs at least 2 stages"
#endif
#define STAGE_BYTES (CPA * UNITS * NT * 16)
#else
#define STAGE_BYTES 0
#endif

template <int BYTES>  // .ca: x and the group records are re-read by the CTA's other warps
__device__ __forceinline__ void cp_async_ca(unsigned dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(dst), "l"(src), "n"(BYTES) : "memory");
}
__device__ __forceinline__ void cp_async_weights(unsigned dst, const void* src) {  // .cg: read once, not into L1
#if LDW
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
#else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
#endif
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(PENDING) : "memory"); }

#if CPA
// Start the copies of chunk c's operands into the stage at `st` (this thread's unit 0).
__device__ __forceinline__ void issue_stage(unsigned st, const uint4* wp, const dt* const* xp,
                                            const unsigned short* sc, const unsigned* zp, size_t rec0,
                                            size_t rec_step, int c, int GC) {
#pragma unroll
    for (int a = 0; a < TW; ++a) cp_async_weights(st + a * NT * 16, wp + (size_t)c * 128 + a * 32);
#if !XIN
#pragma unroll
    for (int b = 0; b < NB; ++b) {
        cp_async_ca<16>(st + (U_X + 2 * b) * NT * 16, xp[b] + (size_t)c * 64);
        cp_async_ca<16>(st + (U_X + 2 * b + 1) * NT * 16, xp[b] + (size_t)c * 64 + 8);
    }
#endif
    if (c % GC == 0) {
        const size_t rec = rec0 + (size_t)(c / GC) * rec_step;
        cp_async_ca<4 * TW>(st + U_S * NT * 16, sc + rec);
        cp_async_ca<4 * ZW>(st + U_Z * NT * 16, zp + (rec >> 2));
    }
}

// The landed stage at `st` into registers (the group records only where a group starts);
// ``zsh``: 8 for a lane whose one tile (TW 1) is odd (its entries sit 8 bits up), else 0.
__device__ __forceinline__ void read_stage(Stage& cur, unsigned st, bool gstart, int zsh) {
#pragma unroll
    for (int a = 0; a < TW; ++a) cur.w[a] = lds128(st + a * NT * 16);
#if !XIN
#pragma unroll
    for (int b = 0; b < NB; ++b) {
        cur.x[b][0] = lds128(st + (U_X + 2 * b) * NT * 16);
        cur.x[b][1] = lds128(st + (U_X + 2 * b + 1) * NT * 16);
    }
#endif
    if (gstart) {
        const uint4 s = lds128(st + U_S * NT * 16);
#pragma unroll
        for (int i = 0; i < 2 * TW; ++i) cur.s[i] = (unsigned short)(word_of(s, i >> 1) >> (16 * (i & 1)));
        if (ZW == 2) {
            asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(cur.z[0]), "=r"(cur.z[ZW - 1]) : "r"(st + U_Z * NT * 16));
        } else {
            asm volatile("ld.shared.b32 %0, [%1];" : "=r"(cur.z[0]) : "r"(st + U_Z * NT * 16));
            cur.z[0] >>= zsh;
        }
    }
}
#endif

// The split's chunk that the warps of share kw take as their local chunk j (KW > 1: whole
// groups kw, kw + KW, ... of the split), and how many local chunks they have.
__device__ __forceinline__ int chunk_at(int j, int kw, int cbeg, int GC) {
    return KW == 1 ? cbeg + j : cbeg + ((j / GC) * KW + kw) * GC + j % GC;
}
__device__ __forceinline__ int chunks_of(int kw, int ngrp, int GC) {
    return kw < ngrp ? ((ngrp - 1 - kw) / KW + 1) * GC : 0;
}

#if XR
#if !CPA || XS || NORM
#error "XR streams x through a CTA ring in step with the CPA stages: it needs CPA >= 2, and not XS or NORM"
#endif
// XR (Marlin's shared activation tile, here a ring of CPA slots in step with the stages): the
// CTA's threads copy local chunk j of x (rows 0..M-1, for each of the KW shares) into slot
// ``slot`` with cp.async, 16-byte units spread over all threads. Each warp then reads every
// x value once per chunk from shared memory instead of from L1 / L2 once per warp.
__device__ __forceinline__ void issue_x(unsigned slot, const dt* x, int M, long long stride_x, int j, int cbeg,
                                        int ngrp, int GC) {
    const int per = M * 8;  // 16-byte units of one chunk of M rows
    for (int u = threadIdx.x; u < KW * per; u += NT) {
        const int k2 = KW == 1 ? 0 : u / per, rem = KW == 1 ? u : u - k2 * per;
        if (j < chunks_of(k2, ngrp, GC)) {
            const int r = rem >> 3, col = (rem & 7) * 8;
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(slot + (k2 * NB * 8 + r) * XR_PITCH + col * 2),
                         "l"(x + (size_t)r * stride_x + (size_t)chunk_at(j, k2, cbeg, GC) * 64 + col)
                         : "memory");
        }
    }
}
#endif

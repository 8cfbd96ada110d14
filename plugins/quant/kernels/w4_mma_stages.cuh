// One K chunk of the W4A16 mma kernel (w4_mma.cu): its compute (dequantize + MMAs) and the
// cp.async pipeline that stages chunks in shared memory (CPA). Compiled after w4_mma_ops.cuh.

// The accumulators and the current group's dequantization constants of a lane.
struct Acc {
    float acc[TW][NB][4];
    unsigned zb[TW][2];  // -(BIAS + z) pairs: w - (BIAS + z) = q - z, exact
#if SCALE_A
    unsigned sa[TW][2];
#else
    float sf[TW][2];
    float tmp[TW][NB][4];  // the group's product before its scale
#endif
};

// One 64-wide K chunk: dequantize the lane's weight words into A fragments, TW * 4 * NB MMAs.
// gstart / gend: the chunk opens / closes a scale group.
__device__ __forceinline__ void compute_chunk(Acc& A, const Stage& cur, bool gstart, bool gend) {
    if (gstart) {  // a group starts: its zeros / scales, a fresh product
#pragma unroll
        for (int a = 0; a < TW; ++a)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                A.zb[a][r] = dup2(cur.z[2 * a + r] ^ 0x8000);
#if SCALE_A
                A.sa[a][r] = dup2(f_to_dt(cur.s[2 * a + r]));
#else
                A.sf[a][r] = cur.s[2 * a + r];
#endif
            }
#if !SCALE_A
        FOR_FRAGS A.tmp[a][b][f] = 0.f;
#endif
    }
#pragma unroll
    for (int a = 0; a < TW; ++a)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const unsigned w = word_of(cur.w[a], i);
            unsigned fr[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {  // register j: row n0 (j even) or n1 (j odd)
                fr[j] = fma2(pair_bits(w, j), ONE2, A.zb[a][j & 1]);
#if SCALE_A
                fr[j] = fma2(fr[j], A.sa[a][j & 1], NEG_ZERO2);
#endif
            }
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
// barrier. Units: TW weight vectors, 2 * NB x runs (unless XS), the scales (8 * TW bytes),
// the zeros (4 * TW bytes).
#define U_X TW
#define U_S (U_X + (XS ? 0 : 2 * NB))
#define U_Z (U_S + (TW + 1) / 2)
#define UNITS (U_Z + 1)
#if CPA < 2
#error "CPA needs at least 2 stages"
#endif
#define STAGE_BYTES (CPA * UNITS * NT * 16)
#else
#define STAGE_BYTES 0
#endif

__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
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
__device__ __forceinline__ void issue_stage(unsigned st, const uint4* wp, const dt* const* xp, const float* sc,
                                            const dt* zp, size_t rec0, size_t rec_step, int c, int GC) {
#pragma unroll
    for (int a = 0; a < TW; ++a) cp_async_weights(st + a * NT * 16, wp + (size_t)c * 128 + a * 32);
#if !XS
#pragma unroll
    for (int b = 0; b < NB; ++b) {
        cp_async_ca<16>(st + (U_X + 2 * b) * NT * 16, xp[b] + (size_t)c * 64);
        cp_async_ca<16>(st + (U_X + 2 * b + 1) * NT * 16, xp[b] + (size_t)c * 64 + 8);
    }
#endif
    if (c % GC == 0) {
        const size_t rec = rec0 + (size_t)(c / GC) * rec_step;
        if (TW == 4) {
            cp_async_ca<16>(st + U_S * NT * 16, sc + rec);
            cp_async_ca<16>(st + (U_S + 1) * NT * 16, sc + rec + 4);
        } else {
            cp_async_ca<8 * TW>(st + U_S * NT * 16, sc + rec);
        }
        cp_async_ca<4 * TW>(st + U_Z * NT * 16, zp + rec);
    }
}

__device__ __forceinline__ uint4 lds128(unsigned a) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
    return v;
}

// The landed stage at `st` into registers (the group records only where a group starts).
__device__ __forceinline__ void read_stage(Stage& cur, unsigned st, bool gstart) {
#pragma unroll
    for (int a = 0; a < TW; ++a) cur.w[a] = lds128(st + a * NT * 16);
#if !XS
#pragma unroll
    for (int b = 0; b < NB; ++b) {
        cur.x[b][0] = lds128(st + (U_X + 2 * b) * NT * 16);
        cur.x[b][1] = lds128(st + (U_X + 2 * b + 1) * NT * 16);
    }
#endif
    if (gstart) {
        uint4 s[2], z = lds128(st + U_Z * NT * 16);
        s[0] = lds128(st + U_S * NT * 16);
        s[1] = TW == 4 ? lds128(st + (U_S + 1) * NT * 16) : s[0];
#pragma unroll
        for (int i = 0; i < 2 * TW; ++i) cur.s[i] = __uint_as_float(word_of(s[i >> 2], i & 3));
#pragma unroll
        for (int i = 0; i < 2 * TW; ++i) cur.z[i] = (dt)(word_of(z, i >> 1) >> (16 * (i & 1)));
    }
}
#endif

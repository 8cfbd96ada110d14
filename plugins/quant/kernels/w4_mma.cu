// W4A16 GEMM on the "mma" int4 layout (w4_mma.py): y[M, N] = x[M, K] @ dequant(W)[K, N] on
// the tensor cores with mma.sync m16n8k16 (both operands from registers), compiled by NVRTC.
//
// Why mma.sync and not Hopper's wgmma: wgmma reads its B operand (here the activations) from
// shared memory, so every K step pays a store / fence / CTA barrier round trip (the Triton
// kernel's bound, BENCHMARKS.md); mma.sync takes both operands from registers, and a warp
// streams its weights and activations with plain 16-byte loads, never waiting on another.
// The idea of a per-thread weight layout dequantized by LOP3 into MMA fragments is Marlin's
// (Frantar et al., 2024); this kernel is written from the PTX ISA's fragment layouts.
//
// Compile-time constants (-D): W4_BF16 (1 bf16, 0 fp16), NB (token blocks of 8: M <= 8 * NB),
// TW (16-row tiles per warp: 1, 2 or 4), WARPS (warps per CTA), S (register stages: each
// warp keeps S - 1 chunks' loads in flight while it computes one; 1: load, then compute), XS (1: the CTA copies its
// x slice to shared memory once and its warps read it there; 0: each warp loads x itself),
// SCALE_A (1: the group scale multiplies the dequantized operand; 0: each group's product, in
// fp32), MINB (CTAs per SM the register allocation must allow), LDW (1: weight loads bypass
// L1 and prefetch 256 bytes into L2), GCC (64-wide chunks per scale group when it is a
// compile-time constant, else 0), CPA (0: operands through registers as S says; P > 1: a
// P-stage cp.async pipeline in shared memory, P - 1 chunks in flight without holding registers).
//
// Layout (w4_mma.py has the packer): 64-row blocks of N ("nblk"), 64-wide chunks of K. Chunk
// c of nblk is 512 int32 words, [tile T (16 rows)][lane][MMA i]: lane = 4g + t holds, for the
// rows n0 = 16T + g and n1 = n0 + 8 and the four K positions p = 16t + 4i + (0..3) of the
// chunk, nibbles at bits 0/16: q[p, n0], q[p+1, n0]; 4/20: the same for n1; 8/24: q[p+2, n0],
// q[p+3, n0]; 12/28: the same for n1. So `(w >> 4j) & 0x000f000f | BIAS` is the A fragment's
// register j as a packed pair BIAS + q (bf16 128 / fp16 1024: q in the mantissa, exact).
// The MMA's K order is a permutation of the chunk's (logical 2t + 8r + h <-> physical
// 16t + 4i + 2r + h), applied to x as well, so a lane's B fragments for the whole chunk are
// x[token][16t .. 16t + 16): two 16-byte loads.
// Scales fp32 [G][N/64][g][8] and zeros [G][N/64][g][8] as BIAS + z in x's dtype, each
// ordered (T0 n0, T0 n1, T1 n0, ...); a lane reads its 2 * TW of each once per group.
//
// Split K: grid (ceil(nblk16 / (WARPS * TW)), splits); a split covers `cps` chunks (a
// multiple of the group's chunks). With splits > 1 each writes fp32 partials to ws[split][M][N];
// the last CTA of a column block to arrive (an arrival counter it resets) sums them in split
// order (deterministic) and writes y.

// 16-bit values are handled as raw bits (no cuda_fp16 / cuda_bf16 headers: NVRTC may not find them).
typedef unsigned short dt;
#if W4_BF16
#define BIAS_BITS 0x43004300u
#define MMA_OP "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
__device__ __forceinline__ float dt_to_f(dt v) { return __uint_as_float(((unsigned)v) << 16); }
__device__ __forceinline__ dt f_to_dt(float v) { dt h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v)); return h; }
// a * b + c on packed pairs (sm_80: fma is the bf16x2 arithmetic there is)
__device__ __forceinline__ unsigned fma2(unsigned a, unsigned b, unsigned c) {
    unsigned r; asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c)); return r;
}
#define ONE2 0x3f803f80u
#else
#define BIAS_BITS 0x64006400u
#define MMA_OP "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
__device__ __forceinline__ float dt_to_f(dt v) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v)); return f; }
__device__ __forceinline__ dt f_to_dt(float v) { dt h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v)); return h; }
__device__ __forceinline__ unsigned fma2(unsigned a, unsigned b, unsigned c) {
    unsigned r; asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c)); return r;
}
#define ONE2 0x3c003c00u
#endif
#define NEG_ZERO2 0x80008000u  // a * s + (-0) rounds a * s once and keeps its sign

__device__ __forceinline__ unsigned dup2(dt v) { return (unsigned)v | ((unsigned)v << 16); }

#define TILES_PER_BLK 4  // 16-row tiles in a 64-row block of the layout
// every accumulator fragment of a lane: tile a, token block b, register f
#define FOR_FRAGS                                       \
    _Pragma("unroll") for (int a = 0; a < TW; ++a)      \
    _Pragma("unroll") for (int b = 0; b < NB; ++b)      \
    _Pragma("unroll") for (int f = 0; f < 4; ++f)

__device__ __forceinline__ unsigned pair_bits(unsigned w, int j) {
    unsigned r;  // (w >> 4j) & 0x000f000f | BIAS, one LOP3 after the shift
    asm("lop3.b32 %0, %1, 0x000f000f, %2, 0xea;" : "=r"(r) : "r"(w >> (4 * j)), "r"(BIAS_BITS));
    return r;
}

__device__ __forceinline__ void mma(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm(MMA_OP " {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned word_of(const uint4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

#ifndef XS
#define XS 0
#endif
#ifndef S
#define S 2
#endif

// One K chunk's operands for a lane: TW weight words x4, NB x 16-element runs (unless XS),
// and at a group's first chunk its 2 * TW scales and zeros.
struct Stage {
    uint4 w[TW];
    uint4 x[NB][2];
    __align__(16) float s[2 * TW];
    __align__(16) dt z[2 * TW];
};

template <int BYTES>
__device__ __forceinline__ void ldg_bytes(void* dst, const void* src) {
    if (BYTES == 32) {
        reinterpret_cast<uint4*>(dst)[0] = __ldg(reinterpret_cast<const uint4*>(src));
        reinterpret_cast<uint4*>(dst)[1] = __ldg(reinterpret_cast<const uint4*>(src) + 1);
    } else if (BYTES == 16) {
        *reinterpret_cast<uint4*>(dst) = __ldg(reinterpret_cast<const uint4*>(src));
    } else if (BYTES == 8) {
        *reinterpret_cast<uint2*>(dst) = __ldg(reinterpret_cast<const uint2*>(src));
    } else {
        *reinterpret_cast<unsigned*>(dst) = __ldg(reinterpret_cast<const unsigned*>(src));
    }
}

#ifndef LDW
#define LDW 0
#endif
#ifndef GCC
#define GCC 0  // chunks per scale group as a compile-time constant (0: the kernel argument)
#endif

// A weight vector: read once, so (LDW 1) keep it out of L1 (x lives there) and have L2 fetch
// 256-byte blocks around it (the warp's next loads are its neighbours).
__device__ __forceinline__ uint4 ld_weights(const uint4* p) {
#if LDW
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
#else
    return __ldg(p);
#endif
}

__device__ __forceinline__ void load_stage(Stage& st, const uint4* wp, const dt* const* xp, const float* sc,
                                           const dt* zp, size_t rec0, size_t rec_step, int c, int GC) {
#pragma unroll
    for (int a = 0; a < TW; ++a) st.w[a] = ld_weights(wp + (size_t)c * 128 + a * 32);
#if !XS
#pragma unroll
    for (int b = 0; b < NB; ++b) {
        const uint4* p = reinterpret_cast<const uint4*>(xp[b] + (size_t)c * 64);
        st.x[b][0] = __ldg(p);
        st.x[b][1] = __ldg(p + 1);
    }
#endif
    if (c % GC == 0) {
        const size_t rec = rec0 + (size_t)(c / GC) * rec_step;
        ldg_bytes<8 * TW>(st.s, sc + rec);
        ldg_bytes<4 * TW>(st.z, zp + rec);
    }
}

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

// y[token][row] for the lane's fragments (rows past nbase as in the kernel's epilogue)
__device__ __forceinline__ void store_out(const float (&acc)[TW][NB][4], dt* out, long long stride_o, int M,
                                          int nbase, int t) {
    FOR_FRAGS {
        const int tok = 8 * b + 2 * t + (f & 1);
        if (tok < M) out[(size_t)tok * stride_o + nbase + 16 * a + 8 * (f >> 1)] = f_to_dt(acc[a][b][f]);
    }
}

#ifndef MINB
#define MINB 1
#endif

extern "C" __global__ void __launch_bounds__(WARPS * 32, MINB)
w4_mma_gemm(const dt* __restrict__ x, int M, long long stride_x, const uint4* __restrict__ wq,
            const float* __restrict__ sc, const dt* __restrict__ zp, int N, int KC, int gc_rt, int cps, float* __restrict__ ws,
            int* __restrict__ cnt, dt* __restrict__ out, long long stride_o) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int NBLK = N >> 6;
    const int GC = GCC > 0 ? GCC : gc_rt;  // chunks per group: a constant when compiled in (cheap % and /)
    const int unit = blockIdx.x * WARPS + warp;            // this warp's TW tiles
    const int nblk = unit / (TILES_PER_BLK / TW);
    const int tile0 = (unit % (TILES_PER_BLK / TW)) * TW;  // first tile inside the 64-row block
    const int splits = gridDim.y, split = blockIdx.y;
    const int cbeg = split * cps, cend = min(cbeg + cps, KC);
    const bool live = nblk < NBLK;
#if XS || CPA
    extern __shared__ __align__(16) unsigned char smem_raw[];
#endif
#if CPA  // the stages first; this thread's unit 0 of stage 0 (shared-space byte address)
    const unsigned ring = smem_u32(smem_raw) + threadIdx.x * 16;
#endif
#if XS  // then x[0:M, cbeg*64 : cend*64), row pitch xpitch
    dt* xs = reinterpret_cast<dt*>(smem_raw + STAGE_BYTES);
    const int xpitch = cps * 64 + 8;  // +16 bytes: lanes g and g + 1 hit different banks
#endif

    const uint4* wp = wq + (size_t)nblk * KC * 128 + tile0 * 32 + lane;
    // this lane's entries of a (group, nblk, g) record: (tile0 + a, r) at 2 * (tile0 + a) + r
    const size_t rec0 = ((size_t)nblk * 8 + g) * 8 + 2 * tile0, rec_step = (size_t)NBLK * 64;
    const dt* xp[NB];
#pragma unroll
    for (int b = 0; b < NB; ++b)  // tokens past M re-read row M - 1; their outputs are dropped
#if XS
        xp[b] = xs + min(b * 8 + g, M - 1) * xpitch + 16 * t - (size_t)cbeg * 64;
#else
        xp[b] = x + (size_t)min(b * 8 + g, M - 1) * stride_x + 16 * t;
#endif
    Acc A;
    FOR_FRAGS A.acc[a][b][f] = 0.f;
#if CPA
    if (live) {  // prologue: chunks cbeg .. cbeg + CPA - 2 in flight (one commit group each)
#pragma unroll
        for (int s = 0; s < CPA - 1; ++s) {
            if (cbeg + s < cend) issue_stage(ring + s * UNITS * NT * 16, wp, xp, sc, zp, rec0, rec_step, cbeg + s, GC);
            cp_async_commit();
        }
    }
#else
    Stage st[S];
    if (live) {  // prologue: chunks cbeg .. cbeg + S - 2 in flight
#pragma unroll
        for (int s = 0; s < S - 1; ++s)
            if (cbeg + s < cend) load_stage(st[s], wp, xp, sc, zp, rec0, rec_step, cbeg + s, GC);
    }
#endif
#if XS
    fill_x(xs, x, M, stride_x, xpitch, cbeg, cend);  // every thread: it ends in a CTA barrier
#endif
    if (live) {
#if CPA
        int slot = 0;  // the stage holding chunk c; chunk c + CPA - 1 goes to the one before it
        for (int c = cbeg; c < cend; ++c) {
            const int prev = slot == 0 ? CPA - 1 : slot - 1;  // consumed by the previous chunk
            if (c + CPA - 1 < cend) issue_stage(ring + prev * UNITS * NT * 16, wp, xp, sc, zp, rec0, rec_step, c + CPA - 1, GC);
            cp_async_commit();
            cp_async_wait<CPA - 1>();  // this thread's copies of chunk c have landed
            const bool gstart = (c - cbeg) % GC == 0;
            Stage cur;
            read_stage(cur, ring + slot * UNITS * NT * 16, gstart);
#if XS
            x_from_smem(cur, xp, c);
#endif
            compute_chunk(A, cur, gstart, (c - cbeg) % GC == GC - 1);
            slot = slot == CPA - 1 ? 0 : slot + 1;
        }
        cp_async_wait<0>();  // no copy may land after the CTA ends (empty groups complete at once)
#else
        for (int c0 = cbeg; c0 < cend; c0 += S) {
#pragma unroll
            for (int s = 0; s < S; ++s) {
                const int c = c0 + s;
                if (S == 1 && c < cend)  // no prefetch: load, then compute (fewer registers, more warps)
                    load_stage(st[0], wp, xp, sc, zp, rec0, rec_step, c, GC);
                else if (S > 1 && c + S - 1 < cend)  // keep S - 1 chunks in flight
                    load_stage(st[(s + S - 1) % S], wp, xp, sc, zp, rec0, rec_step, c + S - 1, GC);
                if (c < cend) {
#if XS
                    x_from_smem(st[s], xp, c);
#endif
                    compute_chunk(A, st[s], (c - cbeg) % GC == 0, (c - cbeg) % GC == GC - 1);
                }
            }
        }
#endif
    }

    // accumulator f of (tile a, token block b): row nbase + 16a + 8 * (f >> 1), token 8b + 2t + (f & 1)
    const int nbase = nblk * 64 + tile0 * 16 + g;
#define FRAG_TOK (8 * b + 2 * t + (f & 1))
#define FRAG_ROW (nbase + 16 * a + 8 * (f >> 1))
    if (splits == 1) {
        if (live) store_out(A.acc, out, stride_o, M, nbase, t);
        return;
    }
    if (live) {
        FOR_FRAGS if (FRAG_TOK < M) ws[((size_t)split * M + FRAG_TOK) * N + FRAG_ROW] = A.acc[a][b][f];
    }
    __threadfence();  // this thread's partials are visible device-wide before the count
    __syncthreads();
    __shared__ int last;
    if (threadIdx.x == 0) {
        last = atomicAdd(cnt + blockIdx.x, 1) == splits - 1;
        if (last) cnt[blockIdx.x] = 0;  // ready for the next launch (and CUDA graph replay)
    }
    __syncthreads();
    if (!last || !live) return;
    __threadfence();
    // split order (deterministic); one split's loads all in flight at once, not one by one
    FOR_FRAGS A.acc[a][b][f] = 0.f;
    for (int k = 0; k < splits; ++k) {
        const float* wk = ws + (size_t)k * M * N;
        FOR_FRAGS if (FRAG_TOK < M) A.acc[a][b][f] += __ldcg(wk + (size_t)FRAG_TOK * N + FRAG_ROW);
    }
    store_out(A.acc, out, stride_o, M, nbase, t);
#undef FRAG_TOK
#undef FRAG_ROW
}

// W^T [N, K] = (q - z) * s (fp32 math, rounded once) in x's dtype, for the prefill path
// (cuBLAS multiplies it next). One thread per (nblk, chunk, tile, lane): its four words
// cover rows n0, n1 and K positions 16t .. 16t + 16 of the chunk: two 32-byte row runs.
extern "C" __global__ void w4_mma_dequant(const uint4* __restrict__ wq, const float* __restrict__ sc,
                                          const dt* __restrict__ zp,
                                          int N, int KC, int GC, dt* __restrict__ wt) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const int NBLK = N >> 6;
    if (idx >= (long long)NBLK * KC * 128) return;
    const int lane = idx & 31, tile = (idx >> 5) & 3;
    const long long rest = idx >> 7;
    const int c = rest % KC, nblk = rest / KC;
    const int g = lane >> 2, t = lane & 3;
    const uint4 v = __ldg(wq + idx);
    const size_t gq = (((size_t)(c / GC) * NBLK + nblk) * 8 + g) * 8;
    const float BIAS = W4_BF16 ? 128.f : 1024.f;
#pragma unroll
    for (int r = 0; r < 2; ++r) {  // row n0 (r = 0) or n1
        const float s = sc[gq + 2 * tile + r], z = dt_to_f(zp[gq + 2 * tile + r]) - BIAS;
        __align__(16) dt vals[16];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const unsigned w = word_of(v, i);
#pragma unroll
            for (int e = 0; e < 4; ++e) {  // K position 4i + e: nibble of register 2 * (e >> 1) + r, half e & 1
                const int bit = 4 * (2 * (e >> 1) + r) + 16 * (e & 1);
                vals[4 * i + e] = f_to_dt(((float)((w >> bit) & 15) - z) * s);
            }
        }
        const size_t row = (size_t)nblk * 64 + tile * 16 + g + 8 * r;
        uint4* dst = reinterpret_cast<uint4*>(wt + row * ((size_t)KC * 64) + (size_t)c * 64 + 16 * t);
        dst[0] = *reinterpret_cast<uint4*>(&vals[0]);
        dst[1] = *reinterpret_cast<uint4*>(&vals[8]);
    }
}

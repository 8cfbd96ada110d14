// Device helpers of the W4A16 mma kernel (w4_mma.cu): 16-bit float bits, the MMA, the
// dequantizing LOP3 and the register path's per-chunk loads. w4_mma_jit.SOURCE compiles
// w4_mma_ops.cuh, w4_mma_stages.cuh and w4_mma.cu as one translation unit, in that order.

// 16-bit values are handled as raw bits (no cuda_fp16 / cuda_bf16 headers: NVRTC may not find them).
typedef unsigned short dt;
#if W4_BF16
#define BIAS_BITS 0x43004300u    // 128: BIAS + q, q in the low mantissa bits
#define NEG_LO2 0xC300C300u      // -(128 + z) with z in bits 0-3
// (no nibble-in-place registers: bits 4-7 of a bf16 reach its exponent; each register is shifted)
#define HI_IN_PLACE 0
#define MMA_OP "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
__device__ __forceinline__ float dt_to_f(dt v) { return __uint_as_float(((unsigned)v) << 16); }
__device__ __forceinline__ dt f_to_dt(float v) { dt h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v)); return h; }
// a * b + c on packed pairs (sm_80: fma is the bf16x2 arithmetic there is)
__device__ __forceinline__ unsigned fma2(unsigned a, unsigned b, unsigned c) {
    unsigned r; asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c)); return r;
}
#define ONE2 0x3f803f80u
#else
#define BIAS_BITS 0x64006400u    // 1024
#define NEG_LO2 0xE400E400u      // -(1024 + z) with z in bits 0-3: a row n0 register's zero point
#define NEG_HI2 0xD400D400u      // -(64 + z) with z in bits 4-7: a row n1 register's (HI_IN_PLACE)
#define SIXTEENTH2 0x2C002C00u   // 1 / 16
#define HI_IN_PLACE 1
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
// the lane's fragment pairs: f (token 8b + 2t + f) and f + 2 (the same token, the row 8 below)
#define FOR_PAIRS                                       \
    _Pragma("unroll") for (int a = 0; a < TW; ++a)      \
    _Pragma("unroll") for (int b = 0; b < NB; ++b)      \
    _Pragma("unroll") for (int f = 0; f < 2; ++f)

// (a & mask) | c in one LOP3
template <unsigned MASK>
__device__ __forceinline__ unsigned and_or(unsigned a, unsigned c) {
    unsigned r;
    asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(r) : "r"(a), "n"(MASK), "r"(c));
    return r;
}
// Register j of an A fragment from its word as a pair of 16-bit floats BIAS + q: (w >> 4j) &
// 0x000f000f | BIAS. With HI_IN_PLACE (fp16) one shift per word, not three (Marlin's trick):
// an odd j leaves its nibbles in place, (w >> 4(j - 1)) & 0x00f000f0 | BIAS = BIAS + 16 q
// (exact: 1024 + 16q <= 1264), and its zero-point pair takes the 16 out again.
__device__ __forceinline__ unsigned pair_bits(unsigned w, int j) {
#if HI_IN_PLACE
    const unsigned src = j < 2 ? w : w >> 8;
    return (j & 1) ? and_or<0x00f000f0u>(src, BIAS_BITS) : and_or<0x000f000fu>(src, BIAS_BITS);
#else
    return and_or<0x000f000fu>(w >> (4 * j), BIAS_BITS);
#endif
}

__device__ __forceinline__ void mma(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm(MMA_OP " {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ uint4 lds128(unsigned a) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
    return v;
}

__device__ __forceinline__ unsigned word_of(const uint4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

#ifndef XS
#define XS 0
#endif
#ifndef XR
#define XR 0
#endif
#define XIN (XS || XR)  // x does not travel in a warp's own loads / stages: a CTA copy holds it
#ifndef S
#define S 2
#endif
#ifndef KW
#define KW 1
#endif

// Zero-point words of a lane: entries (tile a, row r) of two tiles per word (ZW words).
#define ZW ((TW + 1) / 2)
// One K chunk's operands for a lane: TW weight words x4, NB x 16-element runs (unless XS),
// and at a group's first chunk its 2 * TW scales (fp16 bits) and zero-point words (entry
// (a, r) at bits 8 (a & 1) + 4 r of word a >> 1, in both 16-bit halves; a lane whose first
// tile is odd has its word shifted down by 8).
struct Stage {
    uint4 w[TW];
    uint4 x[NB][2];
    __align__(16) unsigned short s[2 * TW];
    __align__(8) unsigned z[ZW];
};

// The scales are fp16 whatever the model dtype (the checkpoints' own scale dtype).
__device__ __forceinline__ float h16_to_f(unsigned short v) {
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v)); return f;
}

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

__device__ __forceinline__ void load_stage(Stage& st, const uint4* wp, const dt* const* xp, const unsigned short* sc,
                                           const unsigned* zp, size_t rec0, size_t rec_step, int c, int GC) {
#pragma unroll
    for (int a = 0; a < TW; ++a) st.w[a] = ld_weights(wp + (size_t)c * 128 + a * 32);
#if !XIN
#pragma unroll
    for (int b = 0; b < NB; ++b) {
        const uint4* p = reinterpret_cast<const uint4*>(xp[b] + (size_t)c * 64);
        st.x[b][0] = __ldg(p);
        st.x[b][1] = __ldg(p + 1);
    }
#endif
    if (c % GC == 0) {
        const size_t rec = rec0 + (size_t)(c / GC) * rec_step;
        ldg_bytes<4 * TW>(st.s, sc + rec);
        ldg_bytes<4 * ZW>(st.z, zp + (rec >> 2));  // two words per (group, nblk, g): tiles 0-1, 2-3
        st.z[0] >>= 4 * (rec & 3);                 // (TW 1, an odd tile: its entries sit 8 bits up)
    }
}

// The register path's chunk addresses (S stages, no CPA), from per-warp bases and 32-bit offsets:
// local chunk j of share kw is chunk cbeg + ((j / GC) * KW + kw) * GC + j % GC (chunk_at), so
// its weights lie off(j) = ((j / GC) * KW * GC + j % GC) * 128 vectors past the share's first
// chunk, and its group's records (j / GC) * KW record steps past the share's first group's. One
// IMAD.WIDE per pointer, where load_stage's 64-bit chunk products took ~20 instructions a chunk.
template <typename T>
__device__ __forceinline__ T* opaque(T* p) {
    asm("mov.b64 %0, %0;" : "+l"(p));
    return p;
}
struct Cursor {
    const uint4* w;
    const dt* x[NB];
    const unsigned short* s;
    const unsigned* z;
    int zsh, gstep;  // zero-word shift (rec0 & 3); records between a share's consecutive groups
    __device__ __forceinline__ Cursor(const uint4* wp, const dt* const* xp, const unsigned short* sc,
                                      const unsigned* zp, size_t rec0, size_t rec_step, int c0, int GC) {
        w = wp + (size_t)c0 * 128;
#pragma unroll
        for (int b = 0; b < NB; ++b) x[b] = xp[b] + (size_t)c0 * 64;
        const size_t rec = rec0 + (size_t)(c0 / GC) * rec_step;
        s = sc + rec;
        z = zp + (rec >> 2);  // (rec_step is a multiple of 4: the shift stays rec0's)
        zsh = 4 * (int)(rec & 3);
        gstep = KW * (int)rec_step;
        // opaque: else the compiler folds the bases back into the kernel parameters and redoes
        // the 64-bit products per chunk
        w = opaque(w);
#pragma unroll
        for (int b = 0; b < NB; ++b) x[b] = opaque(x[b]);
        s = opaque(s);
        z = opaque(z);
    }
    // local chunk j into st; gstart: j opens a group (its scales and zero points load too)
    __device__ __forceinline__ void load(Stage& st, int j, int GC) const {
        const unsigned lg = (unsigned)j / GC, off = lg * (KW * GC) + (unsigned)j % GC;
#pragma unroll
        for (int a = 0; a < TW; ++a) st.w[a] = ld_weights(w + off * 128 + a * 32);
#if !XIN
#pragma unroll
        for (int b = 0; b < NB; ++b) {
            const uint4* p = reinterpret_cast<const uint4*>(x[b] + off * 64);
            st.x[b][0] = __ldg(p);
            st.x[b][1] = __ldg(p + 1);
        }
#endif
        if ((unsigned)j % GC == 0) {
            const unsigned r = lg * gstep;
            ldg_bytes<4 * TW>(st.s, s + r);
            ldg_bytes<4 * ZW>(st.z, z + (r >> 2));
            st.z[0] >>= zsh;
        }
    }
};


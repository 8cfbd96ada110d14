// flash_decode's element types, constants and device helpers (16-byte unpacking, cp.async);
// jit.SOURCE compiles this file and kernels.cu as one NVRTC translation unit.

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
#define FULL_MASK 0xffffffffu
#define NEG_INF __int_as_float(0xff800000)
#define FLT_MAX_ 3.402823466e38f
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f
#define RESCALE_SLACK 8.f  // log2 units: exp2(s - m) <= 256, far from fp32 overflow

#ifndef HEADS
#define HEADS GROUP
#endif

// Smallest power of two >= x, for 1 <= x <= 32 (a macro: NVRTC rejects unannotated functions).
#define POW2CEIL(x) ((x) <= 1 ? 1 : (x) <= 2 ? 2 : (x) <= 4 ? 4 : (x) <= 8 ? 8 : (x) <= 16 ? 16 : 32)

constexpr int VEC = 16 / (int)sizeof(st);                   // elements per 16-byte vector
constexpr int NV = HEAD_DIM / VEC;                          // vectors per K/V row
constexpr int GH = HEADS;                                   // query heads per program
constexpr int HSLICES = (GROUP + GH - 1) / GH;              // programs per KV head (jit.py agrees)
// Two vectors per lane (16 bf16 elements) halve the shuffles and exps per element, but
// q + accumulators then take 2 x 16 x HEADS registers: only while HEADS <= 4.
constexpr int VPL = (GH <= 4 && NV >= 2) ? 2 : 1;           // vectors per lane per row
constexpr int EPL = VPL * VEC;                              // elements per lane per row
constexpr int LPK = POW2CEIL((NV + VPL - 1) / VPL);         // lanes per key (a power of two)
constexpr int KPW = WARP / LPK;                             // keys a warp holds at once
constexpr int NWARPS = 4;
constexpr int NTHREADS = NWARPS * WARP;
constexpr int UNROLL = 2 / VPL;                             // keys per thread per stage
constexpr int STAGES = 4;                                   // cp.async ring depth
constexpr int WKEYS = KPW * UNROLL;                         // keys per warp per stage
constexpr int PKEYS = NWARPS * WKEYS;                       // keys per program per stage
constexpr int RING_BYTES = STAGES * UNROLL * 2 * VPL * NTHREADS * 16;
constexpr int COMB_BYTES = NWARPS * GH * (HEAD_DIM + 2) * 4;
constexpr int SMEM_BYTES = RING_BYTES > COMB_BYTES ? RING_BYTES : COMB_BYTES;
// Up to 168 registers (3 programs per SM) with <= 4 heads; more heads need ~190 (2 per SM).
constexpr int MIN_PROGRAMS = GH <= 4 ? 3 : 2;

static_assert(HEAD_DIM % VEC == 0 && NV >= 1 && NV <= 32, "HEAD_DIM must be a multiple of 16 bytes, <= 32 vectors");
static_assert(LPK * VPL >= NV && LPK <= WARP, "lane mapping must cover the row");
static_assert(BLOCK_SIZE % UNROLL == 0, "a thread's keys of one stage must share a KV block");
static_assert((STAGES & (STAGES - 1)) == 0, "STAGES must be a power of two");
static_assert(SMEM_BYTES <= 48 * 1024, "static shared memory limit");
static_assert(GH >= 1 && GH <= 16 && HSLICES * GH >= GROUP, "head slicing");

// Whether lane r of a key group holds vector j of the row (false only for the padding
// lanes of head dims that are not a power of two vectors, e.g. 96 bf16 = 12 vectors).
__device__ __forceinline__ bool owns(int r, int j) { return NV == LPK * VPL || r + j * LPK < NV; }

__device__ __forceinline__ void unpack(const uint4& w, float* f) {
#if KV_DTYPE == 2
    f[0] = __uint_as_float(w.x); f[1] = __uint_as_float(w.y);
    f[2] = __uint_as_float(w.z); f[3] = __uint_as_float(w.w);
#elif KV_DTYPE == 1
    const unsigned int x[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // element 2i is the low half (little-endian)
        f[2 * i] = __uint_as_float(x[i] << 16);
        f[2 * i + 1] = __uint_as_float(x[i] & 0xffff0000u);
    }
#else
    const unsigned int x[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; ++i)
        asm("{ .reg .f16 lo, hi;\n\tmov.b32 {lo, hi}, %2;\n\tcvt.f32.f16 %0, lo;\n\tcvt.f32.f16 %1, hi; }"
            : "=f"(f[2 * i]), "=f"(f[2 * i + 1]) : "r"(x[i]));
#endif
}

__device__ __forceinline__ unsigned int smem_addr(const void* p) {
    unsigned int a;
    asm("{ .reg .u64 t;\n\tcvta.to.shared.u64 t, %1;\n\tcvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// 16-byte global -> shared copy (dst: shared-window address; dst_ptr: the same as a pointer);
// bytes == 0 writes zeros and reads nothing.
__device__ __forceinline__ void cp_async16(unsigned int dst, uint4* dst_ptr, const void* src, int bytes) {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(bytes) : "memory");
#else  // no cp.async before sm_80: a synchronous copy keeps the code correct
    *dst_ptr = bytes ? *reinterpret_cast<const uint4*>(src) : make_uint4(0, 0, 0, 0);
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
template <int N> __device__ __forceinline__ void cp_async_wait() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
#endif
}
